"""Direct handles: reads and writes that go from the kernel straight to a
file's local copy, past the daemon (FUSE passthrough, kernel binding).

A handle may go direct only where the local copy is the whole file (written
on this node, fetched whole, or made from cached blocks after a reader the
daemon served closed: :mod:`aifs.posix.admissions` says which).
The kernel asks that every open of an
inode be direct while one is, so the binding says whether the inode is
direct already. A direct writer's bytes never pass through aifs: its local
copy is marked dirty and unclosed at open (as a first write would), and what
the kernel wrote is taken from the copy itself (:meth:`Direct.absorb`, at
getattr, flush, fsync and release): its size, and its mtime when it moved.
A file that streams to the lake as it is written (``flush/stream.py``) is
followed by its growth, looked at every :data:`FOLLOW_INTERVAL`; as that
cannot see a rewrite of bytes already sent, each part is checked against the
copy before the upload completes (else the file is uploaded whole). A writer
does not go direct where the cache disk is short of room (a full disk must
make it wait for promotion, not fail: ``posix.writes``) or where it must
clear set-user-ID.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import trio

from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.meta.store import Inode, MetaStore
from aifs.posix.admissions import Admissions
from aifs.posix.inodes import Inodes
from aifs.posix.reads import Reads
from aifs.posix.writes import Writes

log = logging.getLogger(__name__)

DIRECT_WRITE_ROOM = 1 << 30  # free bytes (disk and cache budget) a direct writer needs
FOLLOW_INTERVAL = 0.05  # seconds between looks at a direct writer's streamed file


@dataclass
class Writing:
    """An inode direct writers hold."""

    seen: tuple[int, int]  # (size, mtime_ns) of its copy when last absorbed
    handles: int = 0


class Direct:
    def __init__(self, inodes: Inodes, config: Config, meta: MetaStore, reads: Reads,
                 writes: Writes, checkpoints: Checkpoints) -> None:
        self.inodes = inodes
        self.checkpoints = checkpoints
        self.meta = meta
        self.reads = reads
        self.config = config
        self.writes = writes
        self.local = inodes.local
        self.writers: dict[int, Writing] = {}  # inodes that direct writers hold
        self.streams = writes.promoter.streams
        self.pacer = writes.promoter.pacer
        self._writing = trio.Event()  # set when a direct writer opens
        self.admissions = Admissions(inodes, config, meta, reads, writes, self.local.disk_free)

    async def backing(self, fh: int, inode_is_direct: bool, pid: int = 0) -> int | None:
        """The local copy's fd if handle ``fh`` may go direct, else None.
        ``inode_is_direct``: another handle of the inode is direct already;
        ``pid``: the opener, whose I/O promotion yields to (flush.pacing)."""
        inodes = self.inodes
        handle = inodes.files.get(fh)
        if handle is None:
            return None
        ino = handle.ino
        if ino in self.streams.spilled:
            return None  # its copy has holes (flush.stream): the daemon serves it
        if not self.local.has(ino):
            if not handle.writable:  # a cached file may get a copy as it closes
                handle.admit = self.admissions.opened(ino, handle.version)
            return None  # through the daemon
        if not inode_is_direct:
            # (Once direct, an inode's later opens share its copy even where a
            # newer version came from another node: the kernel knows one
            # backing file per inode. SEMANTICS.md, "Passthrough".)
            if ino in inodes.stale_local or inodes.opens.get(ino, 0) != 1:
                return None  # others hold it through the daemon: it stays so
            if handle.writable and not self._may_write_direct(handle.kill_setid):
                return None
        if handle.writable:
            await self.writes.make_local(ino)
        self._went_direct(fh, pid)
        return self.local.fd(ino)

    def _went_direct(self, fh: int, pid: int = 0) -> None:
        """Handle ``fh`` goes direct, as :meth:`backing` settled."""
        inodes = self.inodes
        handle = inodes.files[fh]
        ino = handle.ino
        if handle.writable:
            # Its copy changes past the daemon from now on, unseen until the
            # next absorb: a pack or upload that read it before must not take
            # what it read after this for the version it was handed.
            inodes.changed(ino)
            inodes.mark_unclosed(ino)
            self.streams.follow(ino, True)
            writing = self.writers.get(ino)
            if writing is None:
                writing = self.writers[ino] = Writing(self._stat(ino))
            writing.handles += 1
            self._writing.set()
        inodes.counters.direct_opens += 1
        if pid:
            self.pacer.io.watch(fh, pid)
        log.debug("handle %d of inode %d goes direct (%s)", fh, ino,
                  "writer" if handle.writable else "reader")

    def _may_write_direct(self, kill_setid: bool) -> bool:
        if kill_setid:
            return False
        budget = self.config.cache_size - self.writes.cache.used - self.local.used
        return min(budget, self.local.disk_free()) >= DIRECT_WRITE_ROOM

    def _stat(self, ino: int) -> tuple[int, int]:
        st = os.fstat(self.local.fd(ino))
        return st.st_size, st.st_mtime_ns

    def absorb(self, ino: int) -> None:
        """Take what direct writers wrote to ``ino``'s copy since last asked."""
        writing = self.writers.get(ino)
        if writing is None or not self.local.has(ino):
            return
        now, seen = self._stat(ino), writing.seen
        if now == seen:
            return
        writing.seen = now
        if now[0] > seen[0]:  # grown: what a front-to-back writer streams
            self.streams.wrote(ino, seen[0], now[0] - seen[0])
        elif now[0] < seen[0]:
            self.streams.cancel(ino, "shrank")
        log.debug("inode %d written directly: %d bytes", ino, now[0])
        inodes = self.inodes
        old = inodes.written.get(ino)
        size = now[0]
        mtime = now[1] if old is None or now[1] != seen[1] else old[1]
        inodes.written[ino] = (size, mtime)
        if ino not in inodes.marked_dirty:  # promoted since it was opened: dirty again
            self.writes.mark_dirty(ino)
        inodes.unsaved.add(ino)
        inodes.changed(ino)
        inodes.kernel_etag.pop(ino, None)  # the mount's own cached pages are stale
        self.local.resized(ino, size)
        if old is not None and size > old[0]:
            inodes.counters.write_bytes += size - old[0]

    def absorb_handle(self, fh: int) -> None:
        """:meth:`absorb` for the file of handle ``fh`` (flush, fsync)."""
        handle = self.inodes.files.get(fh)
        if handle is not None:
            self.absorb(handle.ino)

    def absorbed(self, inode: Inode) -> Inode:
        """``inode`` with what direct writers wrote (every reply that carries
        attributes must: the kernel takes the size of the last one)."""
        if inode.ino in self.writers:
            self.absorb(inode.ino)
            return self.inodes.with_written(inode)
        return inode

    def rebase(self, ino: int) -> None:
        """aifs itself changed the copy (truncate, times): not a direct write."""
        writing = self.writers.get(ino)
        if writing is not None and self.local.has(ino):
            writing.seen = self._stat(ino)

    def released(self, fh: int) -> None:
        """Before the core releases ``fh``: the last direct writer takes its
        writes along."""
        self.pacer.io.unwatch(fh)
        handle = self.inodes.files.get(fh)
        if handle is None or not handle.writable or handle.ino not in self.writers:
            return
        ino = handle.ino
        self.absorb(ino)
        writing = self.writers[ino]
        writing.handles -= 1
        if not writing.handles:
            del self.writers[ino]
            self.streams.follow(ino, False)

    async def follow_growth(self) -> None:
        """While direct writers write files that stream (or may), take their
        growth every :data:`FOLLOW_INTERVAL`, so parts go up as they are written."""
        while True:
            if not self.writers:
                self._writing = trio.Event()
                await self._writing.wait()
            for ino in [ino for ino in self.writers if self.streams.wants(ino)]:
                if ino in self.writers:
                    self.absorb(ino)
            await trio.sleep(FOLLOW_INTERVAL)
