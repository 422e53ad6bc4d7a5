"""SilenceWatch: on_silence once, after ``limit`` seconds without anything heard."""

from __future__ import annotations

import asyncio
import time

from amqtt_durable.silence import SilenceWatch


def test_silence_is_reported_once_after_the_limit_and_hearing_something_puts_it_off() -> None:
    async def main() -> None:
        silent = asyncio.Event()
        calls: list[float] = []

        def on_silence() -> None:
            calls.append(time.monotonic())
            silent.set()

        watch = SilenceWatch(0.2, on_silence)
        started = time.monotonic()
        watch.start()
        heard = asyncio.Event()

        def hear() -> None:
            watch.heard()
            heard.set()

        loop = asyncio.get_running_loop()
        loop.call_later(0.15, hear)  # before the limit: the deadline moves to 0.35 s
        async with asyncio.timeout(5):
            await heard.wait()
            await silent.wait()
        assert len(calls) == 1
        assert calls[0] - started >= 0.34, "reported before the limit passed since last heard"
        watch.stop()

    asyncio.run(main())


def test_a_stopped_watch_reports_nothing() -> None:
    async def main() -> None:
        calls: list[bool] = []
        watch = SilenceWatch(0.05, lambda: calls.append(True))
        watch.start()
        watch.stop()
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, done.set)
        async with asyncio.timeout(5):
            await done.wait()
        assert calls == []

    asyncio.run(main())
