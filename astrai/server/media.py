"""Images fetched from the http(s) URLs of requests, from the hosts the operator allows only.

Fetching on a client's behalf lets the client reach whatever the server can (vLLM's
CVE-2026-24779 and its predecessor), so astrai fetches nothing unless `astrai serve
--allowed-media-domains` names hosts, and then: only from exactly those hosts, redirects
included; never from a private, loopback, link-local or otherwise non-global address, checked
on the address the host resolves to, which is the one connected to (resolved once, so a
second answer of the DNS cannot move the connection); at most the image byte limit; within a
time limit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import httpx

MAX_REDIRECTS = 3
DEFAULT_PORTS = {"http": 80, "https": 443}


class MediaFetchError(ValueError):
    """An image URL astrai will not or could not fetch; the message is for the client."""


async def public_address(host: str, port: int) -> str:
    """The address host resolves to, to connect to it; a MediaFetchError when it does not
    resolve or resolves to an address that is not public (private, loopback, link-local,
    multicast, reserved, unspecified)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaFetchError(f"the host {host!r} does not resolve") from None
    address = infos[0][4][0]
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        raise MediaFetchError(
            f"the host {host!r} resolves to {address}, which is not a public address; "
            "astrai fetches images from public addresses only"
        )
    return address


@dataclass(frozen=True)
class MediaFetcher:
    """Fetches images from the http(s) URLs of allowed_domains (host names, compared exactly
    and case-insensitively), of at most max_bytes, each within timeout seconds."""

    allowed_domains: frozenset[str]
    max_bytes: int
    timeout: float

    async def fetch(self, url: str) -> bytes:
        """The bytes at url, following at most MAX_REDIRECTS redirects, each to an allowed
        host; a MediaFetchError saying why not."""
        try:
            async with asyncio.timeout(self.timeout):
                async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
                    for _ in range(MAX_REDIRECTS + 1):
                        next_url, data = await self._get(client, url)
                        if data is not None:
                            return data
                        url = next_url
        except TimeoutError:
            raise MediaFetchError(
                f"the image at {url} did not arrive within {self.timeout:g} seconds"
            ) from None
        except httpx.HTTPError:
            raise MediaFetchError(f"the image at {url} could not be fetched") from None
        raise MediaFetchError(f"the image URL redirects more than {MAX_REDIRECTS} times")

    async def _get(self, client: httpx.AsyncClient, url: str) -> tuple[str, bytes | None]:
        """One request: (the URL it redirects to, None), or (url, the image's bytes)."""
        target = self._checked(url)
        host = target.host
        address = await public_address(host, target.port or DEFAULT_PORTS[target.scheme])
        headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*"}
        extensions = {"sni_hostname": host} if target.scheme == "https" else {}
        request = client.build_request(
            "GET", target.copy_with(host=address), headers=headers, extensions=extensions
        )
        response = await client.send(request, stream=True)
        try:
            if response.is_redirect:
                return str(target.join(response.headers["location"])), None
            if response.status_code != 200:
                raise MediaFetchError(f"the image URL {url} answered HTTP {response.status_code}")
            declared = int(response.headers.get("content-length", 0) or 0)
            if declared > self.max_bytes:
                raise self._too_large(url, declared)
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > self.max_bytes:
                    raise self._too_large(url, len(data))
            return url, bytes(data)
        finally:
            await response.aclose()

    def _checked(self, url: str) -> httpx.URL:
        """url parsed, if it is http(s) on an allowed host."""
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL:
            raise MediaFetchError(f"the image URL {url!r} is not a valid URL") from None
        if target.scheme not in DEFAULT_PORTS:
            raise MediaFetchError(
                f"the image URL {url!r} is not http(s); astrai fetches http and https URLs only"
            )
        if target.host.lower() not in self.allowed_domains:
            raise MediaFetchError(
                f"the image URL's host {target.host!r} is not one astrai may fetch from "
                f"(the operator allows {', '.join(sorted(self.allowed_domains))} with "
                "--allowed-media-domains); send the image inline, base64-encoded"
            )
        return target

    def _too_large(self, url: str, size: int) -> MediaFetchError:
        return MediaFetchError(
            f"the image at {url} is over the limit of {self.max_bytes} bytes per image "
            f"({size} bytes or more)"
        )
