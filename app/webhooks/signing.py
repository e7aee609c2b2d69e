"""Standard Webhooks signatures (https://www.standardwebhooks.com), as the `openai` SDK's
`client.webhooks.unwrap` / `verify_signature` check them:

    webhook-id: <delivery id, the same on every attempt>
    webhook-timestamp: <Unix seconds of this attempt>
    webhook-signature: v1,<base64 HMAC-SHA256(secret, f"{id}.{timestamp}.{body}")> [v1,<…> …]

The secret is `whsec_` + base64 of 24 random bytes; the HMAC key is the decoded bytes. During a
rotation window the header carries one signature per live secret, newest first.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterable
from datetime import datetime, timezone

from standardwebhooks import Webhook

SECRET_PREFIX = "whsec_"
USER_AGENT = "agent-rft-webhooks/1"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_hint(secret: str) -> str:
    return f"{SECRET_PREFIX}****{secret[-4:]}"


def signed_headers(delivery_id: str, body: str, signing_secrets: Iterable[str], *,
                   now: datetime | None = None) -> dict[str, str]:
    """The headers of one attempt: the Standard Webhooks trio plus content type and user agent."""
    now = now or datetime.now(timezone.utc)
    signatures = " ".join(Webhook(secret).sign(delivery_id, now, body) for secret in signing_secrets)
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signatures,
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }
