"""The state every POSIX part shares: inodes the kernel holds, handles, and
files being written.

Size and mtime of a file being written are kept in memory (``written``) and
stored at flush, fsync and release, so a write costs no metadata
transaction. Directory times are batched the same way (``dir_times``).
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import trio

from aifs.cache.blocks import ObjectVersion
from aifs.cache.files import LocalFiles
from aifs.errors import FsError
from aifs.meta.objattrs import st_mode
from aifs.meta.store import ROOT_INO, Inode, MetaStore
from aifs.posix.lookups import LookupCounts
from aifs.read.readahead import Readahead

if TYPE_CHECKING:
    from aifs.flush.promoter import Promoter


@dataclass
class OpenFile:
    ino: int
    version: ObjectVersion  # the lake version reads of a non-local file come from
    readahead: Readahead
    writable: bool
    advised: int = 0  # a local copy read sequentially: asked the kernel to read this far
    data: bytes | None = None  # a packed file's verified bytes, read once per handle
    #: opened for writing by a user without CAP_FSETID: the first write clears
    #: set-user-ID (and set-group-ID with group execute), as Linux does. The
    #: kernel does it itself except for direct-I/O handles.
    kill_setid: bool = False
    #: served by the daemon, its file may get a local copy to go direct as it
    #: closes (posix.admissions)
    admit: bool = False
    #: its file was set aside at this handle's close (a write failed): a dup
    #: of the descriptor that writes on gets EIO, not the lake's version
    set_aside: bool = False


class Attributes(NamedTuple):
    """What stat shows for an inode (a named tuple: made for every entry a
    listing hands the kernel, 0.4 us where a frozen dataclass took 2)."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    atime_ns: int
    rdev: int = 0


@dataclass
class Counters:
    """Request counters (``aifs status``, metrics)."""

    write_requests: int = 0
    write_bytes: int = 0
    read_requests: int = 0
    read_bytes: int = 0
    local_reads: int = 0  # reads answered from a whole local copy
    lookup_requests: int = 0
    disk_full: int = 0  # times the cache disk was found full
    direct_opens: int = 0  # handles whose reads and writes went past the daemon
    admitted: int = 0  # cached files given a local copy to go direct


