"""``max_awaiting_pubrel`` as AwaitingPubrel counts it: the Session's held QoS 2 publishes (carried
over from earlier connections too) and the handlers under way, each packet id once."""

from __future__ import annotations

import logging

import pytest

from amqtt_durable.amqtt_glue import AwaitingPubrel


def test_held_ids_count_and_a_resend_of_one_counts_once() -> None:
    held: dict[int, object] = {1: "carried over", 2: "carried over"}
    awaiting = AwaitingPubrel("pub", 3, held)
    assert awaiting.admit(1), "a re-send of a carried-over id"
    assert awaiting.admit(3), "a third id"
    assert awaiting.count() == 3
    assert not awaiting.admit(4), "past the limit"
    awaiting.done(1)  # the re-send's handler ends; the id stays held
    assert not awaiting.admit(4)
    del held[2]  # its PUBREL
    assert awaiting.admit(4)


def test_a_client_over_the_limit_may_resend_and_release_but_not_add(caplog: pytest.LogCaptureFixture) -> None:
    """Held past the limit already (two connections of the client id at once): the ids it holds
    are still taken (their PUBREC, their PUBREL); a new id is refused, with the WARNING, until
    the PUBRELs bring it below the limit."""
    held: dict[int, object] = dict.fromkeys(range(1, 6), "held")
    awaiting = AwaitingPubrel("pub", 3, held)
    assert all(awaiting.admit(packet_id) for packet_id in range(1, 6))
    for packet_id in range(1, 6):
        awaiting.done(packet_id)
    with caplog.at_level(logging.WARNING, logger="amqtt_durable"):
        assert not awaiting.admit(6)
    assert "closing the connection of pub: a QoS 2 PUBLISH (packet id 6) while 5 QoS 2 publishes" in caplog.text
    for packet_id in (1, 2):
        del held[packet_id]
    assert not awaiting.admit(6), "3 held: still at the limit"
    del held[3]
    assert awaiting.admit(6)


def test_0_is_no_limit() -> None:
    awaiting = AwaitingPubrel("pub", 0, {})
    assert all(awaiting.admit(packet_id) for packet_id in range(1, 2001))
