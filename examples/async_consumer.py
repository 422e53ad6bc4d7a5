#!/usr/bin/env python3
"""An asyncio consumer with AsyncDurableClient: queued orders replayed, then live ones, each once.

Needs a running broker with the durable plugin (``make run`` in another terminal):

    .venv/bin/python examples/async_consumer.py [--host 127.0.0.1] [--port 1883] [--count 20]

1. The consumer's durable session is set up (subscription to orders/#), and it goes away.
2. While it is away --count orders are published; the broker queues them.
3. The consumer comes back: ``async for event in events`` gets the queued orders
   (event.replayed); a task awaiting ``client.live()`` gets the marker after the last of
   them and publishes --count live orders, which follow.
   Each order is acknowledged when its loop body finishes; the first attempt at order 3
   raises on purpose, so that order comes again and is processed then.

Exit code 0 when every order was processed exactly once, in order, replayed ones before the
marker; otherwise 1. Every wait is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

from durable_client import AsyncDurableClient, DurableClient, DurableClientError, Event

FILTER = "orders/#"


async def consume(args: argparse.Namespace, client_id: str) -> list[Event]:
    processed: list[Event] = []
    failed_once = False
    async with AsyncDurableClient(
        client_id, args.host, args.port, request_timeout=args.timeout, reconnect_max_delay=1.0
    ) as client:
        await client.subscribe(FILTER, qos=1)
        await client.ready_for_events()  # the broker replays what it queued, then the marker
        live_orders = asyncio.create_task(publish_after_the_marker(args, client))
        while len(processed) < 2 * args.count:
            try:
                # Leaving this block normally (break) acknowledges the order the body was on;
                # an exception does not, so that order comes again.
                async with client.events() as events:
                    async for event in events:
                        if event.payload == b"order-3" and not failed_once:
                            failed_once = True
                            raise RuntimeError("order-3: the database was busy (on purpose)")
                        processed.append(event)  # acknowledged when this body finishes
                        if len(processed) == 2 * args.count:
                            break
            except RuntimeError as exc:
                print(f"not processed, comes again: {exc}")
        await live_orders
        await client.close(keep_session=False)  # the example leaves nothing behind
    return processed


async def publish_after_the_marker(args: argparse.Namespace, client: AsyncDurableClient) -> None:
    marker = await client.live()  # every queued order was processed before it
    print(f"marker: {marker.replayed} replayed order(s); live from now on")
    await asyncio.to_thread(publish, args, "live", args.count)


def publish(args: argparse.Namespace, kind: str, count: int) -> None:
    publisher = DurableClient(f"orders-{uuid.uuid4().hex[:8]}", args.host, args.port, durable_session=False)
    publisher.connect(args.timeout)
    try:
        start = 0 if kind == "queued" else count
        for n in range(start, start + count):
            publisher.publish(f"orders/{kind}", f"order-{n}", qos=1, timeout=args.timeout)
    finally:
        publisher.close()


async def main_async(args: argparse.Namespace) -> int:
    client_id = f"async-consumer-{uuid.uuid4().hex[:8]}"
    # The session and its subscription; request_timeout bounds the connect and every request too.
    async with AsyncDurableClient(client_id, args.host, args.port, request_timeout=args.timeout) as first:
        await first.subscribe(FILTER, qos=1)
    await asyncio.to_thread(publish, args, "queued", args.count)
    print(f"publisher: {args.count} orders while the consumer was away")
    processed = await asyncio.wait_for(consume(args, client_id), args.timeout)
    payloads = [event.payload.decode() for event in processed]
    expected = [f"order-{n}" for n in range(2 * args.count)]
    replayed = [event.replayed for event in processed]
    ok = payloads == expected and replayed == [True] * args.count + [False] * args.count
    print(f"processed {len(processed)}/{2 * args.count} orders exactly once, in order: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--count", type=int, default=20, help="queued orders, and as many live ones (default 20)")
    parser.add_argument("--timeout", type=float, default=30.0, help="bound of every wait, seconds (default 30)")
    args = parser.parse_args()
    if args.count < 4:
        parser.error("--count must be at least 4 (order 3 fails once on purpose)")
    try:
        return asyncio.run(main_async(args))
    except (OSError, TimeoutError, DurableClientError) as exc:
        print(f"error: {str(exc) or f'not done within --timeout {args.timeout:g} s'}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
