"""POSIX semantics over the lake: lookups, lookup counts, handles, reads.

No pyfuse3 here, so tests drive this class without a mount. Errors leave as
:class:`~aifs.errors.FsError` (an errno) or :class:`~aifs.errors.LakeError`;
``fuse_ops`` turns both into FUSE replies.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from aifs.cache.blocks import BlockCache, ObjectVersion
from aifs.config import Config
from aifs.errors import FsError
from aifs.lake.base import ObjectStore
from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore, valid_name
from aifs.read.fetcher import BlockFetcher
from aifs.read.readahead import Readahead

log = logging.getLogger(__name__)

RESERVED_PREFIX = ".aifs"
READDIR_BATCH = 1000
XATTR_PREFIX = b"user.aifs."


@dataclass
class OpenFile:
    inode: Inode
    version: ObjectVersion
    readahead: Readahead


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


class Filesystem:
    def __init__(self, config: Config, store: ObjectStore, meta: MetaStore,
                 cache: BlockCache, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.meta = meta
        self.cache = cache
        self.clock = clock
        self.block_size = config.block_size
        self.fetcher = BlockFetcher(store, cache, config.block_size, config.memory_cache,
                                    max_prefetch=max(4, config.max_connections))
        self.lookups: dict[int, int] = {}
        self.files: dict[int, OpenFile] = {}
        self.dirs: dict[int, int] = {}
        self._handles = itertools.count(1)
        self._listing: dict[int, trio.Event] = {}
        self._kernel_etag: dict[int, str] = {}
        self._opens: dict[int, int] = {}
        self._warned: set[str] = set()
        self.uid = os.getuid()
        self.gid = os.getgid()

    def start(self, nursery: trio.Nursery) -> None:
        self.fetcher.start(nursery)

    # -- attributes -------------------------------------------------------
    def attributes(self, inode: Inode) -> Attributes:
        if inode.is_dir:
            mode = stat.S_IFDIR | (inode.mode or 0o755)
        else:
            mode = stat.S_IFREG | (inode.mode or 0o644)
        return Attributes(inode.ino, mode, 2 if inode.is_dir else 1,
                          self.uid if inode.uid < 0 else inode.uid,
                          self.gid if inode.gid < 0 else inode.gid,
                          inode.size, int(inode.mtime * 1e9))

    def _inode(self, ino: int) -> Inode:
        inode = self.meta.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT)
        return inode

    # -- directory listings -------------------------------------------------
    def _fresh(self, directory: Inode) -> bool:
        return self.clock() - directory.listed_at < self.config.metadata_ttl

    async def _ensure_listed(self, directory: Inode) -> Inode:
        """Refresh ``directory`` from LIST if its listing is older than the TTL."""
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
        return directory

    async def _list(self, directory: Inode) -> None:
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
        # A file listed before the directory of the same name loses too.
        removed = await trio.to_thread.run_sync(
            self.meta.apply_listing, directory.ino, list(entries.values()), started)
        for ino in removed:
            if not self.lookups.get(ino):
                self.meta.delete_orphan(ino)
        log.debug("listed %r: %d entries, %d removed", prefix, len(entries), len(removed))

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
            inode = self.meta.get(ino)
            if inode is not None and inode.orphan and not self._is_open(ino):
                self.meta.delete_orphan(ino)

    def _is_open(self, ino: int) -> bool:
        return self._opens.get(ino, 0) > 0

    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        """The child, with one more kernel reference; None if there is none."""
        directory = self._inode(parent)
        if not directory.is_dir:
            raise FsError(errno.ENOTDIR)
        if name == b".":
            child: Inode | None = directory
        elif name == b"..":
            child = self._inode(directory.parent)
        else:
            if len(name) > 255:
                raise FsError(errno.ENAMETOOLONG)
            await self._ensure_listed(directory)
            child = self.meta.lookup(parent, name)
        if child is not None:
            self.remember(child.ino)
        return child

    async def getattr(self, ino: int) -> Inode:
        inode = self._inode(ino)
        if not inode.is_dir and not inode.orphan:
            parent = self.meta.get(inode.parent)
            if parent is not None and not self._fresh(parent):
                await self._ensure_listed(parent)
                inode = self._inode(ino)
        return inode

    # -- directories ----------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        directory = self._inode(ino)
        if not directory.is_dir:
            raise FsError(errno.ENOTDIR)
        await self._ensure_listed(directory)
        fh = next(self._handles)
        self.dirs[fh] = ino
        return fh

    def readdir(self, fh: int, after_cookie: int) -> list[tuple[int, bytes, Inode]]:
        """The next batch of (cookie, name, inode) after ``after_cookie``."""
        ino = self.dirs.get(fh)
        if ino is None:
            raise FsError(errno.EBADF)
        return self.meta.readdir(ino, after_cookie, READDIR_BATCH)

    def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)

    # -- files ----------------------------------------------------------------
    def open(self, ino: int, flags: int) -> tuple[int, bool]:
        """Open for reading; return the handle and whether the kernel may keep
        the pages it cached for this inode (only if the object is unchanged)."""
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise FsError(errno.EROFS)
        inode = self._inode(ino)
        if inode.is_dir:
            raise FsError(errno.EISDIR)
        version = ObjectVersion(inode.key, inode.etag, inode.size)
        keep_cache = self._kernel_etag.get(ino) == inode.etag
        self._kernel_etag[ino] = inode.etag
        fh = next(self._handles)
        self._opens[ino] = self._opens.get(ino, 0) + 1
        self.files[fh] = OpenFile(inode, version,
                                  Readahead(self.block_size, self.config.readahead_max))
        return fh, keep_cache

    def _file(self, fh: int) -> OpenFile:
        handle = self.files.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        return handle

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        handle = self._file(fh)
        version = handle.version
        end = min(offset + size, version.size)
        if offset >= end:
            return b""
        bs = self.block_size
        first, last = offset // bs, (end - 1) // bs
        ahead = handle.readahead.observe(offset, end - offset)
        if ahead:
            self.fetcher.prefetch(version, last, (end - 1 + ahead) // bs)
        if first == last:  # the common case: a view, no copy
            return await self.fetcher.read(version, first, offset - first * bs,
                                           end - first * bs)
        pieces = []
        for index in range(first, last + 1):
            lo = max(offset, index * bs) - index * bs
            hi = min(end, (index + 1) * bs) - index * bs
            pieces.append(await self.fetcher.read(version, index, lo, hi))
        return b"".join(pieces)

    def release(self, fh: int) -> None:
        handle = self.files.pop(fh, None)
        if handle is None:
            return
        ino = handle.inode.ino
        left = self._opens.get(ino, 0) - 1
        if left > 0:
            self._opens[ino] = left
            return
        self._opens.pop(ino, None)
        inode = self.meta.get(ino)
        if inode is not None and inode.orphan and not self.lookups.get(ino):
            self.meta.delete_orphan(ino)

    # -- extended attributes ----------------------------------------------------
    def xattrs(self, ino: int) -> dict[bytes, bytes]:
        """Read-only facts about an inode, as ``user.aifs.*`` attributes."""
        inode = self._inode(ino)
        facts: dict[bytes, bytes] = {b"user.aifs.key": inode.key.encode("utf-8",
                                                                         "surrogateescape")}
        if not inode.is_dir:
            version = ObjectVersion(inode.key, inode.etag, inode.size)
            facts[b"user.aifs.etag"] = inode.etag.encode()
            facts[b"user.aifs.cached_bytes"] = str(self.cache.cached_bytes(version)).encode()
        if ino == ROOT_INO:
            facts[b"user.aifs.lake"] = self.config.resolved_lake().encode()
            facts[b"user.aifs.pid"] = str(os.getpid()).encode()
            facts[b"user.aifs.stats"] = json.dumps(self.stats()).encode()
        return facts

    def stats(self) -> dict[str, int]:
        """Live counters (also the seed of ``aifs status``)."""
        fetched = self.fetcher.stats
        return {"lake_gets": fetched.lake_gets, "lake_bytes": fetched.lake_bytes,
                "memory_hits": fetched.memory_hits, "disk_hits": fetched.disk_hits,
                "fetch_errors": fetched.errors, "cache_bytes": self.cache.used,
                "cache_capacity": self.cache.capacity, "evictions": self.cache.evictions,
                "open_files": len(self.files)}

    def getxattr(self, ino: int, name: bytes) -> bytes:
        value = self.xattrs(ino).get(name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    def statfs(self) -> dict[str, int]:
        """The lake has no fixed size: report plenty of room, as S3 mounts do."""
        block = 4096
        total = 1 << 50
        return {"bsize": block, "frsize": block, "blocks": total // block,
                "bfree": total // block, "bavail": total // block,
                "files": 1 << 40, "ffree": 1 << 40, "namemax": 255}
