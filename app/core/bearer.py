"""`Authorization: Bearer <token>` headers and secrets compared in constant time: the API keys,
the worker token, the `/metrics` token and lease ids are checked here."""

from __future__ import annotations

import hmac


def bearer_token(authorization: str | None) -> str | None:
    """The token of a `Bearer` authorization header (the scheme in any case), or None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def same_secret(given: str | None, expected: str) -> bool:
    """Whether `given` is `expected`, compared in constant time (a missing one never is)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
