"""What promotion asks of the filesystem, and the waits on it: sync and the
drain at unmount.

The promoter (:mod:`aifs.flush.promoter`) takes inodes to the lake; before it
uploads one it asks here whether it may (a file open for writing waits for
its close; one whose write failed is held back), whether it goes into a pack,
and it reports here what reached the lake, so open handles read that version.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from aifs.checkpoint import Checkpoints
from aifs.errors import LakeError
from aifs.flush.promoter import Promoter
from aifs.meta.store import FILE, Inode, MetaStore
from aifs.posix.inodes import Inodes
from aifs.posix.reads import Reads

log = logging.getLogger(__name__)


class Hosting:
    """The promoter's host (see ``PromotionHost`` in :mod:`aifs.flush`)."""

    def __init__(self, inodes: Inodes, meta: MetaStore, checkpoints: Checkpoints) -> None:
        self.inodes = inodes
        self.meta = meta
        self.checkpoints = checkpoints
        # set by attach(): the promoter is built with its host, reads with its packer
        self.promoter: Promoter | None = None
        self.reads: Reads | None = None
        self.flush_on_unmount = True
        #: a file that cannot be published taken back (posix.files, set by the core)
        self.set_aside: Callable[[int, str], None] = lambda ino, why: None

    def attach(self, promoter: Promoter, reads: Reads) -> None:
        self.promoter = promoter
        self.reads = reads

    def _promoter(self) -> Promoter:
        assert self.promoter is not None, "attach() the promoter first"
        return self.promoter

    # -- asked by the promoter ------------------------------------------------------
    def promotable(self, ino: int, force: bool) -> Inode | None:
        """The inode as it should reach the lake now, or None if it must wait
        (open for writing: promoted after close, unless ``force``)."""
        if self.inodes.writers.get(ino) and not force:
            return None
        self.inodes.save_written(ino)
        inode = self.meta.get(ino)
        if inode is None or inode.orphan:
            return None
        return inode

    def held(self, ino: int) -> str | None:
        """Why ``ino`` must not reach the lake now, if it must not: a write of
        it failed since its last fsync (it goes to the recovery directory at
        the next mount unless fsynced or rewritten from size 0 first)."""
        why = self.inodes.write_failed.get(ino)
        return None if why is None else (
            f"not published: a write failed ({why}); fsync it or write it again")

    def lost(self, ino: int, why: str) -> None:
        """See ``PromotionHost.lost``: a writer still open learns it at its
        next write or close (``posix.writes``, ``posix.files``), which sets
        the file aside; a closed file is set aside now."""
        if self.inodes.writers.get(ino):
            self.inodes.write_failed[ino] = why
        else:
            self.set_aside(ino, why)

    def change_count(self, ino: int) -> int:
        return self.inodes.changes.get(ino, 0)

    def reads_lake(self, ino: int) -> bool:
        return self.inodes.reads_lake(ino)

    def packable(self, inode: Inode) -> bool:
        """Whether a file goes to the lake in a pack: small, by size and not by
        name (small ``*.bin``, ``*.pt`` or extension-less files pack too);
        checkpoint shards and their markers get objects of their own."""
        promoter = self._promoter()
        return (inode.kind == FILE and inode.size < promoter.packer.threshold
                and not inode.links and not promoter.streams.active(inode.ino)
                and not self.checkpoints.is_shard(inode)
                and not self.checkpoints.is_marker(inode))

    def wait_before_promoting(self, inode: Inode, force: bool) -> float:
        return self.checkpoints.wait_before_promoting(inode, force)

    def may_delete(self, key: str) -> bool:
        return self.checkpoints.may_delete(key)

    def older_marker_version(self, inode: Inode) -> tuple[int, bytes] | None:
        return self.checkpoints.older_version(inode)

    def marker_version_published(self, ino: int, seq: int) -> None:
        self.checkpoints.version_published(ino, seq)

    def promoted(self, ino: int, inode: Inode) -> None:
        """``inode`` reached the lake: what was cached is that version now."""
        self.checkpoints.promoted(inode)
        self.inodes.marked_dirty.discard(ino)  # the next write marks it dirty again
        if ino in self.inodes.kernel_etag:
            self.inodes.kernel_etag[ino] = inode.etag
        assert self.reads is not None, "attach() the reads first"
        version = self.reads.version(inode)
        for handle in self.inodes.files.values():
            if handle.ino == ino:
                handle.version = version

    # -- waits ------------------------------------------------------------------
    async def sync(self, ino: int) -> None:
        """Return once every change at or under ``ino`` is in the lake."""
        inodes = self.inodes
        inode = inodes.get(ino)
        for written in list(inodes.written):
            inodes.save_written(written)
        if inode.is_dir:
            await self._promoter().sync(lambda i: inodes.is_under(i, ino), inode.key)
        else:
            await self._promoter().sync(lambda i: i.ino == ino, None)

    async def drain(self, timeout: float = 0.0,
                    progress: Callable[[dict[str, float]], None] | None = None) -> None:
        """At unmount: promote everything (unless told not to), for at most
        ``timeout`` seconds (0: as long as it takes); ``progress`` is told
        what is left once a second."""
        promoter = self._promoter()
        summary = promoter.summary()
        if not (summary["files"] or summary["deletes"]):
            return
        if not self.flush_on_unmount:
            log.info("unmounting with %d files (%d bytes) not yet in the lake: the next "
                     "mount promotes them", summary["files"], summary["bytes"])
            return
        log.info("promoting %d files (%d bytes) and %d deletes before unmounting",
                 summary["files"], summary["bytes"], summary["deletes"])

        async def report() -> None:
            while progress is not None:
                progress(promoter.summary())
                await trio.sleep(1)

        async def promote_all() -> None:
            try:
                await promoter.sync(lambda i: True, "")
            except LakeError as exc:
                left = promoter.summary()
                log.error("unmounting with %d files not in the lake (%s): the next mount "
                          "with this cache directory promotes them", left["files"], exc)

        with trio.move_on_after(timeout or math.inf) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(report)
                await promote_all()
                nursery.cancel_scope.cancel()
        if deadline.cancelled_caught:
            left = promoter.summary()
            log.warning("unmount_timeout of %.0fs passed with %d files (%d bytes) and %d "
                        "deletes not yet in the lake: the next mount with this cache "
                        "directory promotes them", timeout, left["files"], left["bytes"],
                        left["deletes"])
