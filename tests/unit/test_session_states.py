"""SessionStates, the glue's stand-in for the transitions.Machine amqtt builds per Session, behaves
as amqtt's own: same states, same refusals, same callbacks, for every sequence of triggers."""

from __future__ import annotations

import itertools

import pytest
from amqtt.session import Session
from transitions import MachineError

from amqtt_durable.amqtt_glue import AMQTT_INIT_STATES, SessionStates, _init_session_states

TRIGGERS = ("connect", "disconnect")


class Recording(Session):
    """A Session that counts the entries into each state amqtt's callbacks see."""

    def __init__(self, init_states: object) -> None:
        self._init_with = init_states
        self.entered: list[str] = []
        super().__init__()

    def _init_states(self) -> None:
        self._init_with(self)  # type: ignore[operator]

    def _on_enter_connected(self) -> None:
        self.entered.append("connected")
        super()._on_enter_connected()

    def _on_enter_disconnected(self) -> None:
        self.entered.append("disconnected")
        super()._on_enter_disconnected()


def observe(session: Recording, trigger: str) -> tuple[object, ...]:
    machine = session.transitions
    try:
        outcome: object = getattr(machine, trigger)()
    except MachineError:
        outcome = MachineError
    return (
        outcome,
        machine.state,
        machine.is_new(),
        machine.is_connected(),
        machine.is_disconnected(),
        tuple(session.entered),
        session.last_connect_time is not None,
        session.last_disconnect_time is not None,
    )


@pytest.mark.parametrize("length", range(1, 7))
def test_every_trigger_sequence_matches_amqtts_machine(length: int) -> None:
    for sequence in itertools.product(TRIGGERS, repeat=length):
        theirs, ours = Recording(AMQTT_INIT_STATES), Recording(_init_session_states)
        assert isinstance(ours.transitions, SessionStates)
        assert ours.transitions.state == theirs.transitions.state == "new"
        for trigger in sequence:
            assert observe(ours, trigger) == observe(theirs, trigger), sequence
        assert repr(ours) == repr(theirs)


def test_connect_while_connected_raises_what_amqtts_take_over_catches() -> None:
    session = Recording(_init_session_states)
    session.transitions.connect()
    with pytest.raises(MachineError):
        session.transitions.connect()
    assert session.transitions.is_connected()
    assert session.entered == ["connected"]
