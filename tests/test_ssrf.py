"""The SSRF guard (agent_rft/urls.py): which addresses user URLs may reach, the check made when a
guarded client *connects* (so DNS rebinding cannot bypass it), redirects, and HTTPS."""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse

from agent_rft.urls import BlockedURL, check_http_url, guard_url, guarded_client
from tests.conftest import serve_app

# (URL host, an allow-list entry naming it by address, one naming it by CIDR)
NON_PUBLIC = [
    ("127.0.0.1", "127.0.0.1", "127.0.0.0/8"),
    ("10.1.2.3", "10.1.2.3", "10.0.0.0/8"),
    ("172.16.0.1", "172.16.0.1", "172.16.0.0/12"),
    ("192.168.1.10", "192.168.1.10", "192.168.0.0/16"),
    ("169.254.169.254", "169.254.169.254", "169.254.0.0/16"),  # cloud metadata (link-local)
    ("100.64.0.1", "100.64.0.1", "100.64.0.0/10"),  # carrier-grade NAT
    ("0.0.0.0", "0.0.0.0", "0.0.0.0/32"),  # reaches this host on Linux
    ("224.0.0.1", "224.0.0.1", "224.0.0.0/4"),  # multicast
    ("[::1]", "::1", "::1/128"),
    ("[::]", "::", "::/128"),
    ("[fe80::1]", "fe80::1", "fe80::/10"),
    ("[fc00::1]", "fc00::1", "fc00::/7"),
    ("[::ffff:127.0.0.1]", "127.0.0.1", "127.0.0.0/8"),  # IPv4-mapped IPv6: judged as its IPv4
    ("[::ffff:10.0.0.1]", "::ffff:10.0.0.1", "10.0.0.0/8"),
    ("[2002:7f00:1::]", "127.0.0.1", "2002::/16"),  # 6to4 wrapping of 127.0.0.1
    ("[64:ff9b::a00:1]", "10.0.0.1", "64:ff9b::/96"),  # NAT64 wrapping of 10.0.0.1
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "[2606:4700:4700::1111]", "[64:ff9b::808:808]"]


# --- real servers on 127.0.0.1 ----------------------------------------------------------------


serve = serve_app


def recording_app() -> tuple[FastAPI, list[str]]:
    """A server that records the path of every request; /redirect answers 302 to ?to=…."""
    seen: list[str] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def anything(path: str, request: Request) -> Any:
        seen.append("/" + path)
        if path == "redirect":
            return RedirectResponse(request.query_params["to"], status_code=302)
        return {"path": "/" + path}

    return app, seen


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, list[str]]]:
    app, seen = recording_app()
    with serve(app) as port:
        yield port, seen


@pytest.fixture
def local(server: tuple[int, list[str]]) -> tuple[int, list[str]]:
    port, seen = server
    seen.clear()
    return port, seen


def fixed_resolver(*answers: list[str]):  # noqa: ANN201
    """A resolver answering each lookup with the next list of addresses (the last one repeats);
    `calls` counts the lookups."""

    async def resolve(host: str, port: int) -> list[Any]:
        index = min(resolve.calls, len(answers) - 1)
        resolve.calls += 1
        return [ipaddress.ip_address(a) for a in answers[index]]

    resolve.calls = 0
    return resolve


