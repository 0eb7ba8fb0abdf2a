"""Small-file packing: many small files reach the lake as a few pack objects.

Promotion hands the packer every closed small file (below ``pack_threshold``,
dataset and default policies). The packer gathers them for ``pack_wait``
seconds or until ``pack_size`` bytes, then puts one pack object (the files'
bytes back to back) and one journal object that says where each file is
(:mod:`aifs.pack.index`). Only after the journal is in the lake are the
files settled; a crash before that leaves them pending, and the next mount
packs them again (the pack left behind is collected). Local changes that
carry no data (unlink, rename, chmod of a packed file) are queued in LMDB and
published in the next journal.

Other nodes replay the journals (:mod:`aifs.pack.journals`) at most once per
``metadata_ttl``, the same freshness as directory listings.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Protocol

import trio

from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.errors import Failure, lake_error_in
from aifs.lake.base import ObjectStore
from aifs.lake.retry import PROMOTION_BACKOFF
from aifs.meta.objattrs import st_mode
from aifs.meta.store import DATA, Inode, MetaStore
from aifs.pack.index import (
    FORMAT_VERSION,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    PackedEntry,
    PackIndex,
    Record,
    checksum,
    deletion,
    pack_key,
)
from aifs.pack.journals import Journals, PackStats

log = logging.getLogger(__name__)

MAX_WAITS = 10  # a pack being filled goes after at most this many pack_wait
#: records of plain objects (attributes for other nodes) wait this many
#: pack_wait for a pack to ride along with, before a journal of their own
RECORDS_WAITS = 5
HANDOVER_TICK = 0.02  # seconds: how often a pack asked for looks whether files still come
HANDOVER_LIMIT = 2.0  # seconds: ... and goes without them once none came for this long


class Owner(Protocol):
    """What the packer asks of the promoter."""

    def change_count(self, ino: int) -> int: ...
    def handing_over(self) -> bool: ...
    def packed(self, ino: int, key: str, version: int, entry: PackedEntry) -> None: ...
    async def paced(self, size: int) -> None: ...  # before reading local copies
    def published(self) -> None: ...  # a publication ended (a sync waiting looks again)


def new_name(node: str, counter: int) -> str:
    """A pack or journal name: sorts by creation time, unique per node."""
    return f"{time.time_ns():020d}-{node}-{counter}"


class Packer:
    def __init__(self, owner: Owner, store: ObjectStore, meta: MetaStore, files: LocalFiles,
                 config: Config, uid: int, gid: int) -> None:
        self.owner = owner
        self.store = store
        self.meta = meta
        self.files = files
        self.config = config
        self.uid, self.gid = uid, gid
        self.index = PackIndex(meta)
        self.node = meta.node_id()
        self.stats = PackStats()
        self.journals = Journals(store, self.index, config.metadata_ttl, self.stats)
        self._queue: dict[int, int] = {}  # ino -> change count when handed over
        self._inflight: set[int] = set()  # ... and those in a pack being published
        self._queued_bytes = 0
        self._oldest: float | None = None  # when the oldest file waiting came
        self._newest: float | None = None  # ... and the newest
        self._forced = False
        self._forced_at = 0.0  # when a pack was asked for
        self._records_due: float | None = None  # when lazily queued records go at the latest
        self._claimed = 0  # outbox records up to this one are in a journal on its way
        self._counter = 0
        self._wake = trio.Event()
        self._uploads = trio.Semaphore(2)
        self.failure: tuple[int, str, float] = (0, "", 0.0)  # count, why (a Failure), when

    @property
    def threshold(self) -> int:
        return min(self.config.pack_threshold, self.config.block_size)

    # -- what to pack ----------------------------------------------------------
    def submit(self, inode: Inode, version: int, force: bool) -> None:
        """Pack this closed small file with the next pack (a file already in a
        pack on its way is settled, or handed over again, when that lands)."""
        if inode.ino in self._inflight:
            return
        if inode.ino not in self._queue:
            self._queued_bytes += inode.size
        self._queue[inode.ino] = version
        now = trio.current_time()
        idle = self._oldest is None
        if idle:
            self._oldest = now
        self._newest = now
        if force:
            self._force(now)
        if idle or self._must_go_now():
            self._wake.set()  # else the pack's time only moved later: no hurry to look

    def _must_go_now(self) -> bool:
        """A pack goes without waiting: asked for (sync), or full."""
        return self._forced or self._queued_bytes >= self.config.pack_size

    def queued(self, ino: int) -> bool:
        return ino in self._queue or ino in self._inflight

    def publish_soon(self) -> None:
        """Changes without data are queued: publish them with the next journal."""
        now = trio.current_time()
        if self._oldest is None:
            self._oldest = now
        self._newest = now
        self._wake.set()

    def hurry(self) -> None:
        self._force(trio.current_time())
        self._wake.set()

    def _force(self, now: float) -> None:
        if not self._forced:
            self._forced, self._forced_at = True, now

    def _waits_for_handover(self, now: float) -> bool:
        """A pack asked for (not full) waits, briefly, for the files the
        promoter is still handing over: `aifs sync` right after many closes
        then makes one pack, not one per handful of files."""
        last = max(self._forced_at, self._newest or 0.0)
        return (self._forced and self._queued_bytes < self.config.pack_size
                and now - last < HANDOVER_LIMIT and self.owner.handing_over())

    def waiting(self) -> bool:
        """Whether anything is waiting to reach a journal."""
        return bool(self._queue) or self.index.outbox_size() > 0

    def _next_name(self) -> str:
        self._counter += 1
        return new_name(self.node, self._counter)

    def new_pack_id(self) -> str:
        return self._next_name()

    async def write_pack(self, pack: str, data: bytes | bytearray) -> Record:
        """Put a pack object; return its journal record."""
        await self.store.put(pack_key(pack), bytes(data))
        self.stats.packs += 1
        return {"op": "pack", "pack": pack, "size": len(data), "t": time.time_ns()}

    async def write_journal(self, records: list[Record], applied: int | None = None) -> str:
        """Put a journal of ``records``, then apply them here (the first
        ``applied`` of them: the rest were applied when queued)."""
        name = JOURNAL_DIR + self._next_name() + JOURNAL_SUFFIX
        body = json.dumps({"v": FORMAT_VERSION, "node": self.node, "records": records},
                          separators=(",", ":")).encode()
        await self.store.put(name, body)
        self.stats.journals += 1
        count = len(records) if applied is None else applied
        await trio.to_thread.run_sync(self.index.apply, records[:count], name)
        return name

    # -- the loop ----------------------------------------------------------------
    async def run(self) -> None:
        if self.index.outbox_size():
            self.publish_soon()
        async with trio.open_nursery() as nursery:
            while True:
                due = math.inf
                if self._oldest is not None and self._newest is not None:
                    # While files keep coming, a pack fills up (for at most
                    # MAX_WAITS waits); once they stop, it goes after one wait.
                    wait = self.config.pack_wait
                    due = min(self._newest + wait, self._oldest + MAX_WAITS * wait)
                if self._records_due is not None:
                    due = min(due, self._records_due)
                now = trio.current_time()
                if self._must_go_now():
                    due = now + HANDOVER_TICK if self._waits_for_handover(now) else now
                if due <= now:
                    await self._uploads.acquire()
                    batch = self._take()
                    self._inflight.update(batch)
                    self._forced = bool(self._queue) and self._forced
                    nursery.start_soon(self._publish_task, batch)
                    continue
                with trio.move_on_at(due):
                    await self._wake.wait()
                self._wake = trio.Event()

    def _take(self) -> dict[int, int]:
        """The next pack's files: up to ``pack_size`` bytes, oldest first."""
        batch: dict[int, int] = {}
        size = 0
        for ino in list(self._queue):
            inode = self.meta.get(ino)
            length = inode.size if inode is not None else 0
            if batch and size + length > self.config.pack_size:
                break
            batch[ino] = self._queue.pop(ino)
            size += length
        self._queued_bytes = max(0, self._queued_bytes - size)
        self._records_due = None  # the outbox goes with this journal
        self._oldest = self._newest = trio.current_time() if self._queue else None
        return batch

    async def _publish_task(self, batch: dict[int, int]) -> None:
        try:
            await self._publish(batch)
            self.failure = (0, "", 0.0)
        except Exception as exc:
            error = lake_error_in(exc)
            if error is None and not isinstance(exc, OSError):
                log.exception("packing failed")
            count = self.failure[0] + 1
            self.failure = (count, Failure(error or exc), trio.current_time())
            log.warning("packing %d files failed (%s); they are tried again", len(batch),
                        error or exc)
            await trio.sleep(PROMOTION_BACKOFF.delay(count))
            for ino, version in batch.items():  # back in the queue, unless changed
                self._inflight.discard(ino)
                self._queue.setdefault(ino, version)
            self.publish_soon()
        finally:
            self._inflight.difference_update(batch)
            self._uploads.release()
            self._wake.set()
            self.owner.published()

    async def _publish(self, batch: dict[int, int]) -> None:
        """One pack of ``batch`` (if any is still as handed over) and one journal
        with it and the queued changes; then settle the packed files."""
        # Records another publication in flight took are not taken again: a
        # sync asking while a pack is on its way would put them in a journal
        # of their own.
        claimed = self._claimed
        outbox, last = self.index.outbox_records(after=claimed)
        self._claimed = max(self._claimed, last)
        try:
            await self._publish_with(batch, outbox, claimed, last)
        except BaseException:
            self._claimed = min(self._claimed, claimed)  # taken again by the next
            raise

    async def _publish_with(self, batch: dict[int, int], outbox: list[Record],
                            claimed: int, last: int) -> None:
        items = [inode for inode in (self.meta.get(ino) for ino in batch)
                 if inode is not None and not inode.orphan and inode.pending & DATA
                 and self.owner.change_count(inode.ino) == batch[inode.ino]
                 and self.files.has(inode.ino)]
        records: list[Record] = []
        placed: list[tuple[Inode, PackedEntry]] = []
        if items:
            pack = self.new_pack_id()
            await self.owner.paced(sum(inode.size for inode in items))
            data, entries = await trio.to_thread.run_sync(self._assemble, pack, items)
            # A file changed while it was read (a writer past the daemon
            # opened it) is not packed: its bytes may be of the next version.
            entries = [entry if self.owner.change_count(inode.ino) == batch[inode.ino] else None
                       for inode, entry in zip(items, entries, strict=True)]
            if any(entry is not None for entry in entries):
                records.append(await self.write_pack(pack, data))
            for inode, entry in zip(items, entries, strict=True):
                if entry is not None:
                    records.append(entry.record())
                    placed.append((inode, entry))
        records += outbox
        if not records:
            return
        await self.write_journal(records, applied=len(records) - len(outbox))
        if outbox:
            self.index.drop_outbox(last, after=claimed)
        for inode, entry in placed:
            self.stats.packed_files += 1
            self.stats.packed_bytes += entry.length
            self.owner.packed(inode.ino, inode.key, batch[inode.ino], entry)
        if placed:
            log.debug("packed %d files (%d bytes) into %s", len(placed),
                      sum(e.length for _, e in placed), records[0]["pack"])

    def _assemble(self, pack: str, items: list[Inode]
                  ) -> tuple[bytearray, list[PackedEntry | None]]:
        """The pack's bytes and an entry per file (None: its copy was gone)."""
        data = bytearray()
        entries: list[PackedEntry | None] = []
        stamp = time.time_ns()
        for inode in items:
            try:
                with open(self.files.path(inode.ino), "rb") as fp:
                    content = fp.read()
            except FileNotFoundError:
                entries.append(None)
                continue
            entries.append(PackedEntry(
                inode.key, pack, len(data), len(content), checksum(content), stamp,
                st_mode(inode), self.uid if inode.uid < 0 else inode.uid,
                self.gid if inode.gid < 0 else inode.gid,
                inode.mtime_ns, inode.xattrs or None, atime_ns=inode.atime_ns))
            data += content
        return data, entries

    # -- records of changes without data ---------------------------------------
    def objects_deleted(self, keys: list[str]) -> None:
        """Objects at ``keys`` left the lake: where the index's word on a key
        is the record of such an object, a deletion ends it (stamped after
        it), so nodes that list the key from its record (lake.longkeys) drop
        it; a newer record (a packed file of that name) stays."""
        records = []
        for key in keys:  # (a scan of the key's own records, not its directory's)
            record = next((r for r in self.index.objects_below(key) if r["key"] == key), None)
            if record is not None:
                records.append(deletion(key, max(time.time_ns(), record["t"] + 1)))
        self.queue_records(records)

    def queue_records(self, records: list[Record], lazy: bool = False) -> None:
        """Queue records for the next journal: soon (one pack_wait), or
        ``lazy``: with the next pack, or after RECORDS_WAITS pack_waits (a
        directory made and then filled with small files costs one journal,
        not one for its marker's record and one for its files)."""
        if not records:
            return
        self.index.queue(records)
        if not lazy:
            self.publish_soon()
        elif self._records_due is None:
            self._records_due = trio.current_time() + RECORDS_WAITS * self.config.pack_wait
            self._wake.set()


def entry_fields(entry: PackedEntry) -> dict[str, object]:
    """The inode fields a listing of a packed file sets."""
    fields: dict[str, object] = {"pack": entry.pack, "pack_offset": entry.offset,
                                 "checksum": entry.xxh3, "mtime_ns": entry.mtime_ns}
    if not entry.origin:  # aifs pack copies: attributes from the original's metadata
        fields.update(mode=entry.permissions(), uid=entry.uid, gid=entry.gid,
                      xattrs=dict(entry.xattrs or {}), atime_ns=entry.atime_ns,
                      attrs_known=True)
    return fields
