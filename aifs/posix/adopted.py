"""Creates, opens, flushes and releases answered before the core heard of them.

The kernel binding's C loop (``aifs/fuse/kernel/_native.c``) answers the
create of a new file in a directory handed over to it, the read-only open
of a closed file handed over to it, and the flush and release of the
handles those opened. It appends each to a journal file
(``native-journal`` in the cache directory) before it answers, so a close
the program saw return is on disk as the metadata would be. The binding
applies the records to the core before it answers any other request
(:meth:`Adopted.apply`): what create, flush and release do, with the inode
number, handle, time and local copy the loop chose. At mount, what a killed
daemon left is applied before recovery (:meth:`Adopted.replay`), so a file
closed before the kill is kept like any closed file, and one still open is
a crashed writer's (``docs/SEMANTICS.md``).

Records, little endian, each padded to 8 bytes (``_native.c`` writes them):

- CREATE: u32 length, u32 kind (1), u64 parent, ino, fh, time_ns, u32 mode,
  uid, gid, pid, flags, name length, i32 backing id, local copy's fd; the name
- FLUSH (2) and RELEASE (3): u32 length, u32 kind, u64 ino, fh, u32 pid, flags
- OPEN (4), for reading: as FLUSH, then i32 backing id, u32 padding (nothing to
  replay: a read-only open leaves nothing on disk)
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from aifs.checkpoint import Checkpoints
from aifs.errors import FsError
from aifs.flush.promoter import Promoter
from aifs.meta.store import Inode
from aifs.posix.files import Files
from aifs.posix.inodes import Inodes
from aifs.posix.namespace import Namespace

log = logging.getLogger(__name__)

JOURNAL = "native-journal"
HEAD = struct.Struct("<II")
CREATE = struct.Struct("<IIQQQQIIIIIIii")
HANDLE = struct.Struct("<IIQQII")
OPEN = struct.Struct("<IIQQIIiI")
CREATED, FLUSHED, RELEASED, OPENED = 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class Created:
    parent: int
    ino: int
    fh: int
    time_ns: int
    mode: int
    uid: int
    gid: int
    pid: int
    backing: int
    fd: int
    name: bytes


@dataclass(frozen=True, slots=True)
class Handled:
    kind: int  # FLUSHED, RELEASED or OPENED
    ino: int
    fh: int
    pid: int
    backing: int = 0  # (OPENED: the backing id its reads go to)


Record = Created | Handled


def records(data: bytes | memoryview) -> tuple[list[Record], int]:
    """The whole records at the start of ``data``, and the bytes they take (a
    record cut short by a crash, the last, is left out)."""
    out: list[Record] = []
    at = 0
    while at + HEAD.size <= len(data):
        length, kind = HEAD.unpack_from(data, at)
        if length < HEAD.size or length % 8 or at + length > len(data):
            break
        if kind == CREATED and length >= CREATE.size:
            (_, _, parent, ino, fh, time_ns, mode, uid, gid, pid, _flags, namelen, backing,
             fd) = CREATE.unpack_from(data, at)
            name = bytes(data[at + CREATE.size:at + CREATE.size + namelen])
            out.append(Created(parent, ino, fh, time_ns, mode, uid, gid, pid, backing, fd, name))
        elif kind == OPENED and length >= OPEN.size:
            _, _, ino, fh, pid, _flags, backing, _ = OPEN.unpack_from(data, at)
            out.append(Handled(kind, ino, fh, pid, backing))
        elif kind in (FLUSHED, RELEASED) and length >= HANDLE.size:
            _, _, ino, fh, pid, _flags = HANDLE.unpack_from(data, at)
            out.append(Handled(kind, ino, fh, pid))
        else:
            log.error("journal: a record of kind %d and %d bytes, skipped", kind, length)
        at += length
    return out, at


class Adopted:
    def __init__(self, inodes: Inodes, namespace: Namespace, files: Files,
                 checkpoints: Checkpoints, promoter: Promoter) -> None:
        self.inodes = inodes
        self.namespace = namespace
        self.files = files
        self.checkpoints = checkpoints
        self.promoter = promoter
        self.meta = inodes.meta

    def reserve(self, inos: int, handles: int) -> tuple[list[int], int]:
        """Inode numbers and the first of ``handles`` handle numbers that only
        creates made outside the core take."""
        return self.meta.reserve_inos(inos), self.inodes.reserve_handles(handles)

    def create(self, record: Created) -> None:
        """A create the loop answered, its handle open (the loop made it direct:
        the binding registers its backing id and calls ``went_direct``)."""
        self.namespace.adopt_create(record.parent, record.name, record.mode, record.uid,
                                    record.gid, record.ino, record.time_ns, record.fh,
                                    record.fd)

    def create_closed(self, record: Created) -> Inode:
        """A create whose flush and release the loop answered too before any of
        them was applied: the file as its close leaves it (size and mtime from
        its copy), in one metadata transaction, without the handle that is gone;
        what a close does then (a checkpoint marker seen closed, promotion
        scheduled) as :meth:`aifs.posix.files.Files.release` does it."""
        st = os.fstat(record.fd)
        inode = self.namespace.adopt_create(record.parent, record.name, record.mode,
                                            record.uid, record.gid, record.ino, record.time_ns,
                                            fd=record.fd, closed=(st.st_size, st.st_mtime_ns))
        checkpoints = self.checkpoints
        checkpoints.closed(inode.ino, inode)
        counters = self.inodes.counters
        counters.direct_opens += 1
        counters.write_bytes += st.st_size  # (what its writes would have been counted)
        urgent = checkpoints.is_unfinished_marker(inode)
        self.promoter.schedule(inode.ino, 0.0 if urgent else None,
                               sooner=checkpoints.is_marker(inode))
        return inode

    def open(self, record: Handled) -> None:
        """A read-only open the loop answered (passthrough to the local copy:
        the binding registers its backing id and calls ``went_direct``)."""
        self.files.adopt_open(record.ino, record.fh)

    def open_closed(self, record: Handled) -> bool:
        """An open whose release the loop answered too before either was
        applied: what the two leave (the kernel's pages are of this version,
        one more direct open). False where the release has more to do (the
        file was unlinked, or its copy is stale): the two are applied whole."""
        inodes = self.inodes
        inode = self.meta.get(record.ino)
        if inode is None or inode.orphan or record.ino in inodes.stale_local:
            return False
        inodes.kernel_etag[record.ino] = inode.etag
        inodes.counters.direct_opens += 1
        return True

    def replay(self, path: Path) -> int:
        """At mount, before recovery: apply what the journal at ``path`` holds
        (records the last daemon applied already are skipped), then empty it.
        A create's file closed before the daemon ended gets its size from the
        local copy, as a close stores it; one never closed stays unclosed."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        applied = 0
        for record in records(data)[0]:
            try:
                if isinstance(record, Created):
                    if self.meta.get(record.ino) is None:
                        self.namespace.adopt_create(record.parent, record.name, record.mode,
                                                    record.uid, record.gid, record.ino,
                                                    record.time_ns)
                        applied += 1
                elif record.kind == FLUSHED:
                    self._closed(record.ino)
            except (FsError, OSError) as exc:  # (its directory gone: nothing to keep)
                log.warning("journal: %s of inode %d not applied: %s",
                            type(record).__name__.lower(), record.ino, exc)
        os.truncate(path, 0)
        if applied:
            log.info("journal: %d files created before the last daemon ended applied", applied)
        return applied

    def _closed(self, ino: int) -> None:
        inode = self.meta.get(ino)
        if inode is None or inode.orphan:
            return
        try:
            st = os.stat(self.inodes.local.path(ino))
        except FileNotFoundError:
            raise FsError(errno.ENOENT) from None
        inodes = self.inodes
        inodes.written[ino] = (st.st_size, st.st_mtime_ns)
        inodes.unsaved.add(ino)
        inodes.unclosed.add(ino)
        inodes.save_written(ino, closing=True)
        inodes.forget_written(ino)
