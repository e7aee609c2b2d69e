"""Public object ids in OpenAI's shapes: `file-…`, `ftjob-…`, `ftevent-…`, `ftckpt_…`."""

import secrets
import string

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length))
