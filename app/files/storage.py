"""Where uploaded bytes live. Local directory by default; an S3-compatible backend implements
the same four methods."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK = 1024 * 1024


class TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"upload exceeds {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class StoredBlob:
    key: str
    size: int
    sha256: str


class Storage(Protocol):
    def save(self, key: str, source: BinaryIO, *, max_bytes: int) -> StoredBlob:
        """Copy `source` in chunks; raise TooLarge (leaving nothing behind) past `max_bytes`."""

    @contextmanager
    def open(self, key: str) -> Iterator[BinaryIO]:
        """A binary reader over the stored object."""

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]: ...

    def delete(self, key: str) -> None: ...


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"storage key escapes the storage root: {key!r}")
        return path

    def save(self, key: str, source: BinaryIO, *, max_bytes: int) -> StoredBlob:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        # Write to a temporary file in the same directory and rename: readers never see a
        # half-written object, and a failed upload leaves nothing behind.
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(max_bytes)
                    digest.update(chunk)
                    out.write(chunk)
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return StoredBlob(key=key, size=size, sha256=digest.hexdigest())

    @contextmanager
    def open(self, key: str) -> Iterator[BinaryIO]:
        with self._path(key).open("rb") as fh:
            yield fh

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self.open(key) as fh:
            while chunk := fh.read(chunk_size):
                yield chunk

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
