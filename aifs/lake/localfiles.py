"""The files of a local lake (:mod:`aifs.lake.local`): how a key's path is
reached however long it is, and the pieces of a multipart upload."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from aifs.errors import InvalidKey, LakeError

ASSEMBLY = "object"  # in an upload's staging directory: parts sent with their offsets
#: the longest key: a local filesystem's paths have no limit below the
#: mount's PATH_MAX relative ones can go past; this bounds what a journal
#: record, an LMDB value and a multipart upload's key file carry
MAX_KEY = 65536
#: bytes of a path below one anchor directory (PATH_MAX is 4,096 with its
#: NUL; ``/proc/self/fd/N/`` comes in front)
PATH_ROOM = 4000


def write_all(fd: int, data: bytes | memoryview, at: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, at)
        view, at = view[done:], at + done


def piece(staging: str, places: dict[int, tuple[int, int]],
           number: int) -> tuple[str, int, int]:
    """Where part ``number`` is: ``(file, offset, length)`` in the staging directory."""
    if number in places:
        return ASSEMBLY, *places[number]
    name = f"part-{number:05d}"  # (one never sent: FileNotFoundError, ObjectNotFound)
    return name, 0, os.stat(os.path.join(staging, name)).st_size


def tiles(pieces: list[tuple[str, int, int]]) -> bool:
    """The parts, in order, are the assembly file from its start without a gap."""
    end = 0
    for name, offset, length in pieces:
        if name != ASSEMBLY or offset != end:
            return False
        end += length
    return bool(pieces)


def copy_pieces(fd: int, staging: str, pieces: list[tuple[str, int, int]]) -> None:
    at = 0
    for name, offset, length in pieces:
        src = os.open(os.path.join(staging, name), os.O_RDONLY)
        try:
            while length > 0:
                chunk = os.pread(src, min(length, 1 << 22), offset)
                if not chunk:
                    raise LakeError(f"{name} of an upload is shorter than recorded")
                write_all(fd, chunk, at)
                offset, length, at = offset + len(chunk), length - len(chunk), at + len(chunk)
        finally:
            os.close(src)




@contextlib.contextmanager
def reach(root: str, parts: list[str], make: bool = False) -> Iterator[str]:
    """The path of the file (or directory) named by ``parts`` below ``root``,
    good inside the block: where it would pass PATH_MAX, it goes through
    descriptors of directories on its way (``/proc/self/fd/N/...``), opened
    here and closed after, never kept (a directory removed and made again
    must not be written through an old descriptor). ``make``: those
    directories are made where missing."""
    fds: list[int] = []
    base, at = root, 0
    try:
        while sum(len(os.fsencode(p)) + 1 for p in parts[at:]) > PATH_ROOM:
            room, start = PATH_ROOM, at
            while at < len(parts) - 1 and len(os.fsencode(parts[at])) + 1 <= room:
                room -= len(os.fsencode(parts[at])) + 1
                at += 1
            if at == start:  # (a name has at most 255 bytes: never)
                raise InvalidKey(f"{'/'.join(parts)!r} cannot be stored in a local lake")
            step = os.path.join(base, *parts[start:at])
            if make:
                os.makedirs(step, exist_ok=True)
            fds.append(os.open(step, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            base = f"/proc/self/fd/{fds[-1]}"
        yield os.path.join(base, *parts[at:])
    finally:
        for fd in fds:
            os.close(fd)
