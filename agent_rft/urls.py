"""Outbound calls to user-supplied URLs (tools, graders, webhooks) and the SSRF guard.

A URL may reach a loopback, private, link-local, multicast or otherwise reserved address only
when its host name or address is listed in AGENT_RFT_OUTBOUND_ALLOWLIST (names, addresses or
CIDRs). `guard_url` checks a URL when it is accepted. The clients built by `guarded_client`
check again when they *connect*: their network backend resolves the host itself, checks every
address, and connects to the checked address, so a DNS server that answers differently the
second time (DNS rebinding) cannot slip a private address past the check.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]

# IPv6 prefixes that carry an IPv4 address in their low 32 bits and may be routed to it.
_NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")


class BlockedURL(ValueError):
    """A URL or connection refused by the SSRF guard; the message says why and how to allow it."""


def check_http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http:// or https:// URL")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; put them in headers")
    return url


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _is_public(address: IPAddress) -> bool:
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return _is_public(embedded)
    site_local = isinstance(address, ipaddress.IPv6Address) and address.is_site_local
    return address.is_global and not (address.is_multicast or address.is_reserved or site_local)


class Allowlist:
    """Host names, addresses and CIDRs that may be reached although they are not public."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = [entry.strip() for entry in entries if entry.strip()]
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in self.entries:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry:
                    raise ValueError(f"outbound allow-list entry {entry!r} is not a valid CIDR") from None
                self.names.add(entry.lower().rstrip("."))

    def allows(self, host: str, address: IPAddress) -> bool:
        if host.lower().rstrip(".") in self.names:
            return True
        candidates = [address, _embedded_ipv4(address)]
        return any(
            candidate is not None and candidate.version == network.version and candidate in network
            for candidate in candidates
            for network in self.networks
        )

    def check(self, host: str, addresses: Iterable[IPAddress]) -> None:
        """Raise BlockedURL if any address of `host` is neither public nor allow-listed."""
        for address in addresses:
            if not _is_public(address) and not self.allows(host, address):
                where = f"{address} is" if _ip_literal(host) == address else f"'{host}' resolves to {address},"
                raise BlockedURL(
                    f"{where} a non-public address; add it to AGENT_RFT_OUTBOUND_ALLOWLIST "
                    "to allow it (local development only)"
                )


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _address_of(sockaddr_host: str) -> IPAddress:
    return ipaddress.ip_address(sockaddr_host.split("%")[0])  # drop an IPv6 zone index


def _unique(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    return list(dict.fromkeys(addresses))


def _resolve(host: str) -> list[IPAddress]:
    literal = _ip_literal(host)
    if literal is not None:
        return [literal]
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return _unique(_address_of(info[4][0]) for info in infos)


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """The addresses of `host`, resolved without blocking the event loop (the default resolver)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return _unique(_address_of(info[4][0]) for info in infos)


def guard_url(url: str, allowlist: Iterable[str], *, strict_resolution: bool = True) -> None:
    """Raise BlockedURL unless every address `url` resolves to is public or allow-listed.

    With strict_resolution=False a host that does not resolve (yet) passes: used when a URL is
    first accepted, since the workers that call it may see a different DNS; the connect-time
    check of `guarded_client` is always strict.
    """
    check_http_url(url)
    host = urlsplit(url).hostname or ""
    rules = Allowlist(allowlist)
    try:
        addresses = _resolve(host)
    except (socket.gaierror, UnicodeError) as exc:
        if strict_resolution:
            raise BlockedURL(f"host '{host}' does not resolve: {exc}") from exc
        return
    rules.check(host, addresses)


class GuardedNetworkBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that connects only to addresses the SSRF guard accepts.

    It resolves the host once, checks every address, and hands the *checked address* to the
    inner backend, so no second DNS lookup happens between check and connect. TLS is layered
    on the returned stream by httpcore with `server_hostname` set to the URL's host name, so
    SNI and certificate verification still use the name, not the address.
    """

    def __init__(
        self,
        allowlist: Iterable[str],
        *,
        resolver: Resolver | None = None,
        backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.allowlist = Allowlist(allowlist)
        self._resolve = resolver or resolve_host
        self._backend = backend or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self._checked_addresses(host, port, timeout)
        failure: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return await self._backend.connect_tcp(
                    str(address), port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except httpcore.ConnectError as exc:  # refused or unreachable: try the next address
                failure = exc
        assert failure is not None
        raise failure

    async def _checked_addresses(self, host: str, port: int, timeout: float | None) -> list[IPAddress]:
        literal = _ip_literal(host)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                with anyio.fail_after(timeout):
                    addresses = _unique(await self._resolve(host, port))
            except TimeoutError as exc:
                raise httpcore.ConnectTimeout(f"resolving '{host}' timed out") from exc
            except (OSError, UnicodeError) as exc:
                raise httpcore.ConnectError(f"host '{host}' does not resolve: {exc}") from exc
            if not addresses:
                raise httpcore.ConnectError(f"host '{host}' has no addresses")
        self.allowlist.check(host, addresses)
        return addresses

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise BlockedURL("connections to Unix sockets are not allowed for user URLs")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """An httpx transport for user URLs: http(s) only, no credentials in the URL, and every
    connection checked by `GuardedNetworkBackend`. No proxy: a proxy would be the address
    checked, not the user's host. A refused request raises BlockedURL."""

    def __init__(
        self,
        allowlist: Iterable[str],
        *,
        resolver: Resolver | None = None,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
        verify: ssl.SSLContext | str | bool = True,
        cert: Any = None,
        trust_env: bool = True,
        http1: bool = True,
        http2: bool = False,
        limits: httpx.Limits | None = None,
        local_address: str | None = None,
        retries: int = 0,
        socket_options: Iterable[Any] | None = None,
    ) -> None:
        # The parent's __init__ only builds `self._pool`; build it here instead, with the guard
        # as its network backend (httpx's own options have no hook for one).
        self.allowlist = list(allowlist)
        self.network_backend = GuardedNetworkBackend(self.allowlist, resolver=resolver, backend=network_backend)
        limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, cert=cert, trust_env=trust_env),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=http1,
            http2=http2,
            local_address=local_address,
            retries=retries,
            network_backend=self.network_backend,
            socket_options=socket_options,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            check_http_url(str(request.url))
        except ValueError as exc:
            raise BlockedURL(f"refused a request to '{request.url.host}': the URL {exc}") from None
        return await super().handle_async_request(request)


_TRANSPORT_OPTIONS = ("resolver", "network_backend", "verify", "cert", "http1", "http2", "limits", "retries")


def guarded_client(allowlist: Iterable[str], **kwargs: Any) -> httpx.AsyncClient:
    """The one way to build a client for user URLs: SSRF-checked at connect time, redirects not
    followed. Transport options (limits, verify, cert, http2, retries, resolver) go to the
    transport; everything else to httpx.AsyncClient."""
    if kwargs.pop("follow_redirects", False):
        raise ValueError("clients for user URLs do not follow redirects")
    for option in ("transport", "mounts", "proxy"):
        if option in kwargs:
            raise TypeError(f"guarded_client does not accept {option!r}: it would bypass the SSRF guard")
    transport_options = {key: kwargs.pop(key) for key in _TRANSPORT_OPTIONS if key in kwargs}
    if "trust_env" in kwargs:
        transport_options["trust_env"] = kwargs["trust_env"]
    transport = GuardedTransport(allowlist, **transport_options)
    return httpx.AsyncClient(transport=transport, follow_redirects=False, **kwargs)