class RecordingBackend(httpcore.AsyncNetworkBackend):
    """The real network backend, recording every address it is asked to connect to. When
    `offline`, every connection fails as an unreachable network would (these tests must not
    depend on reaching private or public hosts)."""

    def __init__(self, *, offline: bool = False) -> None:
        self.inner = httpcore.AnyIOBackend()
        self.connected: list[str] = []
        self.offline = offline

    async def connect_tcp(self, host: str, port: int, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        self.connected.append(host)
        if self.offline:
            raise httpcore.ConnectError(f"{host} is unreachable")
        return await self.inner.connect_tcp(host, port, **kwargs)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


async def get(url: str, allowlist: list[str], **client_options: Any) -> httpx.Response:
    async with guarded_client(allowlist, **client_options) as client:
        return await client.get(url)


# --- which addresses may be reached (checked when a URL is accepted) --------------------------


@pytest.mark.parametrize(("host", "by_address", "by_cidr"), NON_PUBLIC)
def test_non_public_addresses_are_refused_unless_allow_listed(host: str, by_address: str, by_cidr: str) -> None:
    url = f"http://{host}:8080/tools"
    with pytest.raises(BlockedURL, match="non-public address.*AGENT_RFT_OUTBOUND_ALLOWLIST"):
        guard_url(url, [])
    guard_url(url, [by_address])
    guard_url(url, [by_cidr])


@pytest.mark.parametrize("host", PUBLIC)
def test_public_addresses_pass(host: str) -> None:
    guard_url(f"https://{host}/tools", [])


def test_host_names_are_judged_by_their_addresses_and_may_be_allow_listed_by_name() -> None:
    with pytest.raises(BlockedURL, match="'localhost' resolves to"):
        guard_url("http://localhost:8080/", [])
    guard_url("http://localhost:8080/", ["localhost"])
    guard_url("http://LOCALHOST:8080/", ["localhost"])


def test_unresolvable_hosts_pass_only_without_strict_resolution() -> None:
    with pytest.raises(BlockedURL, match="does not resolve"):
        guard_url("http://no-such-host.invalid/", [])
    guard_url("http://no-such-host.invalid/", [], strict_resolution=False)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://example.com/", "/relative",
                                 "http://user:secret@example.com/", "http://:secret@example.com/"])
def test_only_plain_http_urls_are_accepted(url: str) -> None:
    with pytest.raises(ValueError):
        check_http_url(url)
    with pytest.raises(ValueError):
        guard_url(url, ["example.com"])


def test_a_bad_cidr_in_the_allowlist_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a valid CIDR"):
        guard_url("http://8.8.8.8/", ["10.0.0.0/33"])


# --- the check made when the client connects ---------------------------------------------------


@pytest.mark.parametrize(("host", "by_address", "by_cidr"), NON_PUBLIC)
def test_the_client_refuses_to_connect_to_non_public_addresses(host: str, by_address: str, by_cidr: str) -> None:
    backend = RecordingBackend(offline=True)
    url = f"http://{host}:9/"

    with pytest.raises(BlockedURL, match="non-public address"):
        asyncio.run(get(url, [], network_backend=backend))
    assert backend.connected == []  # refused before any connection was attempted

    for entry in (by_address, by_cidr):  # listed: the connection is attempted (and fails here)
        with pytest.raises(httpx.ConnectError):
            asyncio.run(get(url, [entry], network_backend=backend))
    assert backend.connected == [str(ipaddress.ip_address(host.strip("[]")))] * 2


def test_a_listed_local_server_is_reachable_by_address_cidr_and_name(local: tuple[int, list[str]]) -> None:
    port, seen = local
    with pytest.raises(BlockedURL):
        asyncio.run(get(f"http://127.0.0.1:{port}/a", []))
    assert seen == []

    assert asyncio.run(get(f"http://127.0.0.1:{port}/b", ["127.0.0.1"])).json() == {"path": "/b"}
    assert asyncio.run(get(f"http://127.0.0.1:{port}/c", ["127.0.0.0/8"])).json() == {"path": "/c"}
    assert asyncio.run(get(f"http://localhost:{port}/d", ["localhost"])).json() == {"path": "/d"}
    tools_host = fixed_resolver(["127.0.0.1"])
    assert asyncio.run(get(f"http://tools.internal:{port}/e", ["tools.internal"], resolver=tools_host)).status_code == 200
    assert seen == ["/b", "/c", "/d", "/e"]


