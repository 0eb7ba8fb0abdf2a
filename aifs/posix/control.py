"""Extended attributes: the ones users set, and the control plane.

User xattrs are kept with the file and reach the lake in its object's
metadata. The ``user.aifs.*`` names (their table: :mod:`aifs.xattrs`) are
facts computed when read, and commands run by reading them (sync, warmup,
pack, gc) or setting them (pinned, policy, unmount_flush). Also here: the
counters behind ``aifs status`` and statfs.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import functools
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import trio

from aifs import xattrs
from aifs.cache.blocks import BlockCache
from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.errors import FsError, LakeError
from aifs.flush.promoter import Promoter
from aifs.meta.objattrs import MAX_XATTR_BYTES, encode_xattrs
from aifs.meta.store import DIR, LINK, MAYBE_IN_LAKE, META, ROOT_INO, Inode, MetaStore
from aifs.pack.compaction import Compactor, Upkeep
from aifs.policy import POLICIES
from aifs.posix.hosting import Hosting
from aifs.posix.inodes import Inodes, name_of
from aifs.posix.listing import RESERVED_PREFIX, Listings
from aifs.posix.reads import Reads
from aifs.read.attrs import ObjectAttributes
from aifs.read.fetcher import BlockFetcher
from aifs.read.scan import DirectoryPrefetch

log = logging.getLogger(__name__)

ACTION_RESULT_KEPT = 5.0  # seconds an action xattr's result waits for the second read
# the names as the kernel sends them
PREFIX, SYNC, PACK = xattrs.PREFIX.encode(), xattrs.SYNC.encode(), xattrs.PACK.encode()
WARMUP, GC, PINNED = xattrs.WARMUP.encode(), xattrs.GC.encode(), xattrs.PINNED.encode()
POLICY, UNMOUNT_FLUSH = xattrs.POLICY.encode(), xattrs.UNMOUNT_FLUSH.encode()


class Control:
    def __init__(self, inodes: Inodes, config: Config, meta: MetaStore, cache: BlockCache,
                 fetcher: BlockFetcher, reads: Reads, listings: Listings, hosting: Hosting,
                 promoter: Promoter, compactor: Compactor, checkpoints: Checkpoints,
                 object_attrs: ObjectAttributes, dir_prefetch: DirectoryPrefetch,
                 metrics: Callable[[], dict[str, Any]]) -> None:
        self.inodes = inodes
        self.config = config
        self.meta = meta
        self.cache = cache
        self.local = inodes.local
        self.fetcher = fetcher
        self.reads = reads
        self.listings = listings
        self.hosting = hosting
        self.promoter = promoter
        self.packer = promoter.packer
        self.compactor = compactor
        self.checkpoints = checkpoints
        self.object_attrs = object_attrs
        self.dir_prefetch = dir_prefetch
        self.metrics = metrics
        self._action_results: dict[tuple[int, bytes], tuple[float, bytes]] = {}

    # -- reading ------------------------------------------------------------------
    def xattrs(self, ino: int) -> dict[bytes, Callable[[], bytes]]:
        """User xattrs, then read-only facts about an inode as ``user.aifs.*``;
        each value is computed only when asked for (some walk the whole queue)."""
        inode = self.inodes.get(ino)
        out: dict[bytes, Callable[[], bytes]] = {
            name.encode("utf-8", "surrogateescape"): functools.partial(base64.b64decode, value)
            for name, value in inode.xattrs.items()}
        out[xattrs.KEY.encode()] = lambda: inode.key.encode("utf-8", "surrogateescape")
        if not inode.is_dir:
            out[xattrs.ETAG.encode()] = inode.etag.encode
            if inode.packed:
                out[PACK] = f"{inode.pack}@{inode.pack_offset}".encode
            out[xattrs.CACHED_BYTES.encode()] = lambda: str(self.cached_bytes(inode)).encode()
        out[xattrs.STATE.encode()] = lambda: self.checkpoints.state(
            inode, self.promoter.progress, self.inodes.with_written).encode()
        out[POLICY] = lambda: self.checkpoints.policy_of(inode).encode()
        out[PINNED] = lambda: b"1" if self.checkpoints.is_pinned(inode) else b"0"
        if ino == ROOT_INO:
            out[xattrs.LAKE.encode()] = self.config.resolved_lake().encode
            out[xattrs.PID.encode()] = str(os.getpid()).encode
            out[xattrs.STATS.encode()] = lambda: json.dumps(self.stats()).encode()
            out[xattrs.PENDING.encode()] = lambda: json.dumps(self.promoter.summary()).encode()
            out[xattrs.METRICS.encode()] = lambda: json.dumps(self.metrics()).encode()
            out[xattrs.PACK_PROGRESS.encode()] = lambda: json.dumps(
                dataclasses.asdict(self.compactor.progress)).encode()
        return out

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if not name.startswith(b"user."):
            raise FsError(errno.ENODATA)  # the kernel asks security.capability per write
        if name == SYNC:
            await self.hosting.sync(ino)
            return b"synced"
        if name in (WARMUP, GC) or (name == PACK and self.inodes.get(ino).is_dir):
            return await self._action(ino, name)
        if not name.startswith(PREFIX):
            await self._read_user_xattrs(ino)
        value = self.xattrs(ino).get(name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value()

    async def listxattr(self, ino: int) -> list[bytes]:
        """The xattrs users set. The ``user.aifs.*`` facts and commands are
        read by name only: listed, copies (rsync -X, tar --xattrs, cp -a)
        would try to set or remove them and fail."""
        await self._read_user_xattrs(ino)
        return [name.encode("utf-8", "surrogateescape") for name in self.inodes.get(ino).xattrs]

    async def _read_user_xattrs(self, ino: int) -> None:
        """Read the metadata of an object no listing described (another tool
        wrote it, ``object_attrs`` off) when its xattrs are asked for: one
        HEAD then, none for a walk or ``ls -l``."""
        inode = self.inodes.get(ino)
        if inode.kind != DIR and not inode.packed and inode.in_lake:
            await self.object_attrs.load(inode, may_change_kind=False, asked=True)

    async def _action(self, ino: int, name: bytes) -> bytes:
        """Run the command an xattr stands for (warmup, pack, gc); its result
        (JSON) is kept for the client's second call. Clients read an xattr
        twice: once to learn its size (getfattr) or with a 128-byte buffer
        that is too small (Python), then with a buffer that fits."""
        remembered = self._action_results.pop((ino, name), None)
        if remembered is not None and self.inodes.clock() - remembered[0] < ACTION_RESULT_KEPT:
            return remembered[1]
        if name == WARMUP:
            result: dict[str, object] = dict(await self.warm(ino))
        elif name == GC:
            upkeep = await self.compactor.gc()
            upkeep.uploads_aborted = await self.promoter.abort_stale_uploads()
            result = dataclasses.asdict(upkeep)
        else:
            result = dataclasses.asdict(await self.pack_tree(ino))
        value = json.dumps(result).encode().ljust(129)  # never fits a 128-byte probe
        self._action_results[(ino, name)] = (self.inodes.clock(), value)
        return value

    # -- setting ------------------------------------------------------------------
    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if name == UNMOUNT_FLUSH and ino == ROOT_INO:
            self.hosting.flush_on_unmount = value.strip().lower() not in (b"0", b"false", b"no")
            return
        if name == PINNED:
            flag = value.strip().lower()
            if flag not in (b"0", b"1"):
                raise FsError(errno.EINVAL)
            self.pin(ino, flag == b"1")
            return
        if name == POLICY:
            if value.decode(errors="replace").strip() not in POLICIES:
                raise FsError(errno.EINVAL)
            self.checkpoints.forget_policies()
        elif name.startswith(PREFIX):
            raise FsError(errno.EPERM)  # read-only facts
        if not name.startswith(b"user."):
            raise FsError(errno.EOPNOTSUPP)
        inode = self.inodes.get(ino)
        values = dict(inode.xattrs)
        values[name_of(name)] = base64.b64encode(value).decode()
        if len(encode_xattrs(values)) > MAX_XATTR_BYTES:
            raise FsError(errno.E2BIG)  # it must fit in the object's metadata
        self._set_xattrs(inode, values)

    def removexattr(self, ino: int, name: bytes) -> None:
        if name == PINNED:
            self.pin(ino, False)
            return
        inode = self.inodes.get(ino)
        if name_of(name) not in inode.xattrs:
            raise FsError(errno.ENODATA)
        values = dict(inode.xattrs)
        del values[name_of(name)]
        if name == POLICY:
            self.checkpoints.forget_policies()
        self._set_xattrs(inode, values)

    def _set_xattrs(self, inode: Inode, values: dict[str, str]) -> None:
        self.inodes.changed(inode.ino)
        self.meta.update(inode.ino, xattrs=values, pending=inode.pending | META,
                         ctime=self.inodes.clock(), attrs_known=True)
        self.inodes.schedule(inode.ino)

    # -- warmup, packing and pins -------------------------------------------------
    async def warm(self, ino: int, files_at_once: int = 32) -> dict[str, int]:
        """Fetch a file's blocks, or every file's below a directory, into the
        cache disk (``aifs warmup``); return the files, the bytes fetched and
        cached, and how many blocks the cache refused. A tree is walked from
        the listings, without a lookup (nor a HEAD) per file."""
        totals = {"files": 0, "fetched": 0, "cached": 0, "refused": 0, "errors": 0}
        inode = self.inodes.get(ino)
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
                directory = await self.listings.ensure_listed(stack.pop())
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
        version = self.reads.version(inode)
        if version.source:  # packed: the whole pack, which its neighbours share
            version = self.reads.pack_version(version) or version
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
        directory = self.inodes.directory(ino)
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
                self.cache.reclass(self.reads.version(inode))

    # -- counters -----------------------------------------------------------------
    def cached_bytes(self, inode: Inode) -> int:
        cached = self.cache.cached_bytes(self.reads.version(inode))
        return max(cached, inode.size) if self.local.has(inode.ino) else cached

    def stats(self) -> dict[str, int]:
        """Live counters (also the seed of ``aifs status``)."""
        fetched = self.fetcher.stats
        promoted = self.promoter.stats
        packed = self.packer.stats
        counters = self.inodes.counters
        return {"lake_gets": fetched.lake_gets, "lake_bytes": fetched.lake_bytes,
                "memory_hits": fetched.memory_hits, "disk_hits": fetched.disk_hits,
                "fetch_errors": fetched.errors, "cache_bytes": self.cache.used,
                "local_bytes": self.local.used, "cache_capacity": self.cache.capacity,
                "evictions": self.cache.evictions + self.local.evictions,
                "open_files": len(self.inodes.files),
                "write_requests": counters.write_requests,
                "write_bytes": counters.write_bytes, "read_requests": counters.read_requests,
                "read_bytes": counters.read_bytes, "local_reads": counters.local_reads,
                "direct_opens": counters.direct_opens, "admitted": counters.admitted,
                "uploads": promoted.uploads,
                "upload_bytes": promoted.upload_bytes, "deletes": promoted.deletes,
                "metadata_updates": promoted.metadata_updates,
                "promote_failures": promoted.failures,
                "packs": packed.packs, "packed_files": packed.packed_files,
                "journals": packed.journals, "journals_read": packed.journals_read,
                "shards_read": packed.shards_read,
                "dir_prefetch_scans": self.dir_prefetch.scans,
                "dir_prefetch_objects": self.dir_prefetch.fetched}

    def statfs(self) -> dict[str, int]:
        """The lake has no fixed size: report plenty of room, as S3 mounts do."""
        block = 4096
        total = 1 << 50
        return {"bsize": block, "frsize": block, "blocks": total // block,
                "bfree": total // block, "bavail": total // block,
                "files": 1 << 40, "ffree": 1 << 40, "namemax": 255}
