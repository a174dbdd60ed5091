"""The Host check that keeps web pages from driving the server through DNS rebinding."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from astrai.server.errors import APIError
from astrai.server.middleware import Receive, RequestGate

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(header: str) -> str:
    """The name in a Host header, without its port, brackets or trailing dot, in lower case."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1:].partition("]")[0]
    name, colon, port = header.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        header = name
    return header.rstrip(".")


def _is_ip_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck(RequestGate):
    """ASGI middleware: a request's Host must be a loopback name, an IP address or allowed.

    A web page can point a name it controls at 127.0.0.1 and then call the server from the
    visitor's browser as same-origin; its requests carry that name as Host, so refusing unknown
    names stops it (Ollama shipped this hole). An IP address is never such a page's origin, so
    clients that reach the server by address are not refused.
    """

    def __init__(self, app, allowed_hosts: Iterable[str]) -> None:
        super().__init__(app)
        self.allowed = LOOPBACK_NAMES | {host_name(h) for h in allowed_hosts}

    async def admit(self, path: str, headers: dict[bytes, bytes], receive: Receive) -> Receive:
        header = headers.get(b"host")
        name = host_name(header.decode("latin-1")) if header is not None else None
        if name is not None and name not in self.allowed and not _is_ip_address(name):
            raise APIError(
                403,
                f"this server does not answer to the host name {name!r}; it accepts "
                f"{', '.join(sorted(self.allowed))} and IP addresses. Its operator can "
                "allow more names with --allowed-hosts",
            )
        return receive
