"""durable_client.cache: GemFire's client-cache rules for live, replayed and initial (retained) values."""

from __future__ import annotations

import threading

from durable_client.cache import CacheEntry, LastValueCache
from durable_client.events import Event


def ev(
    topic: str = "t",
    payload: bytes = b"v",
    seq: int = 1,
    *,
    epoch: int = 1,
    replayed: bool = False,
    retained: bool = False,
    stream: bool = False,
) -> Event:
    return Event(topic, payload, 1, seq, epoch, 100.0 + seq, replayed, retained, False, stream)


# ------------------------------------------------------------------- live
def test_live_event_puts_the_value() -> None:
    cache = LastValueCache()
    assert cache.apply(ev(payload=b"a", seq=1))
    assert cache.get("t") == b"a"
    assert cache.entry("t") == CacheEntry(b"a", 1, 1, 101.0, "valid")
    assert "t" in cache and len(cache) == 1 and list(cache) == ["t"]


def test_newer_live_event_replaces_older_is_ignored() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"a", seq=5))
    assert cache.apply(ev(payload=b"b", seq=7))
    assert not cache.apply(ev(payload=b"old", seq=6))
    assert cache.get("t") == b"b"


def test_same_seq_again_is_harmless() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"a", seq=5))
    cache.apply(ev(payload=b"a", seq=5))
    assert cache.get("t") == b"a"


def test_seqs_of_another_epoch_do_not_compare() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"old session", seq=900, epoch=1))
    assert cache.apply(ev(payload=b"new session", seq=3, epoch=2))  # a lost session starts again
    assert cache.get("t") == b"new session"


def test_topics_are_independent() -> None:
    cache = LastValueCache()
    cache.apply(ev("a", b"1", seq=10))
    cache.apply(ev("b", b"2", seq=2))
    assert (cache.get("a"), cache.get("b")) == (b"1", b"2")
    assert sorted(cache) == ["a", "b"]


# --------------------------------------------------------------- replayed
def test_replayed_events_are_never_applied() -> None:
    cache = LastValueCache()
    assert not cache.apply(ev(payload=b"old", seq=1, replayed=True))
    assert cache.get("t") is None and cache.entry("t") is None
    cache.apply(ev(payload=b"current", seq=2))
    assert not cache.apply(ev(payload=b"older", seq=9, replayed=True))
    assert cache.get("t") == b"current"


def test_replayed_delete_does_not_destroy() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"current", seq=2))
    cache.apply(ev(payload=b"", seq=3, replayed=True))
    assert cache.get("t") == b"current"


# ------------------------------------------------------------ tombstones
def test_empty_live_payload_destroys_and_leaves_a_tombstone_until_the_marker() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"a", seq=1))
    assert cache.apply(ev(payload=b"", seq=2))
    assert cache.get("t") is None
    assert "t" not in cache and len(cache) == 0 and list(cache) == []
    entry = cache.entry("t")
    assert entry is not None and entry.state == "destroyed" and entry.value is None and entry.seq == 2
    cache.marker()
    assert cache.entry("t") is None


def test_delete_of_an_unknown_topic_still_blocks_initial_values() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"", seq=4))
    assert not cache.apply(ev(payload=b"stale initial", seq=1, retained=True))
    assert cache.get("t") is None


def test_live_put_after_a_tombstone_revives_the_entry() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"", seq=4))
    assert cache.apply(ev(payload=b"back", seq=5))
    assert cache.get("t") == b"back"


def test_older_live_put_does_not_undo_a_delete() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"", seq=4))
    assert not cache.apply(ev(payload=b"older", seq=3))
    assert cache.get("t") is None


# ----------------------------------------------------- retained (initial)
def test_retained_fills_an_absent_entry() -> None:
    cache = LastValueCache()
    assert cache.apply(ev(payload=b"init", seq=1, retained=True))
    assert cache.get("t") == b"init"


