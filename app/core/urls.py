"""Outbound calls to user-supplied URLs (tools, graders, webhooks) and the SSRF guard.

A URL may reach a loopback, private, link-local, multicast or otherwise reserved address only
when its host name or address is listed in AGENT_RFT_OUTBOUND_ALLOWLIST (names or CIDRs).
The check is made when the URL is accepted and again before every request.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx


class BlockedURL(ValueError):
    pass


def check_http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; put them in headers")
    return url


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def _allowed(host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address, allowlist: Iterable[str]) -> bool:
    for entry in allowlist:
        if "/" in entry:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        elif entry.lower() == host.lower():
            return True
        else:
            try:
                if ipaddress.ip_address(entry) == address:
                    return True
            except ValueError:
                pass
    return False


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def guard_url(url: str, allowlist: Iterable[str], *, strict_resolution: bool = True) -> None:
    """Raise BlockedURL unless every address `url` resolves to is public or allow-listed.

    With strict_resolution=False a host that does not resolve (yet) passes: used when a URL is
    first accepted, since the workers that call it may see a different DNS; the request-time
    check is always strict.
    """
    check_http_url(url)
    host = urlsplit(url).hostname or ""
    allowlist = list(allowlist)
    try:
        addresses = _resolve(host)
    except (socket.gaierror, UnicodeError) as exc:
        if strict_resolution:
            raise BlockedURL(f"host '{host}' does not resolve: {exc}") from exc
        return
    for address in addresses:
        if not _is_public(address) and not _allowed(host, address, allowlist):
            raise BlockedURL(
                f"'{host}' resolves to {address}, a non-public address; add it to "
                "AGENT_RFT_OUTBOUND_ALLOWLIST to allow it (local development only)"
            )


class GuardedTransport(httpx.AsyncHTTPTransport):
    """An httpx transport that applies the SSRF guard to every request it sends."""

    def __init__(self, allowlist: Iterable[str], **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.allowlist = list(allowlist)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        guard_url(str(request.url), self.allowlist)
        return await super().handle_async_request(request)


def guarded_client(allowlist: Iterable[str], **kwargs) -> httpx.AsyncClient:  # noqa: ANN003
    """The one way to build a client for user URLs: SSRF-guarded, redirects not followed."""
    return httpx.AsyncClient(transport=GuardedTransport(allowlist), follow_redirects=False, **kwargs)
