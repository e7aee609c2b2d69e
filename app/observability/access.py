"""Who may scrape `/metrics`: with AGENT_RFT_METRICS_TOKEN, whoever sends it as a bearer token;
without it, loopback clients only, unless AGENT_RFT_METRICS_PUBLIC opens it to every client. The
API and the inference server both ask `metrics_refusal`."""

from __future__ import annotations

import ipaddress

from app.core.bearer import bearer_token, same_secret
from app.core.config import Settings
from app.core.errors import APIError


def is_loopback(host: str | None) -> bool:
    """Whether `host` (the peer address as the ASGI server saw it) is this machine."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def metrics_refusal(settings: Settings, *, authorization: str | None, client_host: str | None) -> APIError | None:
    """None when the scrape may go on; else the error to answer (401 or 403)."""
    expected = settings.metrics_token.get_secret_value() if settings.metrics_token else ""
    if expected:
        if not same_secret(bearer_token(authorization), expected):
            return APIError(401, "Send 'Authorization: Bearer <AGENT_RFT_METRICS_TOKEN>' to read /metrics.",
                            code="invalid_metrics_token", headers={"WWW-Authenticate": "Bearer"})
        return None
    if settings.metrics_public or is_loopback(client_host):
        return None
    return APIError(403, "/metrics answers loopback clients only: set AGENT_RFT_METRICS_TOKEN (or "
                         "AGENT_RFT_METRICS_PUBLIC=true) to scrape it from another machine.",
                    code="metrics_forbidden")
