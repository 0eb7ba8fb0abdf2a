"""POSIX semantics over the lake: lookups, lookup counts, handles, reads and
writes, the namespace (create, mkdir, unlink, rename, symlink), xattrs.

No pyfuse3 here, so tests drive this class without a mount. Errors leave as
:class:`~aifs.errors.FsError` (an errno) or :class:`~aifs.errors.LakeError`;
``fuse_ops`` turns both into FUSE replies.

Writes land in a whole local copy of the file (:class:`~aifs.cache.files.LocalFiles`)
and return at local-disk speed; :class:`~aifs.flush.promoter.Promoter` takes
them to the lake after close. Size and mtime of a file being written are kept
in memory (``_written``) and stored at flush, fsync and release, so a write
costs no metadata transaction.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import functools
import itertools
import json
import logging
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from aifs import xattrs
from aifs.cache.blocks import BlockCache, ObjectVersion
from aifs.cache.files import EVICT_FIRST, LocalFiles
from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.errors import FsError, LakeError, ObjectNotFound
from aifs.flush.compaction import Compactor, Upkeep
from aifs.flush.packer import entry_fields
from aifs.flush.promoter import Promoter
from aifs.flush.stream import StreamTarget
from aifs.lake.base import ObjectStore
from aifs.lake.counting import CountingStore
from aifs.meta.objattrs import MAX_XATTR_BYTES, encode_xattrs, kind_of, st_mode
from aifs.meta.objattrs import to_metadata as object_metadata
from aifs.meta.packindex import deletion, is_packed_at, pack_key
from aifs.meta.store import (
    BLK,
    CHR,
    DATA,
    DIR,
    FILE,
    LINK,
    MAYBE_IN_LAKE,
    META,
    ROOT_INO,
    SPECIAL,
    Inode,
    Listed,
    MetaStore,
    valid_name,
)
from aifs.metrics import Metrics
from aifs.policy import DATASET, POLICIES, POLICY_XATTR, WEIGHTS
from aifs.read.attrs import ObjectAttributes
from aifs.read.fetcher import BlockFetcher, read_ahead, read_at, verify
from aifs.read.readahead import Readahead
from aifs.read.scan import DirectoryPrefetch

log = logging.getLogger(__name__)

RESERVED_PREFIX = ".aifs"
READDIR_BATCH = 1000
# control xattrs (the table and what each does: aifs/xattrs.py), as the kernel sends them
XATTR_PREFIX = xattrs.PREFIX.encode()
SYNC_XATTR = xattrs.SYNC.encode()
PENDING_XATTR = xattrs.PENDING.encode()
METRICS_XATTR = xattrs.METRICS.encode()
WARMUP_XATTR = xattrs.WARMUP.encode()
PACK_XATTR = xattrs.PACK.encode()
DISK_FULL_WAIT = 30.0  # seconds a write waits on a full cache disk for promotion
DISK_FULL_EVICT = 64 << 20  # bytes of clean data evicted at least when the disk is full
GC_XATTR = xattrs.GC.encode()
PACK_PROGRESS_XATTR = xattrs.PACK_PROGRESS.encode()
ACTION_RESULT_KEPT = 5.0  # seconds an action xattr's result waits for the second read
PINNED_XATTR = xattrs.PINNED.encode()
UNMOUNT_FLUSH_XATTR = xattrs.UNMOUNT_FLUSH.encode()
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
COPY_CONCURRENCY = 16
SCAN_OPENS = 3  # files of one pack opened within SCAN_WINDOW seconds: a scan
SCAN_WINDOW = 10.0
STALE_SERVED = 2  # known entries are answered up to this many TTLs, refreshed behind
DIR_PREFETCH_BYTES = 256 << 20  # most bytes of a directory fetched ahead of its readers


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


@dataclass(frozen=True)
class Attributes:
    """What stat shows for an inode."""

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


@dataclass(frozen=True)
class SetAttributes:
    """The changes a setattr asks for (None: unchanged)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    mtime_ns: int | None = None
    atime_ns: int | None = None


