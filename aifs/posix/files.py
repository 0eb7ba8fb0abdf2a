"""Open files: open, flush, fsync and release, and what each hands to promotion.

A file reaches the lake under its name when closed or fsynced (see
``docs/SEMANTICS.md``): release schedules its promotion, flush and fsync
store its size and clear the mark that keeps a crashed writer's bytes out of
the lake.
"""

from __future__ import annotations

import errno
import logging
import os

import trio

from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.errors import FsError
from aifs.flush.promoter import Promoter
from aifs.flush.stream import StreamTarget
from aifs.meta.objattrs import to_metadata as object_metadata
from aifs.meta.store import Inode, MetaStore
from aifs.policy import WEIGHTS
from aifs.posix.inodes import Inodes, OpenFile
from aifs.posix.listing import Changes
from aifs.posix.reads import Reads
from aifs.posix.recovery import Recovery
from aifs.posix.writes import Writes
from aifs.read.readahead import Readahead
from aifs.read.scan import DirectoryPrefetch

log = logging.getLogger(__name__)


class Files:
    def __init__(self, inodes: Inodes, config: Config, meta: MetaStore, reads: Reads,
                 writes: Writes, promoter: Promoter, checkpoints: Checkpoints,
                 dir_prefetch: DirectoryPrefetch, recovery: Recovery) -> None:
        self.inodes = inodes
        self.config = config
        self.meta = meta
        self.local = inodes.local
        self.reads = reads
        self.writes = writes
        self.promoter = promoter
        self.checkpoints = checkpoints
        self.dir_prefetch = dir_prefetch
        self.recovery = recovery
        self.on_changes: Changes | None = None  # tells the kernel (see Listings.on_changes)

    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[int, bool]:
        """Open a file; return the handle and whether the kernel may keep the
        pages it cached for this inode (only if the content did not change
        behind its back). O_TRUNC arrives here (atomic open-truncate)."""
        inode = self.inodes.get(ino)
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        if inode.orphan and (ino in self.inodes.withdrawn or not self.inodes.is_open(ino)):
            # Reached by a name the kernel has not yet been told is gone (a
            # file set aside, or changed in the lake: the notices go out after
            # the reply). Written, it would take bytes nobody can read again.
            # ESTALE makes Linux look the name up anew and open, or create,
            # what it names now (do_filp_open retries with LOOKUP_REVAL).
            raise FsError(errno.ESTALE)
        writable = bool(flags & (os.O_WRONLY | os.O_RDWR))
        kernel_etag = self.inodes.kernel_etag
        keep_cache = kernel_etag.get(ino) == inode.etag
        kernel_etag[ino] = inode.etag
        fh = self.open_handle(inode, writable)
        handle = self.inodes.files[fh]
        handle.kill_setid = writable and uid != 0
        if not writable and self.config.dir_prefetch:
            self.dir_prefetch.opened(inode, handle.version)
        if not writable and not flags & os.O_TRUNC:
            self.reads.fetch_small(handle)
        if flags & os.O_TRUNC:  # O_RDONLY|O_TRUNC truncates too, as Linux does
            try:
                await self.writes.truncate(inode, 0)
            except BaseException:
                self.release(fh)
                raise
            keep_cache = False
            if writable:
                self.maybe_stream(inode)
        return fh, keep_cache

    def writes_direct(self, flags: int) -> bool:
        """Whether a handle opened with ``flags`` has its writes passed to the
        daemon as they come, past the kernel's page cache (FOPEN_DIRECT_IO):
        write-only handles, which cannot be mapped or read. Through the page
        cache every written byte was copied once more and kept twice (the
        mount's pages and the local copy's), and a write of a file past a few
        GiB so cached ran at a third of the speed. Readers stay right because
        the kernel drops the pages a direct write covers (6.18 does; see
        SEMANTICS.md for older kernels)."""
        return self.config.direct_writes and flags & os.O_ACCMODE == os.O_WRONLY

    def maybe_stream(self, inode: Inode) -> None:
        """A file opened empty for writing may be uploaded as it is written.
        Whether it is, and how, is settled by :meth:`_stream_target` once it is
        large enough: most files never are, and a create stays cheap."""
        self.promoter.streams.candidate(inode.ino, self._stream_target)

    def _stream_target(self, ino: int) -> StreamTarget | None:
        """Key, local copy and object metadata of a file that reached the
        streaming threshold, or None if its policy keeps it from streaming
        (see ``Checkpoints.streams``)."""
        inode = self.meta.get(ino)
        if inode is None or inode.orphan or not self.checkpoints.streams(inode):
            return None
        metadata = object_metadata(inode, self.inodes.uid, self.inodes.gid)
        metadata.pop("mtime", None)  # fixed at upload creation: the lake's time serves
        return inode.key, str(self.local.path(ino)), metadata

    def open_handle(self, inode: Inode, writable: bool) -> int:
        """A new handle of ``inode``."""
        inodes = self.inodes
        fh = next(inodes.handles)
        ino = inode.ino
        inodes.opens[ino] = inodes.opens.get(ino, 0) + 1
        if writable:
            inodes.writers[ino] = inodes.writers.get(ino, 0) + 1
        version = self.reads.version(inode)
        # Weights are read front to back, whole: start at the widest window.
        first = (self.config.readahead_max if version.policy == WEIGHTS
                 else self.config.block_size)
        inodes.files[fh] = OpenFile(ino, version, Readahead(first, self.config.readahead_max),
                                    writable)
        return fh

    def _file(self, fh: int) -> OpenFile:
        handle = self.inodes.files.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        return handle

    async def flush(self, fh: int) -> None:
        handle = self._file(fh)
        ino = handle.ino
        lost = self.promoter.streams.state(ino) == "lost"
        if lost:
            self.inodes.write_failed.setdefault(ino, self.promoter.streams.lost[ino])
        if handle.writable and ino in self.inodes.write_failed \
                and self.inodes.writers.get(ino) == 1:
            # The last writer's close (flush, not release, which the kernel
            # sends after close() returned): the file is set aside before the
            # application goes on. (A dup of this descriptor that writes on
            # after this close writes to the lake's version.)
            self.set_aside(ino, self.inodes.write_failed.pop(ino))
            handle.set_aside = True
            if lost:
                raise FsError(errno.EIO)  # close() says the file did not make it
        elif handle.writable:
            stored = self.inodes.save_written(handle.ino, closing=True)
            # before close() returns: a crash keeps it
            self.checkpoints.closed(handle.ino, stored)

    async def fsync(self, fh: int, datasync: bool) -> None:
        inodes = self.inodes
        ino = self._file(fh).ino
        inodes.save_written(ino)
        await trio.to_thread.run_sync(self.local.sync, ino, limiter=inodes.disk)
        inodes.write_failed.pop(ino, None)  # what it holds now is what the writer wants
        inodes.clear_unclosed(ino)
        await trio.to_thread.run_sync(self.meta.sync, limiter=inodes.disk)
        if self.config.fsync == "lake":
            await self.promoter.sync(lambda inode: inode.ino == ino, None)

    def release(self, fh: int) -> None:
        inodes = self.inodes
        handle = inodes.files.pop(fh, None)
        if handle is None:
            return
        ino = handle.ino
        if handle.writable:
            left = inodes.writers.get(ino, 0) - 1
            if left > 0:
                inodes.writers[ino] = left
            else:
                self._last_writer_closed(ino)
        left = inodes.opens.get(ino, 0) - 1
        if left > 0:
            inodes.opens[ino] = left
            return
        inodes.opens.pop(ino, None)
        if ino in inodes.stale_local:
            inodes.stale_local.discard(ino)
            self.local.remove(ino)
        inode = self.meta.get(ino)
        inodes.free_if_unused(ino)
        if inode is not None and inode.orphan:
            self.promoter.tombstones_changed()  # its delete waited for the last close

    def _last_writer_closed(self, ino: int) -> None:
        inodes = self.inodes
        inodes.writers.pop(ino, None)
        if ino in inodes.write_failed:
            self.set_aside(ino, inodes.write_failed.pop(ino))
            return
        inodes.save_written(ino, closing=True)
        if ino in inodes.written:
            self.promoter.streams.closed(ino, inodes.written[ino][0],
                                         inodes.changes.get(ino, 0))
        inodes.forget_written(ino)
        inode = self.meta.get(ino)
        if inode is not None and inode.pending and not inode.orphan:
            # A streamed file is in parts already, an unfinished marker
            # guards what follows: no delay. A commit marker waits for
            # its checkpoint anyway: a rewrite does not push it back.
            urgent = (self.checkpoints.is_unfinished_marker(inode)
                      or self.promoter.streams.active(ino))
            self.promoter.schedule(ino, 0.0 if urgent else None,
                                   sooner=self.checkpoints.is_marker(inode))

    def set_aside(self, ino: int, why: str) -> None:
        """The last writer closed a file after a write of it failed (and no
        fsync or rewrite from size 0 since): the application saw the error,
        so what the file holds is not published. Its bytes leave the cache
        for the recovery directory now, not at the next mount (a file larger
        than the disk must not keep the disk full), and the file takes the
        lake's last version again, or goes if the lake has none."""
        inodes = self.inodes
        inodes.withdrawn.add(ino)  # (until freed: see open)
        inodes.forget_written(ino)
        inodes.unclosed.discard(ino)
        inodes.stale_local.discard(ino)
        inodes.changed(ino)
        inodes.kernel_etag.pop(ino, None)
        spilled = ino in self.promoter.streams.spilled  # (cancel below forgets it)
        self.promoter.streams.cancel(ino, "a write failed")
        inode = self.meta.get(ino)
        if inode is None or inode.orphan:  # deleted while open: nothing to keep
            self.local.remove(ino)
            self.meta.clear_unclosed(ino)
            return
        if spilled:  # (holes where its first bytes were: nothing worth keeping)
            log.error("%s is not published (%s); its first bytes had left the cache "
                      "disk for the lake: nothing of it is kept", inode.key, why)
            self.local.remove(ino)
        elif self.local.has(ino):
            self.recovery.set_aside(ino, inode.key, f"a write failed: {why}")
        self.meta.unpublish(ino, mounted=True)
        self.promoter.forget(ino)
        if self.on_changes is not None:  # its name, attributes and pages: asked anew
            self.on_changes(inode.parent, [inode.name], [ino])