def test_retained_never_overwrites_a_valid_value() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"current", seq=1))
    assert not cache.apply(ev(payload=b"init", seq=9, retained=True))
    assert cache.get("t") == b"current"


def test_retained_fills_an_invalidated_entry() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"current", seq=5))
    cache.invalidate("t")
    entry = cache.entry("t")
    assert entry is not None and entry.state == "invalid" and entry.value is None
    assert cache.get("t") is None and "t" not in cache
    assert cache.apply(ev(payload=b"init", seq=2, retained=True))
    assert cache.get("t") == b"init"


def test_retained_does_not_touch_a_tombstone_and_the_marker_clears_it() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"a", seq=1))
    cache.apply(ev(payload=b"", seq=2))
    assert not cache.apply(ev(payload=b"init", seq=3, retained=True))
    assert cache.entry("t") is not None and cache.get("t") is None
    cache.marker()
    assert cache.apply(ev(payload=b"init", seq=3, retained=True))  # no tombstone any more: "no entry -> put"
    assert cache.get("t") == b"init"


def test_retained_and_replayed_counts_as_an_initial_value() -> None:
    # Queued with a subscription before `ready`: flagged both; still the topic's initial value.
    cache = LastValueCache()
    assert cache.apply(ev(payload=b"init", seq=1, retained=True, replayed=True))
    assert cache.get("t") == b"init"


def test_empty_retained_payload_initialises_nothing() -> None:
    cache = LastValueCache()
    assert not cache.apply(ev(payload=b"", seq=1, retained=True))
    assert cache.entry("t") is None


def test_invalidate_of_absent_or_destroyed_entry_does_nothing() -> None:
    cache = LastValueCache()
    cache.invalidate("missing")
    assert cache.entry("missing") is None
    cache.apply(ev(payload=b"", seq=1))
    cache.invalidate("t")
    entry = cache.entry("t")
    assert entry is not None and entry.state == "destroyed"


def test_live_event_fills_an_invalidated_entry() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"a", seq=1))
    cache.invalidate("t")
    cache.apply(ev(payload=b"b", seq=2))
    assert cache.get("t") == b"b"


# ---------------------------------------------------------------- streams
def test_stream_events_apply_like_live_events() -> None:
    cache = LastValueCache()
    assert cache.apply(ev(payload=b"s1", seq=1, epoch=0, stream=True))
    assert cache.apply(ev(payload=b"s3", seq=3, epoch=0, stream=True))
    assert not cache.apply(ev(payload=b"s2", seq=2, epoch=0, stream=True))
    assert cache.get("t") == b"s3"
    assert cache.apply(ev(payload=b"", seq=4, epoch=0, stream=True))
    assert cache.get("t") is None


def test_stream_and_session_seqs_do_not_compare() -> None:
    cache = LastValueCache()
    cache.apply(ev(payload=b"session", seq=500, epoch=0))
    assert cache.apply(ev(payload=b"stream", seq=2, epoch=0, stream=True))
    assert cache.get("t") == b"stream"


# ------------------------------------------------------------ reads, stale
def test_reads_keep_working_while_stale() -> None:
    cache = LastValueCache()
    assert cache.stale  # not connected yet
    cache._set_stale(False)
    cache.apply(ev(payload=b"a", seq=1))
    cache._set_stale(True)
    assert cache.stale and cache.get("t") == b"a"
    assert cache.get("missing", b"default") == b"default"
    assert 5 not in cache  # type: ignore[operator]


def test_concurrent_writers_and_readers() -> None:
    cache = LastValueCache()
    errors: list[BaseException] = []

    def write(topic: str) -> None:
        for seq in range(1, 2001):
            cache.apply(ev(topic, str(seq).encode(), seq))

    def read() -> None:
        try:
            for _ in range(2000):
                for topic in cache:
                    cache.get(topic)
                len(cache)
        except BaseException as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(f"t{i}",)) for i in range(4)] + [threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert {cache.get(f"t{i}") for i in range(4)} == {b"2000"}
