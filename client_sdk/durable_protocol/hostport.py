"""Hosts and ``host:port`` as the SDK, the broker's replication settings, its tools and the
Spark source take them: one parser, so they accept and refuse the same addresses, and one
writer, so they show them alike."""

from __future__ import annotations

import ipaddress

USAGE = "expected host:port (an IPv6 address in brackets: [::1]:7883)"


def parse_host(text: str) -> str:
    """A host given on its own (no port): a host name or an IP address, an IPv6 address bare or
    in brackets (``::1`` or ``[::1]``, returned without them). A ValueError saying what is wrong
    (without ``text``: the caller names it) for an empty host, a space or NUL in it, a port
    (``localhost:1883``), brackets around anything but an IPv6 address, or ``[``, ``]`` or ``/``
    elsewhere (a URL is not a host)."""
    if not text:
        raise ValueError("an empty host")
    if "\0" in text or any(ch.isspace() for ch in text):
        raise ValueError("a space or NUL in the host")
    bracketed = text.startswith("[") and text.endswith("]")
    bare = text[1:-1] if bracketed else text
    if bracketed or ":" in bare:
        if _is_ipv6(bare):
            return bare
        raise ValueError("a port in the host, or brackets around something other than an IPv6 address")
    if "[" in bare or "]" in bare or "/" in bare:
        raise ValueError("'[', ']' or '/' in the host (a host name or an IP address, not a URL)")
    return bare


def split_host_port(text: str) -> tuple[str, int]:
    """(host, port) of ``host:port``, the port from 1 to 65535 in ASCII digits; a ValueError saying what is wrong
    (without ``text``: the caller names it). An IPv6 host is written in brackets, as in a URL
    (``[::1]:7883``), which are taken off; a bracket that does not wrap the host (``[::1:7883``,
    ``::1]:7883``) is refused with USAGE; an IPv6 host without them is refused (``::1:7883`` could be the
    host ``::1`` or ``::1:7883`` without a port, and ``::1`` alone would be read as the host ``:``
    and the port 1). The host is then checked as parse_host checks one (brackets only around an
    IPv6 address, no space or NUL)."""
    host, sep, port = text.rpartition(":")
    # ASCII digits only: str.isdigit() takes other scripts' digits (U+0663, U+FF17, which int() reads
    # as 3 and 7) and superscripts (U+00B2, which int() cannot read)
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(USAGE)
    bracketed = host.startswith("[") and host.endswith("]")
    if not bracketed and ("[" in host or "]" in host):
        raise ValueError(USAGE)
    if ":" in host and not bracketed:
        raise ValueError("an IPv6 address must be written in brackets, e.g. [::1]:7883 or [2001:db8::10]:7883")
    try:
        return parse_host(host), int(port)
    except ValueError as exc:
        raise ValueError(f"{USAGE}: {exc}") from None


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as split_host_port reads it back: an IPv6 host in brackets (``[::1]:7883``),
    so the port is told from the address where one is shown."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


__all__ = ["USAGE", "join_host_port", "parse_host", "split_host_port"]
