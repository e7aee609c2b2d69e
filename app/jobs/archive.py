"""A directory as an uncompressed tar stream, written member by member: a PAX header, the file's
bytes in chunks, zero padding to the next 512-byte block, and two zero blocks at the end. No file
is ever held in memory whole, and the archive's exact size is known before the first byte.

Only regular files inside the directory go in: symbolic links are neither followed nor archived,
and files are opened relative to their directory's descriptor (`os.fwalk`, `O_NOFOLLOW`), so a
link swapped in while the directory is read cannot lead outside it. Every file is opened before
the stream starts: a checkpoint deleted afterwards (pruning) still streams whole, since an open
file outlives its unlinking."""

from __future__ import annotations

import os
import stat
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

BLOCK = 512
CHUNK = 1024 * 1024
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)


class ArchiveError(Exception):
    """A file changed or vanished while it was streamed; the stream stops (a cut archive, never a wrong one)."""


@dataclass
class _Member:
    header: bytes
    size: int = 0
    fd: int | None = None  # an open regular file, or None for a directory or in-memory member
    data: bytes = b""

    @property
    def length(self) -> int:
        return len(self.header) + self.size + _padding(self.size)


def _padding(size: int) -> int:
    return -size % BLOCK


def _header(name: str, *, kind: bytes, size: int = 0, mode: int = 0o644, mtime: float | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, size, mode
    info.mtime = int(mtime if mtime is not None else time.time())
    return info.tobuf(tarfile.PAX_FORMAT)


@dataclass
class DirectoryArchive:
    """The open files of one directory, under `top/` in the archive, plus generated members.
    Iterate it once for the archive's bytes; `close()` releases the files (iteration does too)."""

    top: str
    members: list[_Member] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # paths relative to the directory, as archived

    @property
    def size(self) -> int:
        return sum(m.length for m in self.members) + len(END_OF_ARCHIVE)

    def add_bytes(self, name: str, data: bytes) -> None:
        """A generated file, e.g. a README, at `top/name`."""
        self.members.append(_Member(_header(f"{self.top}/{name}", kind=tarfile.REGTYPE, size=len(data)),
                                    size=len(data), data=data))
        self.names.append(name)

    def __iter__(self) -> Iterator[bytes]:
        try:
            for member in self.members:
                yield member.header
                if member.fd is not None:
                    yield from _read_exactly(member.fd, member.size)
                elif member.data:
                    yield member.data
                if pad := _padding(member.size):
                    yield b"\0" * pad
            yield END_OF_ARCHIVE
        finally:
            self.close()

    def close(self) -> None:
        for member in self.members:
            if member.fd is not None:
                os.close(member.fd)
                member.fd = None


def _read_exactly(fd: int, size: int) -> Iterator[bytes]:
    left = size
    while left:
        chunk = os.read(fd, min(CHUNK, left))
        if not chunk:
            raise ArchiveError(f"a file shrank while it was archived ({left} bytes missing)")
        left -= len(chunk)
        yield chunk


def open_directory(root: Path, *, top: str, skip: frozenset[str] = frozenset()) -> DirectoryArchive:
    """Open every regular file under `root` (sorted, relative names in `skip` left out) for an
    archive whose members sit under `top/`. Raises OSError (FileNotFoundError when `root` or a
    file vanished meanwhile); on error nothing stays open."""
    archive = DirectoryArchive(top)
    archive.members.append(_Member(_header(top, kind=tarfile.DIRTYPE, mode=0o755, mtime=root.stat().st_mtime)))
    try:
        for dirpath, dirnames, filenames, dirfd in os.fwalk(root, follow_symlinks=False, onerror=_raise):
            dirnames.sort()
            relative = PurePosixPath(Path(dirpath).relative_to(root).as_posix())
            for dirname in dirnames:
                st = os.stat(dirname, dir_fd=dirfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):  # fwalk lists links to directories too, without entering them
                    archive.members.append(_Member(_header(f"{top}/{relative / dirname}", kind=tarfile.DIRTYPE,
                                                           mode=0o755, mtime=st.st_mtime)))
            for filename in sorted(filenames):
                name = str(relative / filename)  # PurePosixPath(".") / "a" is "a"
                if name not in skip:
                    _add_file(archive, name, filename, dirfd)
    except BaseException:
        archive.close()
        raise
    return archive


def _raise(exc: OSError) -> None:
    raise exc  # a directory that cannot be read: no archive with a part silently missing


def _add_file(archive: DirectoryArchive, name: str, filename: str, dirfd: int) -> None:
    try:
        fd = os.open(filename, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:
        if stat.S_ISLNK(os.stat(filename, dir_fd=dirfd, follow_symlinks=False).st_mode):
            return  # a symbolic link (O_NOFOLLOW refused it): not archived, not followed
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a FIFO, socket or device: never read
        os.close(fd)
        return
    os.set_blocking(fd, True)
    archive.members.append(_Member(_header(f"{archive.top}/{name}", kind=tarfile.REGTYPE, size=st.st_size,
                                           mtime=st.st_mtime), size=st.st_size, fd=fd))
    archive.names.append(name)