def test_dns_rebinding_cannot_reach_a_private_address(local: tuple[int, list[str]]) -> None:
    """A rebinding DNS server answers a public address first and 127.0.0.1 afterwards. The client
    resolves once per connection and connects to exactly the address it checked."""
    port, seen = local
    rebinding = fixed_resolver(["93.184.216.34"], ["127.0.0.1"])
    backend = RecordingBackend(offline=True)

    async def two_requests() -> list[BaseException]:
        errors = []
        async with guarded_client([], resolver=rebinding, network_backend=backend) as client:
            for _ in range(2):
                try:
                    await client.get(f"http://rebind.example:{port}/secret")
                except (httpx.HTTPError, BlockedURL) as exc:
                    errors.append(exc)
        return errors

    first, second = asyncio.run(two_requests())
    assert isinstance(first, httpx.ConnectError)  # the checked public address was the one dialled
    assert isinstance(second, BlockedURL) and "127.0.0.1" in str(second)
    assert backend.connected == ["93.184.216.34"]  # never 127.0.0.1
    assert rebinding.calls == 2
    assert seen == []


def test_a_host_with_any_non_public_address_is_refused() -> None:
    backend = RecordingBackend()
    mixed = fixed_resolver(["8.8.8.8", "10.0.0.1"])
    with pytest.raises(BlockedURL, match="10.0.0.1"):
        asyncio.run(get("http://mixed.example/", [], resolver=mixed, network_backend=backend))
    assert backend.connected == []


def test_the_client_connects_to_the_checked_address_not_the_name(local: tuple[int, list[str]]) -> None:
    port, _ = local
    backend = RecordingBackend()
    resolver = fixed_resolver(["127.0.0.1"])
    response = asyncio.run(get(f"http://tools.internal:{port}/x", ["127.0.0.0/8"], resolver=resolver, network_backend=backend))
    assert response.status_code == 200
    assert backend.connected == ["127.0.0.1"]


def test_urls_with_credentials_or_other_schemes_are_refused_by_the_client(local: tuple[int, list[str]]) -> None:
    port, seen = local
    with pytest.raises(BlockedURL, match="credentials"):
        asyncio.run(get(f"http://user:pw@127.0.0.1:{port}/", ["127.0.0.1"]))
    assert seen == []


# --- redirects ----------------------------------------------------------------------------------


def test_redirects_are_not_followed(local: tuple[int, list[str]]) -> None:
    port, seen = local
    response = asyncio.run(get(f"http://127.0.0.1:{port}/redirect?to=/target", ["127.0.0.1"]))
    assert response.status_code == 302
    assert response.headers["location"] == "/target"
    assert seen == ["/redirect"]

    with pytest.raises(ValueError, match="redirects"):
        guarded_client([], follow_redirects=True)


def test_a_redirect_followed_on_request_is_still_checked_at_every_hop(local: tuple[int, list[str]]) -> None:
    port, seen = local

    async def follow() -> httpx.Response:
        async with guarded_client(["127.0.0.1"]) as client:
            target = f"http://[::1]:{port}/target"
            return await client.get(f"http://127.0.0.1:{port}/redirect?to={target}", follow_redirects=True)

    with pytest.raises(BlockedURL, match="::1"):
        asyncio.run(follow())
    assert seen == ["/redirect"]


@pytest.mark.parametrize("option", ["transport", "mounts", "proxy"])
def test_options_that_would_bypass_the_guard_are_refused(option: str) -> None:
    with pytest.raises(TypeError, match="bypass"):
        guarded_client([], **{option: None})


# --- HTTPS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for tools.example.test only (not for 127.0.0.1)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=tools.example.test",
         "-addext", "subjectAltName=DNS:tools.example.test"],
        check=True, capture_output=True,
    )
    return cert, key


def test_https_verifies_the_certificate_against_the_host_name(certificate: tuple[Path, Path]) -> None:
    """The client dials the checked address but TLS (SNI and verification) uses the URL's name:
    the certificate is valid for tools.example.test, not for 127.0.0.1."""
    cert, key = certificate
    app, seen = recording_app()
    trust = ssl.create_default_context(cafile=str(cert))
    with serve(app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as port:
        by_name = f"https://tools.example.test:{port}/secure"
        response = asyncio.run(get(by_name, ["tools.example.test"], resolver=fixed_resolver(["127.0.0.1"]), verify=trust))
        assert response.json() == {"path": "/secure"}

        with pytest.raises(httpx.ConnectError, match="certificate"):
            asyncio.run(get(f"https://127.0.0.1:{port}/by-address", ["127.0.0.1"], verify=trust))
    assert seen == ["/secure"]
