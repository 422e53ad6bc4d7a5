"""``max_awaiting_pubrel`` as AwaitingPubrel counts it: the Session's held QoS 2 publishes (carried
over from earlier connections too) and the handlers under way, each packet id once."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from amqtt.mqtt.publish import PublishPacket

from amqtt_durable.amqtt_glue import AwaitingPubrel, _await_pubrel
from amqtt_durable.wire import encode_pubrec


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


def test_a_publish_handled_while_a_pubrel_of_its_id_was_handled_elsewhere_holds_nothing_again() -> None:
    """A take-over: a DUP re-send's handler runs on one connection while the PUBREL of its id is
    handled on the other (AwaitingPubrel.open is per connection, the Session's held publishes and
    its count of PUBRELs handled are shared): at its PUBREC the message is not held again, which
    would keep a stale entry awaiting a PUBREL that already came; a later new publish of the id is."""
    held: dict[int, object] = {}
    releases: dict[int, int] = {}
    old, new = AwaitingPubrel("pub", 0, held, releases), AwaitingPubrel("pub", 0, held, releases)
    written: list[bytes] = []
    handler = SimpleNamespace(durable_transport=SimpleNamespace(write=written.append))
    session = SimpleNamespace(inflight_in=held)
    packet = PublishPacket.build("t", b"m", 7, True, 2, False)
    assert new.admit(7)
    before = new.releases_of(7)
    old.released(7)  # the PUBREL, read on the old connection, released the id meanwhile
    _await_pubrel(handler, session, packet, hold=new.releases_of(7) == before)
    new.done(7)
    assert held == {}, "held again after its PUBREL"
    assert written == [encode_pubrec(7)], "PUBREC all the same"
    assert new.admit(7)
    before = new.releases_of(7)
    _await_pubrel(handler, session, packet, hold=new.releases_of(7) == before)
    assert list(held) == [7], "a publish no PUBREL overtook is held"