def _name(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


class Filesystem:
    def __init__(self, config: Config, store: ObjectStore, meta: MetaStore,
                 cache: BlockCache, local: LocalFiles,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        # Every lake call is counted here, whoever built the store (metrics).
        self.store = store if isinstance(store, CountingStore) else CountingStore(store)
        self.meta = meta
        self.cache = cache
        self.local = local
        self.clock = clock
        self.block_size = config.block_size
        self.fetcher = BlockFetcher(self.store, cache, config.block_size, config.memory_cache,
                                    max_prefetch=max(4, config.max_connections))
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.promoter = Promoter(self, self.store, meta, local, config, self.uid, self.gid)
        self.packer = self.promoter.packer
        self.packs = self.packer.index
        self.compactor = Compactor(self.packer, self.store, meta, config)
        self._pack_opens: dict[str, tuple[int, float]] = {}  # pack -> (opens, first)
        self._action_results: dict[tuple[int, bytes], tuple[float, bytes]] = {}
        self._dir_times: dict[int, tuple[int, float]] = {}  # ino -> (mtime_ns, ctime)
        self._subdir_counts: dict[int, int] = {}  # ino -> subdirectories (st_nlink - 2)
        self.checkpoints = Checkpoints(config, meta, local,
                                       is_writing=lambda ino: bool(self._writers.get(ino)),
                                       hurry=lambda ino: self.promoter.promote_soon(ino),
                                       clock=clock)
        self.lookups: dict[int, int] = {}
        self.object_attrs = ObjectAttributes(meta, self.store, config)
        self.dir_prefetch = DirectoryPrefetch(
            meta, self.fetcher, budget=min(config.cache_size // 8, DIR_PREFETCH_BYTES),
            at_once=max(4, config.max_connections), version_of=self._version,
            is_local=local.has, clock=clock)
        self.files: dict[int, OpenFile] = {}
        self.dirs: dict[int, int] = {}
        self._handles = itertools.count(1)
        self._listing: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._kernel_etag: dict[int, str] = {}
        self._opens: dict[int, int] = {}
        self._writers: dict[int, int] = {}
        self._written: dict[int, tuple[int, int]] = {}  # ino -> (size, mtime_ns) of writers
        self._unsaved: set[int] = set()  # ... changed since last stored in LMDB
        self._marked_dirty: set[int] = set()  # ... whose DATA flag is set in LMDB
        self._unclosed: set[int] = set()  # written since their last close or fsync
        # A write of these failed (ENOSPC, EIO) since their last fsync: the
        # application saw the error, so, as after a crash, what they hold is
        # not published (see _held); ino -> why
        self._write_failed: dict[int, str] = {}
        self.disk_full = 0  # times the cache disk was found full
        self.recovered_dir = local.root.parent / "recovered"
        self.recovered_files = 0  # files in it (counted at mount, kept since)
        self._changes: dict[int, int] = {}
        self._materializing: dict[int, trio.Lock] = {}
        self._disk = trio.CapacityLimiter(8)
        self._stale_local: set[int] = set()  # dropped once no handle reads them
        self._warned: set[str] = set()
        self.flush_on_unmount = True
        self.write_requests = 0
        self.write_bytes = 0
        self.read_requests = 0
        self.read_bytes = 0
        self.local_reads = 0  # reads answered from a whole local copy
        self.lookup_requests = 0
        local.in_use = self.is_open
        cache.others = lambda: local.used
        self.fetcher.make_room = self._room_for_blocks
        self.metrics = Metrics(self)

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.local.start_spares()
        self.fetcher.start(nursery)
        self.object_attrs.start(nursery)
        self.dir_prefetch.start(nursery)
        nursery.start_soon(self.promoter.run)
        nursery.start_soon(self.compactor.run)
        nursery.start_soon(self._save_dir_times_now_and_then)
        nursery.start_soon(self.metrics.run)

    def recover(self) -> None:
        """At mount: reconcile local copies with the metadata after any exit."""
        self._recover_unclosed()
        for ino in self.meta.purge_orphans():
            self.local.remove(ino)
        pending = {inode.ino: inode for inode in self.meta.pending_inodes()}
        for ino in self.local.inos():
            inode = pending.get(ino) or self.meta.get(ino)
            if inode is None:
                self.local.remove(ino)
            elif ino in pending and inode.pending & DATA:
                size = os.path.getsize(self.local.path(ino))
                if size != inode.size:  # written after the last save: the copy is the truth
                    st = os.stat(self.local.path(ino))
                    self.meta.update(ino, size=size, mtime_ns=st.st_mtime_ns)
            else:
                self.local.mark_clean(ino)
        for ino, inode in pending.items():
            if inode.pending & DATA and inode.kind == FILE and not inode.size \
                    and not self.local.has(ino):
                self.local.create(ino)  # created, the daemon killed before its copy was
                self.local.mark_dirty(ino)
        if pending:
            log.info("%d inodes have changes not yet in the lake: promoting them",
                     len(pending))

    def _recover_unclosed(self) -> None:
        """Files written through a handle and neither closed nor fsynced when
        the node went down are not published under their names: the lake
        keeps its last version of each (a half-written checkpoint shard must
        not replace it), and the bytes written go to the recovery directory,
        for a person to look at (``aifs status`` says where)."""
        if self.recovered_dir.is_dir():  # counted once here, not per status request
            self.recovered_files = sum(len(f) for _, _, f in os.walk(self.recovered_dir))
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for ino in self.meta.unclosed():
            inode = self.meta.get(ino)
            if inode is not None and self.local.has(ino) and not inode.orphan:
                # under its key; by inode number where no path here can hold the key
                names = list(dict.fromkeys((inode.key or str(ino), str(ino))))
                for name in names:
                    target = self.recovered_dir / stamp / name
                    try:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        os.rename(self.local.path(ino), target)
                        break
                    except OSError:
                        if name == names[-1]:
                            raise  # kept where it is: nothing is dropped unsaved
                self.recovered_files += 1
                log.warning("%s was open for writing when the node went down: not "
                            "published; the bytes written are in %s", inode.key, target)
            self.local.remove(ino)
            self.meta.unpublish(ino)

    # -- attributes -------------------------------------------------------
    def attributes(self, inode: Inode) -> Attributes:
        nlink = 2 + self._subdirs(inode.ino) if inode.is_dir else inode.nlink
        return Attributes(inode.ino, st_mode(inode), nlink,
                          self.uid if inode.uid < 0 else inode.uid,
                          self.gid if inode.gid < 0 else inode.gid,
                          inode.size, inode.mtime_ns,
                          int(inode.ctime * 1e9) or inode.mtime_ns,
                          inode.atime_ns or inode.mtime_ns, inode.rdev)

    def _subdirs(self, ino: int) -> int:
        """How many subdirectories ``ino`` has (its st_nlink is 2 more, as on
        ext4 and tmpfs); counted once per change of the directory."""
        count = self._subdir_counts.get(ino)
        if count is None:
            count = self._subdir_counts[ino] = self.meta.subdir_count(ino)
            if len(self._subdir_counts) > 65536:
                self._subdir_counts.pop(next(iter(self._subdir_counts)))
        return count

    def _inode(self, ino: int) -> Inode:
        inode = self.meta.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return self._with_written(inode)

    def _with_written(self, inode: Inode) -> Inode:
        """``inode`` with the size and mtime of writes (and directory times) not
        yet stored."""
        written = self._written.get(inode.ino)
        if written is not None:
            inode.size, inode.mtime_ns = written
        elif inode.is_dir and inode.ino in self._dir_times:
            inode.mtime_ns, inode.ctime = self._dir_times[inode.ino]
        return inode

    def _directory(self, ino: int) -> Inode:
        directory = self._inode(ino)
        if not directory.is_dir:
            raise FsError(errno.ENOTDIR)
        if directory.orphan:
            raise FsError(errno.ENOENT)
        return directory

    # -- directory listings -------------------------------------------------
    def _fresh(self, directory: Inode) -> bool:
        return self.clock() - directory.listed_at < self.config.metadata_ttl

    def _refresh_behind(self, directory: Inode) -> bool:
        """Whether an entry already known in ``directory`` may be answered now,
        the listing past its TTL refreshed in the background meanwhile: while
        it is younger than twice the TTL (stale-while-revalidate, so a ``stat``
        after the TTL does not wait for a LIST). True if the listing is fresh."""
        age = self.clock() - directory.listed_at
        ttl = self.config.metadata_ttl
        if age < ttl:
            return True
        if age >= STALE_SERVED * ttl or self._nursery is None:
            return False
        if directory.ino not in self._listing:
            self._nursery.start_soon(self._refresh, directory)
        return True

    async def _refresh(self, directory: Inode) -> None:
        try:
            await self._ensure_listed(directory)
        except (LakeError, FsError) as exc:  # the next lookup past the window lists again
            log.debug("background listing of %r: %s", directory.key, exc)

    async def _ensure_listed(self, directory: Inode) -> Inode:
        """Refresh ``directory`` from LIST if its listing is older than the TTL.

        A listing that started after this call did is fresh enough for it,
        whatever the TTL (with ``metadata_ttl`` 0 every call lists once)."""
        called = self.clock()
        while not self._fresh(directory):
            pending = self._listing.get(directory.ino)
            if pending is not None:
                await pending.wait()
            else:
                done = self._listing[directory.ino] = trio.Event()
                try:
                    await self._list(directory)
                finally:
                    del self._listing[directory.ino]
                    done.set()
            refreshed = self.meta.get(directory.ino)
            if refreshed is None:
                raise FsError(errno.ENOENT)
            if refreshed.listed_at == directory.listed_at:
                return refreshed  # the listing failed for another waiter: serve what we have
            directory = refreshed
            if directory.listed_at >= called:
                break
        return directory

    async def _list(self, directory: Inode) -> None:
        self.save_dir_times()  # a listing keeps what changed here since it started
        prefix = directory.key
        started = self.clock()
        entries: dict[str, Listed] = {}
        async for page in self.store.iter_list(prefix, "/"):
            for sub in page.prefixes:
                name = sub[len(prefix):-1]
                if self._acceptable(directory, name, sub):
                    entries[name] = Listed(name, DIR, sub, 0, "", started)
            for obj in page.objects:
                if obj.key == prefix:
                    continue  # this directory's own marker object
                name = obj.key[len(prefix):]
                if not self._acceptable(directory, name, obj.key):
                    continue
                if name in entries:
                    self._warn_once(obj.key, "a directory of the same name exists; "
                                    "the object is hidden")
                    continue
                entries[name] = Listed(name, FILE, obj.key, obj.size, obj.etag, obj.mtime)
        await self._add_packed(directory, entries, started)
        # A file listed before the directory of the same name loses too.
        removed, replaced = await trio.to_thread.run_sync(
            self.meta.apply_listing, directory.ino, list(entries.values()), started, started)
        for ino in removed:
            self._free_if_unused(ino)
        for ino in replaced:  # another writer's version: our clean copy is stale
            if self.local.has(ino):
                if self.is_open(ino):
                    self._stale_local.add(ino)
                else:
                    self.local.remove(ino)
        self._subdir_counts.pop(directory.ino, None)
        log.debug("listed %r: %d entries, %d removed", prefix, len(entries), len(removed))

    async def _add_packed(self, directory: Inode, entries: dict[str, Listed],
                          started: float) -> None:
        """Add the packed files (and directories holding them) of a listing.

        A plain object of the same name wins if it is not older than the
        packed file's record (to the second); a packed copy made by ``aifs
        pack`` shows only while its original is unchanged (the original is the
        truth for other tools)."""
        await self.packer.journals.refresh_if_stale()
        # A directory may hold 100,000 packed files: merge them in a worker
        # thread, so other requests go on meanwhile.
        await trio.to_thread.run_sync(self._merge_packed, directory, entries, started)

    def _merge_packed(self, directory: Inode, entries: dict[str, Listed],
                      started: float) -> None:
        prefix = directory.key
        for name, record in self.packs.objects(prefix).items():
            name = name.rstrip("/")  # a directory's marker
            plain = entries.get(name)
            described = plain and self.object_attrs.from_record(plain, record)
            if described:
                entries[name] = described
        for name, entry in self.packs.children(prefix):
            if not self._acceptable(directory, name, prefix + name):
                continue
            plain = entries.get(name)
            if entry is None:
                if plain is None:
                    entries[name] = Listed(name, DIR, prefix + name + "/", 0, "", started)
                continue
            if entry.origin:
                if plain is None or plain.kind != FILE or plain.etag != entry.origin:
                    continue
            elif plain is not None and (plain.kind == DIR or math.floor(plain.mtime)
                                        >= math.floor(entry.stamp / 1e9)):
                continue  # the lake's times are whole seconds: a tie goes to the object
            entries[name] = Listed(name, FILE, entry.key, entry.length, entry.etag,
                                   entry.mtime_ns / 1e9, entry_fields(entry))

    def _acceptable(self, directory: Inode, name: str, key: str) -> bool:
        if directory.ino == ROOT_INO and name == RESERVED_PREFIX:
            return False
        if not valid_name(name) or "/" in name:
            self._warn_once(key, "not a valid POSIX name; skipped")
            return False
        return True

    def _warn_once(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("lake key %r: %s", key, why)

    # -- lookups ------------------------------------------------------------
    def remember(self, ino: int) -> None:
        """The kernel got one more reference to ``ino``."""
        self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def forget(self, items: list[tuple[int, int]]) -> None:
        for ino, count in items:
            left = self.lookups.get(ino, 0) - count
            if left > 0:
                self.lookups[ino] = left
                continue
            self.lookups.pop(ino, None)
            self._free_if_unused(ino)

    def is_open(self, ino: int) -> bool:
        return self._opens.get(ino, 0) > 0

    def reads_lake(self, ino: int) -> bool:
        """Whether an open handle may still read ``ino``'s bytes from its lake
        object (so a deleted name's object stays until the last close): not
        once a local copy, which holds all of them, exists."""
        return self.is_open(ino) and not self.local.has(ino)

    def _free_if_unused(self, ino: int) -> None:
        """Drop an orphan nobody refers to any more, with its local data."""
        if self.lookups.get(ino) or self.is_open(ino):
            return
        inode = self.meta.get(ino)
        if inode is None or not inode.orphan:
            return
        self._write_failed.pop(ino, None)  # gone: nothing of it to hold back
        self._clear_unclosed(ino)
        self.meta.delete_orphan(ino)
        self.local.remove(ino)
        self._forget_written(ino)
        self._changes.pop(ino, None)
        self._kernel_etag.pop(ino, None)

    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        """The child, with one more kernel reference; None if there is none."""
        self.lookup_requests += 1
        directory = self._directory(parent)
        if name == b".":
            child: Inode | None = directory
        elif name == b"..":
            child = self._inode(directory.parent)
        else:
            if len(name) > 255:
                raise FsError(errno.ENAMETOOLONG)
            child = self.meta.lookup(parent, name)
            if child is None or not self._refresh_behind(directory):
                await self._ensure_listed(directory)
                child = self.meta.lookup(parent, name)
            if child is not None:
                child = await self.object_attrs.of_entry(parent, name, child)
                child = self._inode(child.ino)
        if child is not None:
            self.remember(child.ino)
        return child

    async def getattr(self, ino: int) -> Inode:
        inode = self._inode(ino)
        if not inode.is_dir and not inode.orphan and not inode.pending:
            parent = self.meta.get(inode.parent)
            if parent is not None and not self._refresh_behind(parent):
                await self._ensure_listed(parent)
                inode = self._inode(ino)
        if not inode.attrs_known and not inode.orphan:
            await self.object_attrs.load(inode, may_change_kind=False)
            inode = self._inode(ino)
        return inode

    async def setattr(self, ino: int, changes: SetAttributes, fh: int | None = None) -> Inode:
        inode = self._inode(ino)
        if changes.size is not None:
            if inode.is_dir:
                raise FsError(errno.EISDIR)
            await self._truncate(inode, changes.size)
        updates: dict[str, object] = {}
        if changes.mode is not None:
            updates["mode"] = stat.S_IMODE(changes.mode)
        if changes.uid is not None:
            updates["uid"] = changes.uid
        if changes.gid is not None:
            updates["gid"] = changes.gid
        if changes.atime_ns is not None:
            updates["atime_ns"] = changes.atime_ns
        if changes.mtime_ns is not None:
            updates["mtime_ns"] = changes.mtime_ns
            self._dir_times.pop(ino, None)  # an explicit time beats a batched one
            if ino in self._written:
                # The written size stays; it is saved with the new time below
                # (cp -p and tar x set times through the fd of a file they wrote).
                self._written[ino] = (self._written[ino][0], changes.mtime_ns)
                self._unsaved.add(ino)
        if updates:
            self._save_written(ino)
            current = self._inode(ino)
            self._changed(ino)
            self.meta.update(ino, pending=current.pending | META, ctime=self.clock(),
                             attrs_known=True, **updates)
            self._schedule(ino)
        return self._inode(ino)

    # -- directories ----------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        directory = self._directory(ino)
        await self._ensure_listed(directory)
        fh = next(self._handles)
        self.dirs[fh] = ino
        return fh

    async def readdir(self, fh: int, after_cookie: int) -> list[tuple[int, bytes, Inode]]:
        """The next batch of (cookie, name, inode) after ``after_cookie``:
        ``.`` and ``..`` first (cookies 1 and 2), then the entries, whose
        stored cookies are shifted by 2.

        readdir reports each entry's type (d_type): an object LIST showed
        that may be a symlink, FIFO, socket or device (their objects are
        small: at most PATH_MAX bytes) has its attributes read first, those
        of one batch in parallel. Larger objects are regular files."""
        ino = self.dirs.get(fh)
        if ino is None:
            raise FsError(errno.EBADF)
        batch = self.meta.readdir(ino, max(0, after_cookie - 2), READDIR_BATCH)
        for _ in range(3):  # entries that move up into the batch are looked at too
            unknown = [inode for _, _, inode in batch if self.object_attrs.type_unknown(inode)]
            if not unknown:
                break

            async def load(inode: Inode) -> None:
                try:
                    await self.object_attrs.load(inode, may_change_kind=True)
                except LakeError as exc:  # listed as a file; a lookup tries again
                    log.warning("attributes of %s: %s", inode.key, exc)

            async with trio.open_nursery() as nursery:
                for inode in unknown:
                    nursery.start_soon(load, inode)
            # A symlink found gets a new inode number (and cookie: it comes later)
            batch = self.meta.readdir(ino, max(0, after_cookie - 2), READDIR_BATCH)
        out: list[tuple[int, bytes, Inode]] = []
        if after_cookie < 2:
            directory = self._inode(ino)
            if after_cookie < 1:
                out.append((1, b".", directory))
            parent = directory if ino == ROOT_INO else self.meta.get(directory.parent)
            out.append((2, b"..", self._with_written(parent or directory)))
        out += [(cookie + 2, name, self._with_written(inode)) for cookie, name, inode in batch]
        return out

    def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    # -- namespace ------------------------------------------------------------
    async def _new_entry(self, parent: int, name: bytes) -> Inode:
        """The parent directory, checked and listed, where ``name`` may be created."""
        directory = self._directory(parent)
        if len(name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if name in (b".", b"..") or b"/" in name or b"\0" in name:
            raise FsError(errno.EINVAL)
        if parent == ROOT_INO and name == RESERVED_PREFIX.encode():
            raise FsError(errno.EPERM)  # the lake's reserved prefix
        directory = await self._ensure_listed(directory)
        if directory.orphan:
            raise FsError(errno.ENOENT)  # removed by the listing
        if self.meta.exists(parent, name):
            raise FsError(errno.EEXIST)
        return directory

    def _add(self, directory: Inode, name: bytes, kind: str, mode: int, uid: int, gid: int,
             pending: int, unclosed: bool = False, **extra: object) -> Inode:
        now = self.clock()
        key = directory.key + _name(name) + ("/" if kind == DIR else "")
        self._check_key(key)
        mode = stat.S_IMODE(mode)
        if directory.mode >= 0 and directory.mode & stat.S_ISGID:
            # A set-group-ID directory: its group is inherited, and by
            # directories the bit too (as ext4 and tmpfs do).
            gid = self.gid if directory.gid < 0 else directory.gid
            if kind == DIR:
                mode |= stat.S_ISGID
        inode = Inode(0, kind, key, directory.ino, mtime_ns=time.time_ns(),
                      mode=mode, uid=uid, gid=gid, ctime=now,
                      attrs_known=True, pending=pending, **extra)  # type: ignore[arg-type]
        inode = self.meta.create(directory.ino, name, inode, unclosed)
        if unclosed:
            self._unclosed.add(inode.ino)
        self._touch_dir(directory.ino)
        self.remember(inode.ino)
        return inode

    def _check_key(self, key: str) -> None:
        """A name whose lake key the lake cannot hold gets ENAMETOOLONG (S3
        keys have at most 1,024 bytes): refused now, not lost at promotion."""
        if len(key.encode("utf-8", "surrogateescape")) > self.store.max_key_bytes:
            raise FsError(errno.ENAMETOOLONG)

    def _touch_dir(self, ino: int) -> None:
        """A directory's entries changed: its mtime moves (kept locally only, and
        stored in batches: a create costs no extra metadata transaction)."""
        self._dir_times[ino] = (time.time_ns(), self.clock())
        self._subdir_counts.pop(ino, None)

    def save_dir_times(self) -> None:
        """Store the directory times changed since the last call."""
        if self._dir_times:
            times, self._dir_times = self._dir_times, {}
            self.meta.set_times(times)

    async def _save_dir_times_now_and_then(self) -> None:
        while True:
            await trio.sleep(1.0)
            self.save_dir_times()

    async def _new_file(self, parent: int, name: bytes, mode: int, uid: int,
                        gid: int, unclosed: bool = False) -> Inode:
        directory = await self._new_entry(parent, name)
        inode = self._add(directory, name, FILE, mode, uid, gid, DATA, unclosed)
        self.local.create(inode.ino)
        self._kernel_etag[inode.ino] = inode.etag
        return inode

    async def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Inode]:
        # opened for writing: a crash before its close must never publish it
        inode = await self._new_file(parent, name, mode, uid, gid,
                                     unclosed=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        fh = self._open_handle(inode, writable=True)
        self.files[fh].kill_setid = uid != 0
        self._maybe_stream(inode)
        return fh, inode

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
                    gid: int) -> Inode:
        """A regular file, or a FIFO, socket or device: an inode with no
        content, kept in the lake as an empty object whose mode says its type
        (s3fs's form). Their I/O never reaches aifs: the kernel serves it."""
        kind = kind_of(mode) or FILE
        if kind == FILE:
            inode = await self._new_file(parent, name, mode, uid, gid)
        elif kind in SPECIAL:
            directory = await self._new_entry(parent, name)
            inode = self._add(directory, name, kind, mode, uid, gid, DATA,
                              rdev=rdev if kind in (CHR, BLK) else 0)
        else:
            raise FsError(errno.EINVAL)
        self._schedule(inode.ino)
        return inode

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        directory = await self._new_entry(parent, name)
        inode = self._add(directory, name, DIR, mode, uid, gid, META,
                          listed_at=self.clock())
        self._schedule(inode.ino)
        return inode

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int,
                      gid: int) -> Inode:
        directory = await self._new_entry(parent, name)
        text = _name(target)
        inode = self._add(directory, name, LINK, 0o777, uid, gid, DATA, target=text,
                          size=len(target))
        self._schedule(inode.ino)
        return inode

    async def readlink(self, ino: int) -> bytes:
        inode = self._inode(ino)
        if inode.kind != LINK:
            raise FsError(errno.EINVAL)
        if not inode.target and inode.size and inode.in_lake:
            data = await self.store.get_range(inode.key, 0, inode.size)
            inode = self.meta.update(ino, target=_name(data)) or inode
        return inode.target.encode("utf-8", "surrogateescape")

    async def _child(self, parent: int, name: bytes) -> Inode:
        """An existing child of a listed directory."""
        await self._ensure_listed(self._directory(parent))
        child = self.meta.lookup(parent, name)
        if child is None:
            raise FsError(errno.ENOENT)
        return child

    async def unlink(self, parent: int, name: bytes) -> None:
        if (await self._child(parent, name)).is_dir:
            raise FsError(errno.EISDIR)
        self._remove(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        child = await self._child(parent, name)
        if not child.is_dir:
            raise FsError(errno.ENOTDIR)
        await self._ensure_listed(child)
        if self.meta.children_count(child.ino):
            raise FsError(errno.ENOTEMPTY)
        self._remove(parent, name)

    def _remove(self, parent: int, name: bytes) -> None:
        key = self._inode(parent).key + _name(name)
        removed = self.meta.remove(parent, name)
        self._touch_dir(parent)
        if removed is not None and removed.packed:
            self.packer.queue_records([deletion(key)])
        if removed is not None and removed.orphan:
            self.promoter.streams.cancel(removed.ino, "deleted")
            self._unlinked(removed.ino)
        elif removed is not None:  # a hard link: the other names stay
            self._changed(removed.ino)
            self._schedule(removed.ino)
        self.promoter.tombstones_changed()

    def _unlinked(self, ino: int) -> None:
        """``ino`` lost its last name. While a descriptor holds it, its data
        stays readable and writable (the size written so far included), as
        POSIX wants; it goes with the last close or forget."""
        if not self.is_open(ino):
            self._forget_written(ino)
        self._free_if_unused(ino)

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A hard link: one inode, one more name. In the lake each name is an
        object of its own with the same bytes (a server-side copy) and the
        group's id in its metadata (see objattrs)."""
        inode = self._inode(ino)
        if inode.is_dir:
            raise FsError(errno.EPERM)
        if inode.orphan:
            raise FsError(errno.ENOENT)
        directory = await self._new_entry(new_parent, new_name)
        key = directory.key + _name(new_name)
        self._check_key(key)
        if inode.packed:
            await self._make_local(ino)  # names of a packed file become objects
            if not self._writers.get(ino):
                self._forget_written(ino)
        self._save_written(ino)
        self.promoter.streams.cancel(ino, "linked")
        self._changed(ino)
        linked = self.meta.link(ino, new_parent, new_name, key,
                                f"{self.meta.node_id()}-{ino}")
        self._touch_dir(new_parent)
        self.remember(ino)
        self._schedule(ino)
        return self._with_written(linked)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int,
                     new_name: bytes, flags: int) -> None:
        if flags & RENAME_EXCHANGE or flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise FsError(errno.EINVAL)
        source_dir = self._directory(old_parent)
        await self._ensure_listed(source_dir)
        source = self.meta.lookup(old_parent, old_name)
        if source is None:
            raise FsError(errno.ENOENT)
        if len(new_name) > 255:
            raise FsError(errno.ENAMETOOLONG)
        if new_parent == ROOT_INO and new_name == RESERVED_PREFIX.encode():
            raise FsError(errno.EPERM)
        target_dir = self._directory(new_parent)
        await self._ensure_listed(target_dir)
        target = self.meta.lookup(new_parent, new_name)
        if target is not None:
            if target.ino == source.ino:
                return
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if source.is_dir and not target.is_dir:
                raise FsError(errno.ENOTDIR)
            if target.is_dir and not source.is_dir:
                raise FsError(errno.EISDIR)
            if target.is_dir:
                await self._ensure_listed(target)
                if self.meta.children_count(target.ino):
                    raise FsError(errno.ENOTEMPTY)
        if source.is_dir and self._is_under(target_dir, source.ino):
            raise FsError(errno.EINVAL)  # into its own subtree
        self._save_written(source.ino)
        source = self._inode(source.ino)
        new_key = target_dir.key + _name(new_name) + ("/" if source.is_dir else "")
        self._check_key(new_key)
        if source.links:  # a name of a hard-linked file: the promoter copies it anew
            tombstones, etags = [], {}
        else:
            tombstones, etags = await self._move_in_lake(source, new_key)
        if target is not None and target.packed and not source.packed:
            self.packer.queue_records([deletion(target.key)])
        moved, replaced = self.meta.rename(old_parent, old_name, new_parent, new_name,
                                           new_key, tombstones, etags, self.local.has)
        self._move_packed(source.key, new_key, source.is_dir)
        if source.is_dir:  # descendants to upload again under their new keys
            for inode in self.meta.pending_inodes():
                if inode.pending & DATA and self._is_under(inode, moved.ino):
                    self._schedule(inode.ino, sooner=True)
        self._touch_dir(old_parent)
        if new_parent != old_parent:
            self._touch_dir(new_parent)
        self.checkpoints.committed_by_rename(moved)
        if not moved.is_dir:
            self.promoter.streams.cancel(moved.ino, "renamed")
        if replaced is not None and replaced.orphan:
            self.promoter.streams.cancel(replaced.ino, "replaced")
            self._unlinked(replaced.ino)
        elif replaced is not None:
            self._changed(replaced.ino)
            self._schedule(replaced.ino)
        if moved.pending:
            self._schedule(moved.ino, sooner=True)
        self.promoter.tombstones_changed()

    def _move_packed(self, old_key: str, new_key: str, is_dir: bool) -> None:
        """Publish a rename of packed files: each gets a record under its new
        key (the same bytes) and a deletion under the old one. A packed copy
        made by ``aifs pack`` is dropped: its original was copied in the lake.

        A record moves only when the renamed file's lake copy IS that record:
        the pack index may still name a file that was replaced while its pack
        was on the way (its bytes are no one's now), or an older version of a
        file changed since; those records are deleted, and the file's pending
        upload writes the new key."""
        if is_dir:
            entries = self.packs.under(old_key)
        else:
            entry = self.packs.entry(old_key)
            entries = [entry] if entry is not None else []
        if not entries:
            return
        now = time.time_ns()
        records = []
        for entry in entries:
            records.append(deletion(entry.key, now))
            if entry.origin:
                continue
            moved = dataclasses.replace(entry, key=new_key + entry.key[len(old_key):],
                                        stamp=now + 1)
            owner = self.meta.owner_of(moved.key)
            inode = self.meta.get(owner) if owner is not None else None
            if inode is None:  # not loaded here (a subtree never listed): the lake's word
                records.append(moved.record())
            elif is_packed_at(inode, entry) and not inode.pending & DATA:
                records.append(moved.record())
                self.meta.update(inode.ino, etag=moved.etag)
        self.packer.queue_records(records)

    def _is_under(self, inode: Inode, ancestor: int) -> bool:
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

    async def _move_in_lake(self, source: Inode,
                            new_key: str) -> tuple[list[str], dict[str, str]]:
        """Copy what the lake holds of ``source`` to ``new_key`` (server side);
        return the old keys to delete and the ETags of the copies."""
        if not source.is_dir:
            if not source.in_lake:
                return [], {}
            if source.packed and not source.pending & DATA:
                entry = self.packs.entry(source.key)
                if entry is not None and not entry.origin:
                    return [], {}  # no object: the pack index moves it
            if source.pending & DATA or source.etag == MAYBE_IN_LAKE:
                return [source.key], {}  # its upload goes to the new key
            metadata = (object_metadata(source, self.uid, self.gid)
                        if source.pending & META else None)
            try:
                etag = await self.store.copy(source.key, new_key, metadata)
            except ObjectNotFound:
                return [], {}
            return [source.key], {new_key: etag}
        old_keys: list[str] = []
        copies: list[tuple[str, str]] = []
        markers: list[tuple[str, str]] = []  # copied after the rest
        unpromoted: bool | None = None  # data below not yet in the lake (asked once)
        async for page in self.store.iter_list(source.key, None):
            for obj in page.objects:
                old_keys.append(obj.key)
                if self.meta.tombstoned(obj.key):
                    continue
                owner = self.meta.owner_of(obj.key)
                owner_inode = self.meta.get(owner) if owner else None
                if owner_inode is not None and owner_inode.pending & DATA:
                    continue  # uploaded under its new key later
                if owner_inode is not None and owner_inode.packed:
                    entry = self.packs.entry(obj.key)
                    if entry is not None and not entry.origin \
                            and is_packed_at(owner_inode, entry):
                        continue  # a stale object under a packed file's name: deleted
                pair = (obj.key, new_key + obj.key[len(source.key):])
                if owner_inode is not None and self.checkpoints.is_marker(owner_inode):
                    if unpromoted is None:
                        unpromoted = any(i.pending & DATA and i.key.startswith(source.key)
                                         for i in self.meta.pending_inodes())
                    if unpromoted and self.local.has(owner_inode.ino):
                        continue  # uploaded again, after the data it commits
                    markers.append(pair)
                else:
                    copies.append(pair)
        etags: dict[str, str] = {}
        limiter = trio.CapacityLimiter(COPY_CONCURRENCY)

        failures: list[LakeError] = []

        async def copy(src: str, dst: str) -> None:
            async with limiter:
                try:
                    etags[dst] = await self.store.copy(src, dst)
                except ObjectNotFound:
                    pass  # deleted meanwhile by another writer
                except LakeError as exc:
                    failures.append(exc)

        for batch in (copies, markers):
            async with trio.open_nursery() as nursery:
                for src, dst in batch:
                    nursery.start_soon(copy, src, dst)
            if failures:
                break
        if failures:
            # The rename fails as a whole: the copies already made are deleted.
            for dst in etags:
                if self.meta.owner_of(dst) is None:
                    self.meta.add_tombstone(dst)
            self.promoter.tombstones_changed()
            raise failures[0]
        if source.key not in old_keys:
            old_keys.append(source.key)  # the marker, if any
        return old_keys, etags

    # -- files ----------------------------------------------------------------
    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[int, bool]:
        """Open a file; return the handle and whether the kernel may keep the
        pages it cached for this inode (only if the content did not change
        behind its back). O_TRUNC arrives here (atomic open-truncate)."""
        inode = self._inode(ino)
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        writable = bool(flags & (os.O_WRONLY | os.O_RDWR))
        keep_cache = self._kernel_etag.get(ino) == inode.etag
        self._kernel_etag[ino] = inode.etag
        fh = self._open_handle(inode, writable)
        self.files[fh].kill_setid = writable and uid != 0
        if not writable and self.config.dir_prefetch:
            self.dir_prefetch.opened(inode, self.files[fh].version)
        if flags & os.O_TRUNC:  # O_RDONLY|O_TRUNC truncates too, as Linux does
            try:
                await self._truncate(inode, 0)
            except BaseException:
                self.release(fh)
                raise
            keep_cache = False
            if writable:
                self._maybe_stream(inode)
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

    def _maybe_stream(self, inode: Inode) -> None:
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
        metadata = object_metadata(inode, self.uid, self.gid)
        metadata.pop("mtime", None)  # fixed at upload creation: the lake's time serves
        return inode.key, str(self.local.path(ino)), metadata

    def _open_handle(self, inode: Inode, writable: bool) -> int:
        fh = next(self._handles)
        ino = inode.ino
        self._opens[ino] = self._opens.get(ino, 0) + 1
        if writable:
            self._writers[ino] = self._writers.get(ino, 0) + 1
        version = self._version(inode)
        # Weights are read front to back, whole: start at the widest window.
        first = self.config.readahead_max if version.policy == WEIGHTS else self.block_size
        self.files[fh] = OpenFile(ino, version, Readahead(first, self.config.readahead_max),
                                  writable)
        return fh

    def _version(self, inode: Inode) -> ObjectVersion:
        """The lake version an inode's cached blocks belong to (for a packed
        file: its range of the pack, named by place, checked by checksum)."""
        policy, pinned = self.checkpoints.policy_of(inode), self.checkpoints.is_pinned(inode)
        if inode.packed:
            source = pack_key(inode.pack)
            return ObjectVersion(f"{source}@{inode.pack_offset}", inode.checksum, inode.size,
                                 policy, pinned, source=source, base=inode.pack_offset)
        return ObjectVersion(inode.key, inode.etag, inode.size, policy, pinned)

    def _pack_version(self, version: ObjectVersion) -> ObjectVersion | None:
        """The whole pack a packed file's bytes are in (None: its size is unknown)."""
        size = self.packs.pack_size(version.source[len(pack_key("")):])
        if size is None:
            return None
        return ObjectVersion(version.source, "", size, version.policy, version.pinned)

    async def _packed_bytes(self, version: ObjectVersion) -> bytes:
        """A packed file's bytes, verified. A range GET of them alone, unless
        the whole pack is wanted (dataset policy, or several of its files
        opened in a row: a directory scan) or already cached: then they come
        from the pack's blocks, which the next files of the pack hit."""
        if version.size == 0:
            return b""
        whole = self._pack_version(version)
        bs = self.block_size
        first, last = version.base // bs, (version.base + version.size - 1) // bs
        if whole is not None:
            scanning = self._scanning(version.source)
            if version.policy == DATASET or scanning:
                self.fetcher.prefetch(whole, 0, self.fetcher.blocks_of(whole) - 1)
            if scanning or version.policy == DATASET or all(
                    self.fetcher.available(whole, i) for i in range(first, last + 1)):
                pieces = []
                for index in range(first, last + 1):
                    lo = max(version.base, index * bs) - index * bs
                    hi = min(version.base + version.size, (index + 1) * bs) - index * bs
                    pieces.append(bytes(await self.fetcher.read(whole, index, lo, hi)))
                data = b"".join(pieces)
                verify(data, version.etag, version.key)
                return data
        return bytes(await self.fetcher.read(version, 0, 0, version.size))

    def _scanning(self, pack: str) -> bool:
        """Count an open of a file of ``pack``; True once several came in a row."""
        now = self.clock()
        count, since = self._pack_opens.get(pack, (0, now))
        if now - since > SCAN_WINDOW:
            count, since = 0, now
        self._pack_opens[pack] = (count + 1, since)
        if len(self._pack_opens) > 1024:
            self._pack_opens.pop(next(iter(self._pack_opens)))
        return count + 1 >= SCAN_OPENS

    def _file(self, fh: int) -> OpenFile:
        handle = self.files.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        return handle

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        data = await self._read(self._file(fh), offset, size)
        self.read_requests += 1
        self.read_bytes += len(data)
        return data

    async def _read(self, handle: OpenFile, offset: int, size: int) -> bytes | memoryview:
        if self.local.has(handle.ino):
            self.local_reads += 1
            self.local.touch(handle.ino)
            fd = self.local.fd(handle.ino)
            ahead = handle.readahead.observe(offset, size)
            end = offset + size + ahead
            if ahead and end > handle.advised + ahead // 2:
                # Sequential: have the kernel read the copy ahead, so the reads
                # that follow find it in the page cache and are served inline.
                start = max(handle.advised, offset + size)
                read_ahead([(fd, start, end - start)])
                handle.advised = end
            return await read_at(fd, offset, size, self._disk)
        version = handle.version
        if version.source:  # packed: small, read and verified whole once
            if handle.data is None:
                handle.data = await self._packed_bytes(version)
            return memoryview(handle.data)[offset:offset + size]
        end = min(offset + size, version.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        ahead = handle.readahead.observe(offset, end - offset)
        if ahead:
            # From the block this read ends in (the rest of it is read next),
            # unless the read takes that one block to its end itself: a sample
            # read whole needs no read-ahead request for its own block.
            whole_block = first == last and end >= min((last + 1) * bs, version.size)
            self.fetcher.prefetch(version, last + 1 if whole_block else last,
                                  (end - 1 + ahead) // bs)
        if first == last:  # the common case: a view, no copy
            return await self.fetcher.read(version, first, offset - first * bs,
                                           end - first * bs)
        pieces = []
        for index in range(first, last + 1):
            lo = max(offset, index * bs) - index * bs
            hi = min(end, (index + 1) * bs) - index * bs
            pieces.append(await self.fetcher.read(version, index, lo, hi))
        return b"".join(pieces)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self._file(fh)
        if not handle.writable:
            raise FsError(errno.EBADF)
        ino = handle.ino
        if handle.kill_setid:
            handle.kill_setid = False
            self._kill_setid(ino)
        size, _ = await self._make_local(ino)
        end = offset + len(data)
        try:
            if end > size:
                await self._reserve(end - size)
            written = await self._pwrite(self.local.fd(ino), data, offset)
        except FsError as exc:
            self._mark_unclosed(ino)
            self._write_failed[ino] = os.strerror(exc.errno)
            raise
        self._mark_unclosed(ino)
        self.write_requests += 1
        self.write_bytes += written
        self.promoter.streams.wrote(ino, offset, written)
        size = max(self._written[ino][0], offset + written)
        self._written[ino] = (size, time.time_ns())
        self._unsaved.add(ino)
        self._changed(ino)
        self.local.resized(ino, size)
        return written

    def _kill_setid(self, ino: int) -> None:
        inode = self.meta.get(ino)
        if inode is None or inode.mode < 0:
            return
        mode = inode.mode & ~stat.S_ISUID
        if mode & (stat.S_ISGID | stat.S_IXGRP) == stat.S_ISGID | stat.S_IXGRP:
            mode &= ~stat.S_ISGID
        if mode != inode.mode:
            self._changed(ino)
            self.meta.update(ino, mode=mode, pending=inode.pending | META, ctime=self.clock())

    async def _pwrite(self, fd: int, data: bytes, offset: int) -> int:
        """Write to a local copy, inline: a write into the page cache takes
        microseconds, less than handing it to a thread and back. A full cache
        disk first gets room made (:meth:`_free_disk`); ENOSPC only if none
        can be."""
        try:
            return os.pwrite(fd, data, offset)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise FsError(exc.errno or errno.EIO) from None
        await self._free_disk(len(data))
        try:
            return os.pwrite(fd, data, offset)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                log.error("local cache disk full: a write is refused (ENOSPC); what is "
                          "not in the lake yet fills it")
            raise FsError(exc.errno or errno.EIO) from None

    async def _free_disk(self, wanted: int) -> None:
        """The cache disk is full (another tenant filled it, or sparse copies
        grew behind the accounting): evict clean blocks and clean local
        copies, and let promotion make dirty copies clean, for at most
        DISK_FULL_WAIT seconds. The mount goes on by itself once space returns."""
        self.disk_full += 1
        log.warning("local cache disk full: evicting clean data, waiting up to %.0fs for "
                    "promotion", DISK_FULL_WAIT)
        amount = max(wanted, DISK_FULL_EVICT)
        await trio.to_thread.run_sync(self.cache.evict, amount, limiter=self._disk)
        freed = self.local.evict(amount)
        with trio.move_on_after(DISK_FULL_WAIT):
            while freed < wanted and self.promoter.hurry():
                await self.promoter.wait_progress()
                freed += self.local.evict(amount)

    async def _make_local(self, ino: int, needed: int | None = None) -> tuple[int, int]:
        """Make sure ``ino`` has a local copy marked dirty; return (size, mtime_ns).

        A copy is fetched from the lake once (its first ``needed`` bytes, default
        all: a truncate needs no more), however many writers ask at once.
        """
        if ino in self._marked_dirty and ino in self._written and self.local.has(ino):
            return self._written[ino]  # the common case: no metadata transaction
        if ino not in self._written or not self.local.has(ino):
            lock = self._materializing.setdefault(ino, trio.Lock())
            async with lock:
                inode = self._inode(ino)
                if not self.local.has(ino):
                    await self._materialize(inode, needed)
                self._written.setdefault(ino, (inode.size, inode.mtime_ns))
                if self._materializing.get(ino) is lock and not lock.statistics().tasks_waiting:
                    del self._materializing[ino]
        inode = self.meta.get(ino)
        if inode is not None and not inode.pending & DATA:
            self.meta.update(ino, pending=inode.pending | DATA, ctime=self.clock())
            self.local.mark_dirty(ino)
        self._marked_dirty.add(ino)
        return self._written[ino]

    async def _materialize(self, inode: Inode, size: int | None = None) -> None:
        """Fetch the first ``size`` bytes (default all) of the lake object into a local copy."""
        size = inode.size if size is None else min(size, inode.size)
        if size == 0 or not inode.in_lake or inode.etag == MAYBE_IN_LAKE:
            self.local.create(inode.ino)
            return
        await self._reserve(size)
        version = self._version(inode)
        bs = self.block_size
        count = (size + bs - 1) // bs
        tmp = self.local.tmp_path(inode.ino)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for index in range(count):
                self.fetcher.prefetch(version, index + 1, min(count - 1, index + 8))
                block = await self.fetcher.block(version, index)
                piece = memoryview(block)[:size - index * bs]
                await trio.to_thread.run_sync(os.pwrite, fd, piece, index * bs,
                                              limiter=self._disk)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        self.local.adopt(inode.ino, tmp)
        log.debug("materialized %s (%d bytes) for writing", inode.key, size)

    async def _truncate(self, inode: Inode, size: int) -> None:
        ino = inode.ino
        self.promoter.streams.cancel(ino, "truncated")
        if size == 0:
            self._write_failed.pop(ino, None)  # written anew from nothing

        current, _ = await self._make_local(ino, needed=size)
        if size > current:
            await self._reserve(size - current)
        try:
            os.ftruncate(self.local.fd(ino), size)
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO) from None
        self._written[ino] = (size, time.time_ns())
        self._unsaved.add(ino)
        self._changed(ino)
        self.local.resized(ino, size)
        self._save_written(ino)
        if not self._writers.get(ino):
            self._forget_written(ino)  # saved; no writer keeps it in memory
            self._schedule(ino)

    async def _reserve(self, incoming: int) -> None:
        """Make room in the cache for ``incoming`` bytes of local data: evict
        clean blocks, then clean local copies, then wait for promotion."""
        def over() -> int:
            return self.cache.used + self.local.used + incoming - self.config.cache_size
        if over() <= 0:
            return
        await trio.to_thread.run_sync(self.cache.evict, over(), limiter=self._disk)
        if over() > 0:
            self.local.evict(over())
        while over() > 0 and self.promoter.hurry():
            await self.promoter.wait_progress()
            self.local.evict(max(0, over()))

    def _room_for_blocks(self, incoming: int) -> None:
        """A fetched block needs room: old checkpoints' local copies go before
        any block, other clean copies only where blocks cannot free enough."""
        over = self.cache.used + self.local.used + incoming - self.config.cache_size
        if over <= 0:
            return
        over -= self.local.evict(over, up_to_rank=EVICT_FIRST)
        if over > self.cache.used:
            self.local.evict(over - self.cache.used)

    def _changed(self, ino: int) -> None:
        self._changes[ino] = self._changes.get(ino, 0) + 1

    def _forget_written(self, ino: int) -> None:
        self._written.pop(ino, None)
        self._unsaved.discard(ino)
        self._marked_dirty.discard(ino)

    def _save_written(self, ino: int) -> None:
        """Store the in-memory size and mtime of a file being written."""
        written = self._written.get(ino)
        if written is not None and ino in self._unsaved:
            self._unsaved.discard(ino)
            self.meta.update(ino, size=written[0], mtime_ns=written[1], ctime=self.clock())

    def _schedule(self, ino: int, sooner: bool = False) -> None:
        """Promote ``ino`` after the delay, unless still open for writing
        (``sooner``: even if it was waiting longer, e.g. for a staging rename)."""
        if not self._writers.get(ino):
            self.promoter.schedule(ino, sooner=sooner)

    async def flush(self, fh: int) -> None:
        handle = self._file(fh)
        if handle.writable:
            self._save_written(handle.ino)
            self._clear_unclosed(handle.ino)
            self.checkpoints.closed(handle.ino)  # before close() returns: a crash keeps it

    def _mark_unclosed(self, ino: int) -> None:
        """Written since the last close or fsync: if the node crashes before
        either, ``recover`` keeps these bytes out of the lake."""
        if ino not in self._unclosed:
            self._unclosed.add(ino)
            self.meta.mark_unclosed(ino)

    def _clear_unclosed(self, ino: int) -> None:
        if ino in self._unclosed and ino not in self._write_failed:
            self._unclosed.discard(ino)
            self.meta.clear_unclosed(ino)

    async def fsync(self, fh: int, datasync: bool) -> None:
        ino = self._file(fh).ino
        self._save_written(ino)
        await trio.to_thread.run_sync(self.local.sync, ino, limiter=self._disk)
        self._write_failed.pop(ino, None)  # what it holds now is what the writer wants
        self._clear_unclosed(ino)
        await trio.to_thread.run_sync(self.meta.sync, limiter=self._disk)
        if self.config.fsync == "lake":
            await self.promoter.sync(lambda inode: inode.ino == ino, None)

    def release(self, fh: int) -> None:
        handle = self.files.pop(fh, None)
        if handle is None:
            return
        ino = handle.ino
        if handle.writable:
            left = self._writers.get(ino, 0) - 1
            if left > 0:
                self._writers[ino] = left
            else:
                self._writers.pop(ino, None)
                self._save_written(ino)
                self._clear_unclosed(ino)
                if ino in self._written:
                    self.promoter.streams.closed(ino, self._written[ino][0],
                                                 self.change_count(ino))
                self._forget_written(ino)
                inode = self.meta.get(ino)
                if inode is not None and inode.pending and not inode.orphan:
                    # A streamed file is in parts already, an unfinished marker
                    # guards what follows: no delay. A commit marker waits for
                    # its checkpoint anyway: a rewrite does not push it back.
                    urgent = (self.checkpoints.is_unfinished_marker(inode)
                              or self.promoter.streams.active(ino))
                    self.promoter.schedule(ino, 0.0 if urgent else None,
                                           sooner=self.checkpoints.is_marker(inode))
        left = self._opens.get(ino, 0) - 1
        if left > 0:
            self._opens[ino] = left
            return
        self._opens.pop(ino, None)
        if ino in self._stale_local:
            self._stale_local.discard(ino)
            self.local.remove(ino)
        inode = self.meta.get(ino)
        self._free_if_unused(ino)
        if inode is not None and inode.orphan:
            self.promoter.tombstones_changed()  # its delete waited for the last close

    # -- promotion host ------------------------------------------------------------
    def promotable(self, ino: int, force: bool) -> Inode | None:
        """The inode as it should reach the lake now, or None if it must wait
        (open for writing: promoted after close, unless ``force``)."""
        if self._writers.get(ino) and not force:
            return None
        self._save_written(ino)
        inode = self.meta.get(ino)
        if inode is None or inode.orphan:
            return None
        return inode

    def held(self, ino: int) -> str | None:
        """Why ``ino`` must not reach the lake now, if it must not: a write of
        it failed since its last fsync (it goes to the recovery directory at
        the next mount unless fsynced or rewritten from size 0 first)."""
        why = self._write_failed.get(ino)
        return None if why is None else (
            f"not published: a write failed ({why}); fsync it or write it again")

    def change_count(self, ino: int) -> int:
        return self._changes.get(ino, 0)

    def packable(self, inode: Inode) -> bool:
        """Whether a file goes to the lake in a pack: small, by size and not by
        name (small ``*.bin``, ``*.pt`` or extension-less files pack too);
        checkpoint shards and their markers get objects of their own."""
        return (inode.kind == FILE and inode.size < self.packer.threshold
                and not inode.links and not self.promoter.streams.active(inode.ino)
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
        self._marked_dirty.discard(ino)  # the next write marks it dirty again
        if ino in self._kernel_etag:
            self._kernel_etag[ino] = inode.etag
        version = self._version(inode)
        for handle in self.files.values():
            if handle.ino == ino:
                handle.version = version

    async def sync(self, ino: int) -> None:
        """Return once every change at or under ``ino`` is in the lake."""
        inode = self._inode(ino)
        for written in list(self._written):
            self._save_written(written)
        if inode.is_dir:
            await self.promoter.sync(lambda i: self._is_under(i, ino), inode.key)
        else:
            await self.promoter.sync(lambda i: i.ino == ino, None)

    async def drain(self, timeout: float = 0.0,
                    progress: Callable[[dict[str, float]], None] | None = None) -> None:
        """At unmount: promote everything (unless told not to), for at most
        ``timeout`` seconds (0: as long as it takes); ``progress`` is told
        what is left once a second."""
        summary = self.promoter.summary()
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
                progress(self.promoter.summary())
                await trio.sleep(1)

        async def promote_all() -> None:
            try:
                await self.promoter.sync(lambda i: True, "")
            except LakeError as exc:
                left = self.promoter.summary()
                log.error("unmounting with %d files not in the lake (%s): the next mount "
                          "with this cache directory promotes them", left["files"], exc)

        with trio.move_on_after(timeout or math.inf) as deadline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(report)
                await promote_all()
                nursery.cancel_scope.cancel()
        if deadline.cancelled_caught:
            left = self.promoter.summary()
            log.warning("unmount_timeout of %.0fs passed with %d files (%d bytes) and %d "
                        "deletes not yet in the lake: the next mount with this cache "
                        "directory promotes them", timeout, left["files"], left["bytes"],
                        left["deletes"])

    # -- extended attributes ----------------------------------------------------
    def xattrs(self, ino: int) -> dict[bytes, Callable[[], bytes]]:
        """User xattrs, then read-only facts about an inode as ``user.aifs.*``;
        each value is computed only when asked for (some walk the whole queue)."""
        inode = self._inode(ino)
        out: dict[bytes, Callable[[], bytes]] = {
            name.encode("utf-8", "surrogateescape"): functools.partial(base64.b64decode, value)
            for name, value in inode.xattrs.items()}
        out[xattrs.KEY.encode()] = lambda: inode.key.encode("utf-8", "surrogateescape")
        if not inode.is_dir:
            out[xattrs.ETAG.encode()] = inode.etag.encode
            if inode.packed:
                out[PACK_XATTR] = f"{inode.pack}@{inode.pack_offset}".encode
            out[xattrs.CACHED_BYTES.encode()] = lambda: str(self._cached_bytes(inode)).encode()
        out[xattrs.STATE.encode()] = lambda: self.checkpoints.state(
            inode, self.promoter.progress, self._with_written).encode()
        out[xattrs.POLICY.encode()] = lambda: self.checkpoints.policy_of(inode).encode()
        out[PINNED_XATTR] = lambda: b"1" if self.checkpoints.is_pinned(inode) else b"0"
        if ino == ROOT_INO:
            out[xattrs.LAKE.encode()] = self.config.resolved_lake().encode
            out[xattrs.PID.encode()] = str(os.getpid()).encode
            out[xattrs.STATS.encode()] = lambda: json.dumps(self.stats()).encode()
            out[PENDING_XATTR] = lambda: json.dumps(self.promoter.summary()).encode()
            out[METRICS_XATTR] = lambda: json.dumps(self.metrics.snapshot()).encode()
            out[PACK_PROGRESS_XATTR] = lambda: json.dumps(
                dataclasses.asdict(self.compactor.progress)).encode()
        return out

    # -- warmup and pins ----------------------------------------------------------
    async def warm(self, ino: int, files_at_once: int = 32) -> dict[str, int]:
        """Fetch a file's blocks, or every file's below a directory, into the
        cache disk (``aifs warmup``); return the files, the bytes fetched and
        cached, and how many blocks the cache refused. A tree is walked from
        the listings, without a lookup (nor a HEAD) per file."""
        totals = {"files": 0, "fetched": 0, "cached": 0, "refused": 0, "errors": 0}
        inode = self._inode(ino)
        if not inode.is_dir:
            if not await self._warm_file(inode, totals):
                raise FsError(errno.EIO)
            return totals
        slots = trio.Semaphore(files_at_once)

        async def one(child: Inode) -> None:
            async with slots:
                await self._warm_file(child, totals)

        async with trio.open_nursery() as nursery:
            stack = [inode]
            while stack:
                directory = await self._ensure_listed(stack.pop())
                for _, _, child in self.meta.readdir(directory.ino, 0, 1 << 62):
                    if child.is_dir:
                        stack.append(child)
                    elif child.kind != LINK:
                        await slots.acquire()  # bound the tasks waiting, not only running
                        slots.release()
                        nursery.start_soon(one, child)
        return totals

    async def _warm_file(self, inode: Inode, totals: dict[str, int]) -> bool:
        totals["files"] += 1
        if self.local.has(inode.ino) or not inode.in_lake or inode.etag == MAYBE_IN_LAKE:
            totals["cached"] += inode.size
            return True
        version = self._version(inode)
        if version.source:  # packed: the whole pack, which its neighbours share
            version = self._pack_version(version) or version
        self.cache.reclass(version)
        try:
            fetched, refused = await self.fetcher.warm(version)
        except LakeError as exc:
            log.warning("warmup of %s failed: %s", inode.key, exc)
            totals["errors"] += 1
            return False
        totals["fetched"] += fetched
        totals["refused"] += refused
        totals["cached"] += self.cache.cached_bytes(version)
        return True

    async def pack_tree(self, ino: int) -> Upkeep:
        """``aifs pack``: pack the small plain objects below a directory; every
        listing is refreshed afterwards, so the packed copies serve reads."""
        directory = self._directory(ino)
        if directory.ino == ROOT_INO:
            def hidden(key: str) -> bool:
                return key.startswith(RESERVED_PREFIX + "/")
        else:
            def hidden(key: str) -> bool:
                return False
        result = await self.compactor.import_objects(directory.key, hidden)
        self.meta.expire_all()
        return result

    def pin(self, ino: int, on: bool) -> None:
        """Pin (or unpin) a file or a tree: its cached blocks are never evicted.
        Node-local: kept in LMDB, not in the lake. ``aifs pin`` then warms it."""
        self.meta.update(ino, pinned=on)
        self.checkpoints.forget_policies()
        for inode in self.meta.subtree_files(ino):
            if inode.etag:
                self.cache.reclass(self._version(inode))

    def _cached_bytes(self, inode: Inode) -> int:
        cached = self.cache.cached_bytes(self._version(inode))
        return max(cached, inode.size) if self.local.has(inode.ino) else cached

    def stats(self) -> dict[str, int]:
        """Live counters (also the seed of ``aifs status``)."""
        fetched = self.fetcher.stats
        promoted = self.promoter.stats
        return {"lake_gets": fetched.lake_gets, "lake_bytes": fetched.lake_bytes,
                "memory_hits": fetched.memory_hits, "disk_hits": fetched.disk_hits,
                "fetch_errors": fetched.errors, "cache_bytes": self.cache.used,
                "local_bytes": self.local.used, "cache_capacity": self.cache.capacity,
                "evictions": self.cache.evictions + self.local.evictions,
                "open_files": len(self.files), "write_requests": self.write_requests,
                "write_bytes": self.write_bytes, "read_requests": self.read_requests,
                "read_bytes": self.read_bytes, "local_reads": self.local_reads,
                "uploads": promoted.uploads,
                "upload_bytes": promoted.upload_bytes, "deletes": promoted.deletes,
                "metadata_updates": promoted.metadata_updates,
                "promote_failures": promoted.failures,
                "packs": self.packer.stats.packs, "packed_files": self.packer.stats.packed_files,
                "journals": self.packer.stats.journals,
                "journals_read": self.packer.stats.journals_read,
                "dir_prefetch_scans": self.dir_prefetch.scans,
                "dir_prefetch_objects": self.dir_prefetch.fetched}

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if not name.startswith(b"user."):
            raise FsError(errno.ENODATA)  # the kernel asks security.capability per write
        if name == SYNC_XATTR:
            await self.sync(ino)
            return b"synced"
        if name in (WARMUP_XATTR, GC_XATTR) or (name == PACK_XATTR
                                                and self._inode(ino).is_dir):
            return await self._action(ino, name)
        if not name.startswith(xattrs.PREFIX.encode()):
            await self._read_user_xattrs(ino)
        value = self.xattrs(ino).get(name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value()

    async def _read_user_xattrs(self, ino: int) -> None:
        """Read the metadata of an object no listing described (another tool
        wrote it, ``object_attrs`` off) when its xattrs are asked for: one
        HEAD then, none for a walk or ``ls -l``."""
        inode = self._inode(ino)
        if inode.kind != DIR and not inode.packed and inode.in_lake:
            await self.object_attrs.load(inode, may_change_kind=False, asked=True)

    async def _action(self, ino: int, name: bytes) -> bytes:
        """Run the command an xattr stands for (warmup, pack, gc); its result
        (JSON) is kept for the client's second call. Clients read an xattr
        twice: once to learn its size (getfattr) or with a 128-byte buffer
        that is too small (Python), then with a buffer that fits."""
        remembered = self._action_results.pop((ino, name), None)
        if remembered is not None and self.clock() - remembered[0] < ACTION_RESULT_KEPT:
            return remembered[1]
        if name == WARMUP_XATTR:
            result: dict[str, object] = dict(await self.warm(ino))
        elif name == GC_XATTR:
            upkeep = await self.compactor.gc()
            upkeep.uploads_aborted = await self.promoter.abort_stale_uploads()
            result = dataclasses.asdict(upkeep)
        else:
            result = dataclasses.asdict(await self.pack_tree(ino))
        value = json.dumps(result).encode().ljust(129)  # never fits a 128-byte probe
        self._action_results[(ino, name)] = (self.clock(), value)
        return value

    async def listxattr(self, ino: int) -> list[bytes]:
        """The xattrs users set. The ``user.aifs.*`` facts and commands are
        read by name only: listed, copies (rsync -X, tar --xattrs, cp -a)
        would try to set or remove them and fail."""
        await self._read_user_xattrs(ino)
        return [name.encode("utf-8", "surrogateescape") for name in self._inode(ino).xattrs]

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if name == UNMOUNT_FLUSH_XATTR and ino == ROOT_INO:
            self.flush_on_unmount = value.strip().lower() not in (b"0", b"false", b"no")
            return
        if name == PINNED_XATTR:
            flag = value.strip().lower()
            if flag not in (b"0", b"1"):
                raise FsError(errno.EINVAL)
            self.pin(ino, flag == b"1")
            return
        if name == POLICY_XATTR.encode():
            if value.decode(errors="replace").strip() not in POLICIES:
                raise FsError(errno.EINVAL)
            self.checkpoints.forget_policies()
        elif name.startswith(XATTR_PREFIX):
            raise FsError(errno.EPERM)  # read-only facts
        if not name.startswith(b"user."):
            raise FsError(errno.EOPNOTSUPP)
        inode = self._inode(ino)
        xattrs = dict(inode.xattrs)
        xattrs[_name(name)] = base64.b64encode(value).decode()
        if len(encode_xattrs(xattrs)) > MAX_XATTR_BYTES:
            raise FsError(errno.E2BIG)  # it must fit in the object's metadata
        self._set_xattrs(inode, xattrs)

    def removexattr(self, ino: int, name: bytes) -> None:
        if name == PINNED_XATTR:
            self.pin(ino, False)
            return
        inode = self._inode(ino)
        if _name(name) not in inode.xattrs:
            raise FsError(errno.ENODATA)
        xattrs = dict(inode.xattrs)
        del xattrs[_name(name)]
        if name == POLICY_XATTR.encode():
            self.checkpoints.forget_policies()
        self._set_xattrs(inode, xattrs)

    def _set_xattrs(self, inode: Inode, xattrs: dict[str, str]) -> None:
        self._changed(inode.ino)
        self.meta.update(inode.ino, xattrs=xattrs, pending=inode.pending | META,
                         ctime=self.clock(), attrs_known=True)
        self._schedule(inode.ino)

    def statfs(self) -> dict[str, int]:
        """The lake has no fixed size: report plenty of room, as S3 mounts do."""
        block = 4096
        total = 1 << 50
        return {"bsize": block, "frsize": block, "blocks": total // block,
                "bfree": total // block, "bavail": total // block,
                "files": 1 << 40, "ffree": 1 << 40, "namemax": 255}
