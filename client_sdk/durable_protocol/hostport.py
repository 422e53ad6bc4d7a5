"""``host:port`` as the broker's replication settings, its tools and the Spark source's
``failover`` option write it: one parser, so they accept and refuse the same addresses, and
one writer, so they show them alike."""

from __future__ import annotations

USAGE = "expected host:port (an IPv6 address in brackets: [::1]:7883)"


def split_host_port(text: str) -> tuple[str, int]:
    """(host, port) of ``host:port``, the port from 1 to 65535; a ValueError saying what is wrong
    (without ``text``: the caller names it). An IPv6 host is written in brackets, as in a URL
    (``[::1]:7883``), which are taken off; one without them is refused (``::1:7883`` could be the
    host ``::1`` or ``::1:7883`` without a port, and ``::1`` alone would be read as the host ``:``
    and the port 1). A NUL in the host is refused (the resolver would fail it later)."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "[" in host or "]" in host:
        raise ValueError(USAGE)
    if ":" in host and not bracketed:
        raise ValueError("an IPv6 address must be written in brackets, e.g. [::1]:7883 or [2001:db8::10]:7883")
    if "\0" in host:
        raise ValueError("a NUL character in the host")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as split_host_port reads it back: an IPv6 host in brackets (``[::1]:7883``),
    so the port is told from the address where one is shown."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["USAGE", "join_host_port", "split_host_port"]
