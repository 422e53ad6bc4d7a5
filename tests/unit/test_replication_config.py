"""ReplicationConfig: the `replication:` settings, each problem named by its key."""

from __future__ import annotations

from typing import Any

import pytest

from amqtt_durable.errors import ConfigError
from amqtt_durable.replication.config import ReplicationConfig

HA = {"coordinator": ["http://127.0.0.1:2379"], "name": "broker-a"}


def test_an_ha_node_and_fixed_roles_are_accepted() -> None:
    config = ReplicationConfig.from_mapping({**HA, "mode": "async", "listen": "0.0.0.0:7883", "lease_ttl": 3,
                                             "loop_wait": 1, "demote_margin": 0.5})
    assert (config.role, config.mode, config.advertised, config.prefix) == (
        "auto", "async", "0.0.0.0:7883", "/amqtt-durable/amqtt-durable/")
    assert config.loop_wait == 1.0
    backup = ReplicationConfig.from_mapping({"role": "backup", "primary": "10.0.0.1:7883"})
    assert backup.coordinator == []
    assert ReplicationConfig.from_mapping({"role": "primary", "advertise": "db1:7883"}).advertised == "db1:7883"
    assert ReplicationConfig.from_mapping({**HA, "coordinator": "http://e:2379"}).coordinator == ["http://e:2379"]


@pytest.mark.parametrize(
    ("settings", "key", "words"),
    [
        ({}, "replication.role", "needs a coordinator"),
        ({**HA, "role": "primary"}, "replication.role", "must be auto"),
        ({**HA, "name": ""}, "replication.name", "needed with a coordinator"),
        ({**HA, "mode": "semi"}, "replication.mode", "sync, async"),
        ({**HA, "listen": "7883"}, "replication.listen", "host:port"),
        ({**HA, "advertise": "db:0"}, "replication.advertise", "host:port"),
        ({**HA, "coordinator": ["https://e:2379"]}, "replication.coordinator", "etcd client URLs"),
        ({**HA, "coordinator": [2379]}, "replication.coordinator", "list of URLs"),
        ({**HA, "cluster": "a/b"}, "replication.cluster", "without '/'"),
        ({"role": "backup"}, "replication.primary", "needed on a backup"),
        ({"role": "backup", "primary": "db1"}, "replication.primary", "host:port"),
        ({**HA, "lease_ttl": 1}, "replication.lease_ttl", "at least 2"),
        ({**HA, "lease_ttl": 2.5}, "replication.lease_ttl", "whole number"),
        ({**HA, "demote_margin": 5}, "replication.demote_margin", "below lease_ttl"),
        ({**HA, "loop_wait": 0}, "replication.loop_wait", "above 0"),
        ({**HA, "loop_wait": 2.5}, "replication.loop_wait", "two renewal attempts"),
        ({**HA, "ack_timeout": float("inf")}, "replication.ack_timeout", "finite"),
        ({**HA, "retained_batches": 0}, "replication.retained_batches", "at least 1"),
        ({**HA, "retained_bytes": 10}, "replication.retained_bytes", "1024"),
        ({**HA, "snapshot_chunk_bytes": True}, "replication.snapshot_chunk_bytes", "whole number"),
        ({**HA, "backups": ["a"]}, "replication.backups", "unknown setting"),
    ],
)
def test_a_bad_setting_is_named(settings: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ReplicationConfig.from_mapping(settings)
    assert caught.value.key == key
    assert words in caught.value.problem


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="'replication': expected a mapping"):
        ReplicationConfig.from_mapping(["role"])
