"""Secrets at rest: what the control plane must keep and use again (the headers a job sends to
its tool servers and endpoint graders, the webhook signing secrets) is stored encrypted, so a
dump of the database does not reveal it.

Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`) under the keys of AGENT_RFT_SECRET_KEYS,
newest first: the newest encrypts, every one decrypts, so a key is rotated by putting a new one
first, running `agent-rft secrets reencrypt`, then dropping the old one. A stored value is
`fernet:<token>`; anything else is a value written before encryption (legacy plain text), read
as it is until the re-encryption seals it. The embedded SQLite default generates its key once,
into `<data_dir>/secret.key`; any other database refuses to start without the setting.
"""

from __future__ import annotations

import os
import uuid
from functools import lru_cache
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from app.core.config import Settings

SEALED_PREFIX = "fernet:"
KEY_FILE = "secret.key"


class SecretKeysMissing(RuntimeError):
    """No usable key: the server must not start (it could neither store nor use a secret)."""


class SecretUnreadable(RuntimeError):
    """A stored secret that none of the configured keys opens."""


def generate_key() -> str:
    return Fernet.generate_key().decode()


def is_sealed(stored: str) -> bool:
    return stored.startswith(SEALED_PREFIX)


class SecretBox:
    """Seals values under the newest key; opens values sealed under any of the keys."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        fernets = []
        for position, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key))
            except ValueError:  # never echo the key itself
                raise SecretKeysMissing(
                    f"AGENT_RFT_SECRET_KEYS: key {position} of {len(keys)} is not a Fernet key (32 url-safe "
                    "base64-encoded bytes, as `agent-rft secrets generate-key` prints).") from None
        self._newest, self._all = fernets[0], MultiFernet(fernets)

    def seal(self, plaintext: str) -> str:
        return SEALED_PREFIX + self._newest.encrypt(plaintext.encode()).decode()

    def open(self, stored: str) -> str:
        """The plaintext of a sealed value; a legacy plain value as it is."""
        if not is_sealed(stored):
            return stored
        try:
            return self._all.decrypt(stored[len(SEALED_PREFIX):].encode()).decode()
        except InvalidToken:
            raise SecretUnreadable(
                "A stored secret does not open with any key of AGENT_RFT_SECRET_KEYS: the key it was sealed "
                "under has been removed (or the value was altered). Put that key back (after the newest).") from None

    def reseal(self, stored: str) -> str | None:
        """`stored` sealed under the newest key, or None when it already is."""
        if is_sealed(stored):
            token = stored[len(SEALED_PREFIX):].encode()
            try:
                self._newest.decrypt(token)
                return None
            except InvalidToken:
                pass
        return self.seal(self.open(stored))


def secret_box(settings: Settings) -> SecretBox:
    """The box of these settings' keys; with the embedded SQLite default and no keys set, the
    key generated into the data directory. Raises SecretKeysMissing, with what to do."""
    keys = tuple(key.get_secret_value() for key in settings.secret_keys)
    if keys:
        return _box(keys)
    if not settings.resolved_database_url.startswith("sqlite"):
        raise SecretKeysMissing(
            "AGENT_RFT_SECRET_KEYS is not set. With a database other than the embedded SQLite default, the key "
            "that encrypts stored secrets (tool and grader headers, webhook signing secrets) must come from the settings: "
            "generate one with `agent-rft secrets generate-key` and set AGENT_RFT_SECRET_KEYS to it (keep it "
            "apart from the database's backups). docs/security.md#secrets-at-rest")
    return _box((embedded_key(settings.data_dir.resolve()),))


@lru_cache(maxsize=16)
def _box(keys: tuple[str, ...]) -> SecretBox:
    return SecretBox(keys)


@lru_cache(maxsize=16)
def embedded_key(data_dir: Path) -> str:
    """The embedded default's key, created on first use (readable by its owner only). Written to a
    temporary file and linked into place, so concurrent first starts agree on one key."""
    path = data_dir / KEY_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        temporary = data_dir / f".{KEY_FILE}.{uuid.uuid4().hex}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(generate_key() + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process was first: use its key
        finally:
            temporary.unlink()
    return path.read_text().strip()
