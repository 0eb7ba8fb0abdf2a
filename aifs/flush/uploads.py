"""The upload of one inode: its bytes (one PUT, or a multipart upload whose
parts grow with the file) or only its attributes, the copies for its further
hard-link names, and the multipart uploads an earlier run or a lost node left
open in the lake.

An object appears under a file's key only by a complete PUT or a completed
multipart upload, so the lake never shows a partial file; an upload whose
file changed while it ran is abandoned before completion (multipart) and the
promoter uploads the newer version.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import trio

from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.errors import LakeError, ObjectNotFound
from aifs.flush.host import PromotionHost
from aifs.flush.pacing import Pacer
from aifs.flush.stats import PromoteStats
from aifs.flush.stream import Streams
from aifs.lake.base import ObjectInfo, ObjectStore
from aifs.meta.objattrs import to_metadata
from aifs.meta.store import DATA, LINK, MAYBE_IN_LAKE, SPECIAL, Inode, MetaStore
from aifs.pack.packer import Packer

log = logging.getLogger(__name__)

MiB = 1 << 20
MIN_PART = 5 * MiB
MAX_PART = 5 << 30
MAX_PARTS = 10_000
PARTS_PER_STEP = 1000  # the part size doubles every this many parts


def part_size(number: int, base: int) -> int:
    """Size of part ``number`` (1-based) of a multipart upload.

    Parts grow (doubling every 1000) so that an object of any size S3 allows
    (5 TiB) fits in 10,000 parts without knowing its size in advance.
    """
    return min(MAX_PART, max(base, MIN_PART) << ((number - 1) // PARTS_PER_STEP))


def plan_parts(size: int, base: int) -> list[tuple[int, int, int]]:
    """(part number, offset, length) covering ``size`` bytes."""
    parts, offset, number = [], 0, 1
    while offset < size or number == 1:
        length = min(part_size(number, base), size - offset)
        parts.append((number, offset, length))
        offset += length
        number += 1
        if number > MAX_PARTS and offset < size:
            raise LakeError(f"{size} bytes do not fit in {MAX_PARTS} parts")
    return parts


def _read_all(path: os.PathLike[str] | str) -> bytes:
    with open(path, "rb") as fp:
        return fp.read()


class Uploads:
    """Puts what one inode's promotion carries in the lake."""

    def __init__(self, host: PromotionHost, store: ObjectStore, meta: MetaStore,
                 files: LocalFiles, config: Config, uid: int, gid: int, stats: PromoteStats,
                 streams: Streams, packer: Packer, pacer: Pacer) -> None:
        self.host = host
        self.store = store
        self.meta = meta
        self.files = files
        self.config = config
        self.uid, self.gid = uid, gid
        self.stats = stats
        self.streams = streams
        self.packer = packer
        self.pacer = pacer
        self.sent: dict[int, int] = {}  # ino -> bytes of its upload the lake has
        self.streamed: set[int] = set()  # uploads just completed from a stream

    async def upload(self, inode: Inode, version: int) -> ObjectInfo | None:
        """Upload ``inode``'s content; None if it changed before anything landed."""
        metadata = to_metadata(inode, self.uid, self.gid)
        if inode.etag and inode.etag != MAYBE_IN_LAKE:
            await self.warn_if_replaced(inode)
        if inode.kind == LINK:
            data = inode.target.encode("utf-8", "surrogateescape")
            return await self.put(inode.key, data, metadata)
        if inode.kind in SPECIAL:  # s3fs's form: no content, the type in the mode
            return await self.put(inode.key, b"", metadata)
        path = self.files.path(inode.ino)
        size = await trio.to_thread.run_sync(os.path.getsize, path)
        if self.streams.active(inode.ino):
            info = await self.streams.finish(inode.ino, inode.key, size, version)
            if info is not None:
                self.streamed.add(inode.ino)
                self.stats.uploads += 1
                self.stats.upload_bytes += size
                return info
        if inode.ino in self.streams.spilled:
            # Its copy has holes where its bytes went to an upload that did
            # not complete: never published from the copy (flush.stream).
            why = self.streams.lost.get(inode.ino, "its upload ended unfinished")
            self.host.lost(inode.ino, why)
            return None
        if size < self.config.multipart_threshold:
            await self.pacer.take(size)
            data = await trio.to_thread.run_sync(_read_all, path)
            if self.host.change_count(inode.ino) != version:
                return None
            return await self.put(inode.key, data, metadata)
        return await self._multipart(inode, path, size, metadata, version)

    async def put(self, key: str, data: bytes, metadata: dict[str, str]) -> ObjectInfo:
        info = await self.store.put(key, data, metadata)
        self.stats.uploads += 1
        self.stats.upload_bytes += len(data)
        return info

    async def _multipart(self, inode: Inode, path: os.PathLike[str] | str, size: int,
                         metadata: dict[str, str], version: int) -> ObjectInfo | None:
        key = inode.key
        started = time.time()
        self.meta.record_upload(inode.ino, key, "", started)  # a crash may follow at once
        upload_id = await self.store.create_multipart(key, metadata)
        self.meta.record_upload(inode.ino, key, upload_id, started)
        etags: list[tuple[int, str]] = []
        in_flight = trio.Semaphore(max(1, self.config.parts_in_flight))
        completed = False
        try:
            with open(path, "rb") as fp:
                async with trio.open_nursery() as nursery:
                    for number, offset, length in plan_parts(size, self.config.part_size):
                        await in_flight.acquire()
                        if self.host.change_count(inode.ino) != version or self._moved(inode):
                            break  # changed: stop reading, abandon this upload
                        nursery.start_soon(self._send_part, inode.ino, key, upload_id,
                                           fp.fileno(),
                                           number, offset, length, etags, in_flight)
            if self.host.change_count(inode.ino) != version or self._moved(inode):
                return None
            info = await self.store.complete_multipart(key, upload_id, etags)
            completed = True
            self.stats.uploads += 1
            self.stats.upload_bytes += size
            return info
        finally:
            if not completed:
                with trio.CancelScope(shield=True):
                    try:
                        await self.store.abort_multipart(key, upload_id)
                    except LakeError as exc:
                        log.warning("abort of upload %s of %s failed: %s", upload_id, key, exc)
                        return None  # kept in the record: aborted at the next start
            self.meta.record_upload(inode.ino, key, None)

    def _moved(self, inode: Inode) -> bool:
        """Renamed or deleted since its upload began: what it would land
        under the old key is no one's (and a rename onto that key waits for it)."""
        current = self.meta.get(inode.ino)
        return current is None or current.orphan or current.key != inode.key

    async def _send_part(self, ino: int, key: str, upload_id: str, fd: int, number: int,
                         offset: int,
                         length: int, etags: list[tuple[int, str]],
                         in_flight: trio.Semaphore) -> None:
        try:
            await self.pacer.take(length)
            data = await trio.to_thread.run_sync(os.pread, fd, length, offset)
            if len(data) != length:
                raise LakeError(f"{key}: local copy shrank during upload")
            etags.append((number, await self.store.upload_part(key, upload_id, number, data,
                                                               offset)))
            self.sent[ino] = self.sent.get(ino, 0) + length
        finally:
            in_flight.release()

    async def copy_to_links(self, inode: Inode) -> dict[str, str]:
        """Each further name of a hard-linked file is an object of its own:
        a server-side copy of the primary, with the same metadata; their
        ETags by key."""
        metadata = to_metadata(inode, self.uid, self.gid)
        return {key: await self.store.copy(inode.key, key, metadata)
                for key in inode.keys()[1:]}

    async def write_metadata(self, inode: Inode) -> ObjectInfo | None:
        """Give ``inode``'s object its new attributes (its bytes stay); None if
        the object is gone and the local copy is to be uploaded instead."""
        metadata = to_metadata(inode, self.uid, self.gid)
        self.stats.metadata_updates += 1
        if inode.packed:
            entry = self.packer.index.entry(inode.key)
            if entry is not None and not entry.origin:  # a new record, the same bytes
                changed = dataclasses.replace(
                    entry, stamp=time.time_ns(), mode=int(metadata["mode"]),
                    uid=int(metadata["uid"]),
                    gid=int(metadata["gid"]), mtime_ns=inode.mtime_ns,
                    atime_ns=inode.atime_ns, xattrs=inode.xattrs or None)
                self.packer.queue_records([changed.record()])
                return ObjectInfo(inode.key, inode.size, changed.etag, 0.0)
            # A packed copy (aifs pack) of a plain object: the object takes the change.
        if inode.is_dir:
            if not inode.key:
                return ObjectInfo("", 0, "", 0.0)  # the root has no marker
            return await self.store.put(inode.key, b"", metadata)
        try:
            etag = await self.store.copy(inode.key, inode.key, metadata)
            return ObjectInfo(inode.key, inode.size, etag, 0.0, metadata)
        except ObjectNotFound:
            if self.files.has(inode.ino):  # gone from the lake: upload our copy
                self.meta.update(inode.ino, pending=inode.pending | DATA)
                return None
            raise

    async def warn_if_replaced(self, inode: Inode) -> None:
        expected: str | None = inode.etag
        if inode.packed:  # no object of its own, unless aifs pack copied one
            entry = self.packer.index.entry(inode.key)
            expected = entry.origin if entry is not None and entry.origin else None
        try:
            current = await self.store.head(inode.key)
        except ObjectNotFound:
            return
        if current.etag != expected and not self.meta.tombstoned(inode.key):
            # (tombstoned: the lake still holds this node's own old object,
            # its delete on the way, as when a file shrank into a pack)
            log.warning("%s changed in the lake since this node read it; this node's "
                        "version replaces it", inode.key)

    # -- uploads left open ---------------------------------------------------------
    async def abort_stale(self) -> int:
        """Abort the unfinished multipart uploads in the lake that this cache
        does not own and that started ``stale_upload_age`` seconds ago or more
        (an upload whose creation reply was lost, one a lost node left);
        return how many. They would cost storage for ever on a real cloud."""
        ours = {upload_id for _, _, upload_id, _ in self.meta.uploads_in_progress()}
        now = time.time()
        aborted = 0
        for key, upload_id, started in await self.store.list_uploads(""):
            if upload_id in ours or now - started < self.config.stale_upload_age:
                continue
            await self.store.abort_multipart(key, upload_id)
            log.info("aborted a stale multipart upload of %s (started %.0f s ago)",
                     key, now - started)
            aborted += 1
        return aborted

    async def abort_leftovers(self) -> None:
        """Abort the multipart uploads an earlier run left unfinished, those it
        did not live to record too.

        An upload whose id was not recorded is found by its key alone: the lake's
        initiation times cannot be trusted to tell it apart (moto reports one fixed
        date). Another writer's upload of the same key may be aborted with it; that
        writer's upload fails and is retried, so no data is lost.
        """
        for ino, key, upload_id, _started in self.meta.uploads_in_progress():
            try:
                if upload_id:
                    ids = [upload_id]
                else:
                    ids = [found for found, _ in await self.store.list_multipart(key)]
                for one in ids:
                    await self.store.abort_multipart(key, one)
                    log.info("aborted multipart upload of %s left by an earlier run", key)
            except LakeError as exc:
                log.warning("cannot abort an upload of %s: %s", key, exc)
                continue
            self.meta.record_upload(ino, key, None)