def name_of(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


class Inodes:
    """Lookup counts, open handles, writers and what they wrote, per inode."""

    def __init__(self, meta: MetaStore, local: LocalFiles,
                 clock: Callable[[], float] = time.time) -> None:
        self.meta = meta
        self.local = local
        self.clock = clock
        self.promoter: Promoter | None = None  # set once built (it needs the host)
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.counters = Counters()
        self.lookups = LookupCounts()  # ino -> references the kernel holds
        self.files: dict[int, OpenFile] = {}  # fh -> open file
        self.dirs: dict[int, int] = {}  # fh -> directory ino
        self.handles = itertools.count(1)
        self.opens: dict[int, int] = {}
        self.writers: dict[int, int] = {}
        self.written: dict[int, tuple[int, int]] = {}  # ino -> (size, mtime_ns) of writers
        self.unsaved: set[int] = set()  # ... changed since last stored in LMDB
        self.marked_dirty: set[int] = set()  # ... whose DATA flag is set in LMDB
        self.unclosed: set[int] = set()  # written since their last close or fsync
        # A write of these failed (ENOSPC, EIO) since their last fsync: the
        # application saw the error, so, as after a crash, what they hold is
        # not published (see Hosting.held); ino -> why
        self.write_failed: dict[int, str] = {}
        self.withdrawn: set[int] = set()  # set aside while mounted: never opened again
        self.changes: dict[int, int] = {}
        self.kernel_etag: dict[int, str] = {}  # the version the kernel's pages are of
        self.dir_times: dict[int, tuple[int, float]] = {}  # ino -> (mtime_ns, ctime)
        self.subdir_counts: dict[int, int] = {}  # ino -> subdirectories (st_nlink - 2)
        self.stale_local: set[int] = set()  # dropped once no handle reads them
        self.disk = trio.CapacityLimiter(8)  # threads doing local disk I/O at once

    # -- attributes -----------------------------------------------------------
    def attributes(self, inode: Inode) -> Attributes:
        nlink = 2 + self.subdirs(inode.ino) if inode.is_dir else inode.nlink
        return Attributes(inode.ino, st_mode(inode), nlink,
                          self.uid if inode.uid < 0 else inode.uid,
                          self.gid if inode.gid < 0 else inode.gid,
                          inode.size, inode.mtime_ns,
                          int(inode.ctime * 1e9) or inode.mtime_ns,
                          inode.atime_ns or inode.mtime_ns, inode.rdev)

    def subdirs(self, ino: int) -> int:
        """How many subdirectories ``ino`` has (its st_nlink is 2 more, as on
        ext4 and tmpfs); counted once per change of the directory."""
        count = self.subdir_counts.get(ino)
        if count is None:
            count = self.subdir_counts[ino] = self.meta.subdir_count(ino)
            if len(self.subdir_counts) > 65536:
                self.subdir_counts.pop(next(iter(self.subdir_counts)))
        return count

    def get(self, ino: int) -> Inode:
        """The inode with what is not stored yet; ENOENT if there is none."""
        inode = self.meta.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return self.with_written(inode)

    def with_written(self, inode: Inode) -> Inode:
        """``inode`` with the size and mtime of writes (and directory times) not
        yet stored."""
        written = self.written.get(inode.ino)
        if written is not None:
            inode.size, inode.mtime_ns = written
        elif inode.is_dir and inode.ino in self.dir_times:
            inode.mtime_ns, inode.ctime = self.dir_times[inode.ino]
        return inode

    def directory(self, ino: int) -> Inode:
        directory = self.get(ino)
        if not directory.is_dir:
            raise FsError(errno.ENOTDIR)
        if directory.orphan:
            raise FsError(errno.ENOENT)
        return directory

    def is_under(self, inode: Inode, ancestor: int) -> bool:
        """Whether ``inode`` is ``ancestor`` or lies below it."""
        current: Inode | None = inode
        for _ in range(4096):
            if current is None:
                return False
            if current.ino == ancestor:
                return True
            if current.ino == ROOT_INO:
                return False
            current = self.meta.get(current.parent)
        return False

    # -- kernel references and handles ------------------------------------------
    def remember(self, *inos: int) -> None:
        """The kernel got one more reference to each of ``inos``."""
        for ino in inos:
            self.lookups.add(ino)

    def remember_range(self, first: int, count: int) -> None:
        """The kernel got one more reference to each of ``count`` numbers from ``first``."""
        self.lookups.add_range(first, count)

    def forget(self, items: list[tuple[int, int]]) -> None:
        for ino, count in items:
            if not self.lookups.drop(ino, count):
                self.free_if_unused(ino)

    def is_open(self, ino: int) -> bool:
        return self.opens.get(ino, 0) > 0

    def reads_lake(self, ino: int) -> bool:
        """Whether an open handle may still read ``ino``'s bytes from its lake
        object (so a deleted name's object stays until the last close): not
        once a local copy, which holds all of them, exists."""
        return self.is_open(ino) and not self.local.has(ino)

    def free_if_unused(self, ino: int) -> None:
        """Drop an orphan nobody refers to any more, with its local data."""
        if self.lookups.get(ino) or self.is_open(ino):
            return
        inode = self.meta.get(ino)
        if inode is None or not inode.orphan:
            return
        self.write_failed.pop(ino, None)  # gone: nothing of it to hold back
        self.withdrawn.discard(ino)
        self.clear_unclosed(ino)
        self.meta.delete_orphan(ino)
        self.local.remove(ino)
        self.forget_written(ino)
        self.changes.pop(ino, None)
        self.kernel_etag.pop(ino, None)

    def unlinked(self, ino: int) -> None:
        """``ino`` lost its last name. While a descriptor holds it, its data
        stays readable and writable (the size written so far included), as
        POSIX wants; it goes with the last close or forget."""
        if not self.is_open(ino):
            self.forget_written(ino)
        self.free_if_unused(ino)

    # -- changes not yet stored or promoted ---------------------------------------
    def changed(self, ino: int) -> None:
        self.changes[ino] = self.changes.get(ino, 0) + 1

    def forget_written(self, ino: int) -> None:
        self.written.pop(ino, None)
        self.unsaved.discard(ino)
        self.marked_dirty.discard(ino)

    def save_written(self, ino: int, closing: bool = False) -> Inode | None:
        """Store the in-memory size and mtime of a file being written; the
        inode as stored, if there was anything to store. ``closing``: its
        writer closed it, so its unclosed mark goes in the same transaction."""
        written = self.written.get(ino)
        if written is None or ino not in self.unsaved:
            if closing:
                self.clear_unclosed(ino)
            return None
        closed = closing and self._still_unclosed(ino)
        stored = self.meta.update(ino, closed=closed, size=written[0], mtime_ns=written[1],
                                  ctime=self.clock())
        # (only once stored: a transaction that failed, on a full disk, changed
        # nothing, and the next close tries again)
        self.unsaved.discard(ino)
        if closed:
            self.unclosed.discard(ino)
        return stored

    def schedule(self, ino: int, sooner: bool = False) -> None:
        """Promote ``ino`` after the delay, unless still open for writing
        (``sooner``: even if it was waiting longer, e.g. for a staging rename)."""
        if not self.writers.get(ino):
            assert self.promoter is not None
            self.promoter.schedule(ino, sooner=sooner)

    def mark_unclosed(self, ino: int) -> None:
        """Written since the last close or fsync: if the node crashes before
        either, recovery keeps these bytes out of the lake."""
        if ino not in self.unclosed:
            self.unclosed.add(ino)
            self.meta.mark_unclosed(ino)

    def clear_unclosed(self, ino: int) -> None:
        if self._still_unclosed(ino):
            self.unclosed.discard(ino)
            self.meta.clear_unclosed(ino)

    def _still_unclosed(self, ino: int) -> bool:
        """Whether a close clears the unclosed mark: one is set, and no write
        failed (a failed file keeps it, and stays unpublished)."""
        return ino in self.unclosed and ino not in self.write_failed

    # -- directory times ------------------------------------------------------------
    def touch_dir(self, ino: int, subdirs: bool = True) -> None:
        """A directory's entries changed: its mtime moves (kept locally only, and
        stored in batches: a create costs no extra metadata transaction).
        ``subdirs``: the change may have added or removed a subdirectory, so its
        count (st_nlink) is counted again; a file's create or unlink does not
        (that recount scans the whole directory: once per create it made
        creating n files in one directory cost n^2)."""
        self.dir_times[ino] = (time.time_ns(), self.clock())
        if subdirs:
            self.subdir_counts.pop(ino, None)

    def save_dir_times(self) -> None:
        """Store the directory times changed since the last call."""
        if self.dir_times:
            times, self.dir_times = self.dir_times, {}
            self.meta.set_times(times)

    async def save_dir_times_now_and_then(self) -> None:
        while True:
            await trio.sleep(1.0)
            self.save_dir_times()
