"""Reads: where the bytes of a read come from.

A file with a whole local copy (written here, or materialized) is read from
it, with the kernel asked to read ahead when reads are sequential. Otherwise
the bytes come from cached blocks of its lake version, fetched as needed with
adaptive read-ahead; a packed file's bytes are read and verified whole once
per handle, from its range of the pack, or from the pack's blocks when the
whole pack is wanted (dataset policy, or a scan of its files).
"""

from __future__ import annotations

import errno
import logging

from aifs.cache.blocks import ObjectVersion
from aifs.cache.segments import SMALL
from aifs.checkpoint import Checkpoints
from aifs.config import Config
from aifs.errors import FsError
from aifs.flush.promoter import Promoter
from aifs.meta.store import Inode
from aifs.pack.index import pack_key
from aifs.policy import DATASET
from aifs.posix.inodes import Inodes, OpenFile
from aifs.read.fetcher import BlockFetcher, read_ahead, read_at, verify

log = logging.getLogger(__name__)

SCAN_OPENS = 3  # files of one pack opened within SCAN_WINDOW seconds: a scan
SCAN_WINDOW = 10.0


class Reads:
    def __init__(self, inodes: Inodes, config: Config, fetcher: BlockFetcher,
                 promoter: Promoter, checkpoints: Checkpoints) -> None:
        self.inodes = inodes
        self.promoter = promoter
        self.local = inodes.local
        self.fetcher = fetcher
        self.packs = promoter.packer.index
        self.checkpoints = checkpoints
        self.block_size = config.block_size
        self._pack_opens: dict[str, tuple[int, float]] = {}  # pack -> (opens, first)

    def version(self, inode: Inode) -> ObjectVersion:
        """The lake version an inode's cached blocks belong to (for a packed
        file: its range of the pack, named by place, checked by checksum)."""
        policy, pinned = self.checkpoints.policy_of(inode), self.checkpoints.is_pinned(inode)
        if inode.packed:
            source = pack_key(inode.pack)
            return ObjectVersion(f"{source}@{inode.pack_offset}", inode.checksum, inode.size,
                                 policy, pinned, source=source, base=inode.pack_offset)
        return ObjectVersion(inode.key, inode.etag, inode.size, policy, pinned)

    def pack_version(self, version: ObjectVersion) -> ObjectVersion | None:
        """The whole pack a packed file's bytes are in (None: its size is unknown)."""
        size = self.packs.pack_size(version.source[len(pack_key("")):])
        if size is None:
            return None
        return ObjectVersion(version.source, "", size, version.policy, version.pinned)

    def cached_whole(self, version: ObjectVersion) -> bool:
        """Whether every byte of ``version`` is in the block cache, or on its
        way there (reading it whole asks the lake nothing)."""
        if version.size == 0:
            return False
        bs = self.block_size
        if version.source:
            whole = self.pack_version(version)
            if whole is None:
                return False
            first, last = version.base // bs, (version.base + version.size - 1) // bs
            return all(self.fetcher.cached(whole, i) for i in range(first, last + 1))
        return all(self.fetcher.cached(version, i) for i in range((version.size - 1) // bs + 1))

    def fetch_small(self, handle: OpenFile) -> None:
        """Start fetching a small lake object as it is opened for reading: its
        first READ comes a request or two later (Python's ``open`` asks
        ``isatty`` in between) and finds the GET under way."""
        version = handle.version
        if version.source or not 0 < version.size <= SMALL or self.local.has(handle.ino):
            return
        self.fetcher.fetch_for_open(version, 0)

    async def whole(self, handle: OpenFile) -> bytes:
        """All the bytes of the version ``handle`` reads (not counted as a read)."""
        return bytes(await self._read(handle, 0, handle.version.size))

    async def cached(self, version: ObjectVersion) -> bytes | None:
        """All the bytes of ``version`` from the block cache (a packed file's
        verified), or None if it does not hold them all: no lake request, no
        read counted, no open of its pack seen (scan detection) or prefetched."""
        if not self.cached_whole(version):
            return None
        if not version.source:
            return await self._span(version, 0, version.size)
        whole = self.pack_version(version)
        if whole is None:
            return None
        data = await self._span(whole, version.base, version.size)
        verify(data, version.etag, version.key)
        return data

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        handle = self.inodes.files.get(fh)
        if handle is None:
            raise FsError(errno.EBADF)
        data = await self._read(handle, offset, size)
        counters = self.inodes.counters
        counters.read_requests += 1
        counters.read_bytes += len(data)
        return data

    async def _read(self, handle: OpenFile, offset: int, size: int) -> bytes | memoryview:
        if offset < self.promoter.streams.spilled.get(handle.ino, 0):
            await self._spilled(handle.ino)
        if self.local.has(handle.ino):
            self.inodes.counters.local_reads += 1
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
            data = await read_at(fd, offset, size, self.inodes.disk)
            if offset < self.promoter.streams.spilled.get(handle.ino, 0):
                # its parts left the copy while it was read: the holes it read are no data
                await self._spilled(handle.ino)
                return await self._read(handle, offset, size)
            return data
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

    async def _spilled(self, ino: int) -> None:
        """A read of bytes that left the file's copy for its streamed upload
        (flush.stream, spilling): once the file is closed, it waits for the
        upload to complete and reads the lake's object; while a writer still
        holds it, those bytes are nowhere to read (EIO, said in the log)."""
        promoter = self.promoter
        if promoter.streams.state(ino) == "wait":
            await promoter.sync(lambda inode: inode.ino == ino, None)
            return
        log.error("a read of inode %d asked for bytes that are only in its upload until "
                  "its writer closes it (the cache disk was short): EIO", ino)
        raise FsError(errno.EIO)

    async def _packed_bytes(self, version: ObjectVersion) -> bytes:
        """A packed file's bytes, verified. A range GET of them alone, unless
        the whole pack is wanted (dataset policy, or several of its files
        opened in a row: a directory scan) or already cached: then they come
        from the pack's blocks, which the next files of the pack hit."""
        if version.size == 0:
            return b""
        whole = self.pack_version(version)
        bs = self.block_size
        first, last = version.base // bs, (version.base + version.size - 1) // bs
        if whole is not None:
            scanning = self._scanning(version.source)
            if version.policy == DATASET or scanning:
                self.fetcher.prefetch(whole, 0, self.fetcher.blocks_of(whole) - 1)
            if scanning or version.policy == DATASET or all(
                    self.fetcher.available(whole, i) for i in range(first, last + 1)):
                data = await self._span(whole, version.base, version.size)
                verify(data, version.etag, version.key)
                return data
        return bytes(await self.fetcher.read(version, 0, 0, version.size))

    async def _span(self, source: ObjectVersion, start: int, size: int) -> bytes:
        """Bytes [start, start + size) of ``source``, from its blocks."""
        bs = self.block_size
        pieces = []
        for index in range(start // bs, (start + size - 1) // bs + 1):
            lo = max(start, index * bs) - index * bs
            hi = min(start + size, (index + 1) * bs) - index * bs
            pieces.append(bytes(await self.fetcher.read(source, index, lo, hi)))
        return b"".join(pieces)

    def _scanning(self, pack: str) -> bool:
        """Count an open of a file of ``pack``; True once several came in a row."""
        now = self.inodes.clock()
        count, since = self._pack_opens.get(pack, (0, now))
        if now - since > SCAN_WINDOW:
            count, since = 0, now
        self._pack_opens[pack] = (count + 1, since)
        if len(self._pack_opens) > 1024:
            self._pack_opens.pop(next(iter(self._pack_opens)))
        return count + 1 >= SCAN_OPENS
