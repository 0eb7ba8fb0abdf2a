"""The facade the bindings call: POSIX operations over the lake.

:class:`Filesystem` builds the parts of :mod:`aifs.posix` (one responsibility each, see
that package) around the stores it is given and hands each operation to the part that
owns it; it holds no logic of its own. No pyfuse3 here: tests drive it without a mount.
Errors leave as :class:`~aifs.errors.FsError` or :class:`~aifs.errors.LakeError`.

Writes land in a whole local copy of the file and return at local-disk speed;
:class:`~aifs.flush.promoter.Promoter` takes them to the lake after close (the path of
each request through the modules: docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.figures import Figures
from aifs.flush.promoter import Promoter
from aifs.lake.base import ObjectStore
from aifs.lake.counting import CountingStore
from aifs.meta.store import Inode, MetaStore
from aifs.metrics import Metrics
from aifs.pack.compaction import Compactor
from aifs.posix.control import Control
from aifs.posix.direct import Direct
from aifs.posix.files import Files
from aifs.posix.hosting import Hosting
from aifs.posix.inodes import Attributes, Inodes
from aifs.posix.listing import READDIR_BATCH, Changes, Listings, PlainEntries
from aifs.posix.moves import Moves
from aifs.posix.namespace import Namespace
from aifs.posix.reads import Reads
from aifs.posix.recovery import Recovery
from aifs.posix.tally import Tally
from aifs.posix.writes import SetAttributes, Writes
from aifs.read.attrs import ObjectAttributes
from aifs.read.fetcher import BlockFetcher
from aifs.read.scan import DirectoryPrefetch

__all__ = ["Attributes", "Filesystem", "Inode", "PlainEntries", "SetAttributes"]

DIR_PREFETCH_BYTES = 256 << 20  # most bytes of a directory fetched ahead of its readers


class Filesystem:
    def __init__(self, config: Config, store: ObjectStore, meta: MetaStore,
                 cache: BlockCache, local: LocalFiles,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        # Every lake call is counted here, whoever built the store (metrics).
        self.store = store = store if isinstance(store, CountingStore) else CountingStore(store)
        self.meta = meta
        self.cache = cache
        self.local = local
        self.block_size = config.block_size
        self.fetcher = BlockFetcher(store, cache, config.block_size, config.memory_cache,
                                    max_prefetch=max(4, config.max_connections))
        self.inodes = inodes = Inodes(meta, local, clock)
        self.uid, self.gid = inodes.uid, inodes.gid
        self.lookups, self.files = inodes.lookups, inodes.files
        self.checkpoints = Checkpoints(config, meta, local,
                                       is_writing=lambda ino: bool(inodes.writers.get(ino)),
                                       hurry=lambda ino: self.promoter.promote_soon(ino),
                                       clock=clock)
        self.hosting = Hosting(inodes, meta, self.checkpoints)
        self.promoter = inodes.promoter = Promoter(self.hosting, store, meta, local, config,
                                                   inodes.uid, inodes.gid)
        self.packer = self.promoter.packer
        self.compactor = Compactor(self.packer, store, meta, config)
        self.reads = Reads(inodes, config, self.fetcher, self.promoter, self.checkpoints)
        self.hosting.attach(self.promoter, self.reads)
        self.object_attrs = ObjectAttributes(meta, store, config)
        self.dir_prefetch = DirectoryPrefetch(
            meta, self.fetcher, budget=min(config.cache_size // 8, DIR_PREFETCH_BYTES),
            at_once=max(4, config.max_connections), version_of=self.reads.version,
            is_local=local.has, clock=clock)
        self.listings = Listings(inodes, config, store, meta, self.packer, self.object_attrs)
        self.writes = Writes(inodes, config, meta, cache, self.fetcher, self.reads,
                             self.promoter)
        self.direct = Direct(inodes, config, meta, self.reads, self.writes,
                             self.checkpoints)
        self.recovery = Recovery(meta, local, config.recovered_max)
        self.open_files = Files(inodes, config, meta, self.reads, self.writes, self.promoter,
                                self.checkpoints, self.dir_prefetch, self.recovery)
        self.hosting.set_aside = self.open_files.set_aside
        moves = Moves(inodes, store, meta, self.packer, self.promoter, self.checkpoints,
                      self.writes)
        self.namespace = Namespace(inodes, self.listings, self.open_files, self.writes, moves,
                                   store, meta, self.packer, self.promoter, self.checkpoints)
        self.control = Control(inodes, config, meta, cache, self.fetcher, self.reads,
                               self.listings, self.hosting, self.promoter, self.compactor,
                               self.checkpoints, self.object_attrs, self.dir_prefetch,
                               lambda: self.metrics.snapshot())
        self.tally = Tally(config, store, cache, local, meta, inodes, self.fetcher, self.promoter,
                           self.checkpoints, self.recovery, self.dir_prefetch, self.object_attrs)
        local.in_use = inodes.is_open
        cache.others = lambda: local.used
        cache.disk_free = local.disk_free
        self.fetcher.make_room = self.writes.room_for_blocks
        self.metrics = Metrics(self.figures)

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.local.spares_while_running)
        self.fetcher.start(nursery)
        self.object_attrs.start(nursery)
        self.dir_prefetch.start(nursery)
        self.listings.start(nursery)
        nursery.start_soon(self.promoter.run)
        nursery.start_soon(self.direct.follow_growth)
        nursery.start_soon(self.direct.admissions.run)
        nursery.start_soon(self.compactor.run)
        nursery.start_soon(self.inodes.save_dir_times_now_and_then)
        nursery.start_soon(self.tally.run)  # samples for the throughput figures

    def recover(self) -> None:
        """At mount: reconcile local copies with metadata after any exit."""
        self.recovery.recover()

    # -- counters and state others read (metrics, status, tests) ---------------------
    def figures(self) -> Figures:
        """What the mount counts, one snapshot of values (posix.tally): all metrics sees."""
        return self.tally.figures()

    @property
    def clock(self) -> Callable[[], float]:
        return self.inodes.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:  # tests move time
        self.inodes.clock = clock

    @property
    def flush_on_unmount(self) -> bool:
        return self.hosting.flush_on_unmount

    def attributes(self, inode: Inode) -> Attributes:
        """With what direct writers wrote (every reply that carries attributes
        must: the kernel takes the size of the last one)."""
        return self.inodes.attributes(self.direct.absorbed(inode))

    def save_dir_times(self) -> None:
        self.inodes.save_dir_times()

    def stats(self) -> dict[str, int]:
        return self.control.stats()

    def statfs(self) -> dict[str, int]:
        return self.control.statfs()

    # -- lookups and directories (posix.listing) --------------------------------------
    def remember(self, *inos: int) -> None:  # the kernel got one more reference to each
        self.inodes.remember(*inos)

    def remember_range(self, first: int, count: int) -> None:  # (consecutive numbers)
        self.inodes.remember_range(first, count)

    def forget(self, items: list[tuple[int, int]]) -> None:
        self.inodes.forget(items)

    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        return await self.listings.lookup(parent, name)

    async def getattr(self, ino: int) -> Inode:
        return await self.listings.getattr(ino)

    async def opendir(self, ino: int) -> int:
        return await self.listings.opendir(ino)

    async def readdir(self, fh: int, after_cookie: int,
                      limit: int = READDIR_BATCH) -> list[tuple[int, bytes, Inode]]:
        return await self.listings.readdir(fh, after_cookie, limit)

    def plain_entries(self, fh: int, after_cookie: int) -> PlainEntries | None:
        return self.listings.plain_entries(fh, after_cookie)

    def releasedir(self, fh: int) -> None:
        self.listings.releasedir(fh)

    # -- the namespace (posix.namespace) ------------------------------------------------
    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Inode]:
        return await self.namespace.create(parent, name, mode, flags, uid, gid)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        return await self.namespace.mknod(parent, name, mode, rdev, uid, gid)

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return await self.namespace.mkdir(parent, name, mode, uid, gid)

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Inode:
        return await self.namespace.symlink(parent, name, target, uid, gid)

    async def readlink(self, ino: int) -> bytes:
        return await self.namespace.readlink(ino)

    async def unlink(self, parent: int, name: bytes) -> None:
        await self.namespace.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self.namespace.rmdir(parent, name)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        return await self.namespace.link(ino, new_parent, new_name)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int,
                     new_name: bytes, flags: int) -> None:
        await self.namespace.rename(old_parent, old_name, new_parent, new_name, flags)

    # -- files (posix.files, posix.reads, posix.writes) ---------------------------------
    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[int, bool]:
        return await self.open_files.open(ino, flags, uid)

    def writes_direct(self, flags: int) -> bool:
        return self.open_files.writes_direct(flags)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        return await self.reads.read(fh, offset, size)

    async def write(self, fh: int, offset: int, data: bytes | memoryview) -> int:
        return await self.writes.write(fh, offset, data)

    async def setattr(self, ino: int, changes: SetAttributes, fh: int | None = None) -> Inode:
        self.direct.absorb(ino)  # what direct writers wrote, before it changes
        inode = await self.writes.setattr(ino, changes)
        self.direct.rebase(ino)  # aifs's own change of the copy: not a direct write
        return inode

    def kill_setid(self, ino: int) -> None:
        self.writes.kill_setid(ino)

    async def flush(self, fh: int) -> None:
        self.direct.absorb_handle(fh)
        await self.open_files.flush(fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.direct.absorb_handle(fh)
        await self.open_files.fsync(fh, datasync)

    def release(self, fh: int, direct: bool | None = None) -> None:
        """``direct``: the handle was direct (passthrough: its writes are
        taken along), or served by the daemon where it could have been (its
        file may get a local copy, to go direct next time); None: no
        passthrough here."""
        try:
            if direct is not None:
                self.direct_released(fh, direct)
        finally:  # the handle goes, whatever its direct writes' bookkeeping met
            self.open_files.release(fh)

    # -- direct handles, past the daemon (posix.direct) --------------------------------
    async def direct_backing(self, fh: int, inode_is_direct: bool, pid: int = 0) -> int | None:
        return await self.direct.backing(fh, inode_is_direct, pid)

    def direct_released(self, fh: int, direct: bool = True) -> None:
        """Handle ``fh`` is no longer direct (its release, or a backing file
        the kernel refused), or was served by the daemon (a copy may follow)."""
        self.direct.released(fh) if direct else self.direct.admissions.closed(fh)

    def on_lake_changes(self, callback: Changes | None) -> None:  # see Listings.on_changes
        self.listings.on_changes = callback
        self.open_files.on_changes = callback  # (a file set aside: Files.set_aside)

    # -- promotion (posix.hosting; it yields to requests: flush.pacing) ------------------
    async def sync(self, ino: int) -> None:
        await self.hosting.sync(ino)

    def count_requests(self, served: Callable[[], int]) -> None:
        self.promoter.pacer.requests = served

    async def drain(self, timeout: float = 0.0,
                    progress: Callable[[dict[str, float]], None] | None = None) -> None:
        await self.hosting.drain(timeout, progress)

    # -- xattrs and commands (posix.control) ---------------------------------------------
    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.control.getxattr(ino, name)

    async def listxattr(self, ino: int) -> list[bytes]:
        return await self.control.listxattr(ino)

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.control.setxattr(ino, name, value)

    def removexattr(self, ino: int, name: bytes) -> None:
        self.control.removexattr(ino, name)

    async def warm(self, ino: int, files_at_once: int = 32) -> dict[str, int]:
        return await self.control.warm(ino, files_at_once)

    def pin(self, ino: int, on: bool) -> None:
        self.control.pin(ino, on)
