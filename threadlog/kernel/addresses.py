"""`host:port` addresses of workers, IPv6 literals included.

A worker announces where its query service listens (`<ns>.members`) and
clients connect there. An IPv6 literal holds colons of its own, so it travels
in brackets (`[::1]:7000`, as in URLs and Kafka's listeners): written by
`join`, read by `split`, the one place that knows.
"""

from __future__ import annotations

import ipaddress


def join(host: str, port: int) -> str:
    """`host:port`, the host bracketed when it is an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, int]:
    """(host, port) of a `join`ed address, brackets removed; the port is what
    follows the last colon, so an unbracketed IPv6 host (`::1:7000`, as workers
    before this module announced one) splits too. No colon: a port alone (host
    ""). ValueError unless the port is a number in 0..65535 (a connect to
    another raised OverflowError, no OSError)."""
    host, _, port = address.rpartition(":")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"{address!r}: the port must be a number in 0..65535")
    return bare(host), int(port)


def is_host(text: str) -> bool:
    """A host name or address a worker may announce: no port, no spaces or slashes;
    an IPv6 literal bare or in brackets."""
    if not text or any(c in text for c in " /"):
        return False
    if ":" not in text:
        return "[" not in text and "]" not in text
    try:
        ipaddress.IPv6Address(bare(text))
    except ValueError:
        return False
    return True


def bare(host: str) -> str:
    """The host without the brackets an IPv6 literal may have been given in."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
