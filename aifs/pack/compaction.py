"""Pack upkeep: compaction, collection, and packing objects other tools wrote.

- *Compaction* rewrites packs whose live share fell below
  ``pack_compact_below`` (their files were deleted, renamed away or
  overwritten): the live entries go to a new pack and a journal moves them
  there. A move applies only where the entry still is in the old pack, so a
  change made meanwhile by any node wins.
- *Collection* deletes a pack only when no entry this node knows of lives in
  it, after replaying every journal in the lake, and only once it has been
  dead (and in the lake) for ``pack_gc_grace`` seconds: nodes that have not
  replayed the newest journals yet, and packers whose journal is still on
  its way, keep reading from it meanwhile.
- *Importing* (``aifs pack``) packs plain objects of a directory written by
  other tools. The objects stay the truth: a record remembers the ETag it
  copied, and a listing ignores the packed copy once the object changed.

- *Folding* replaces the journals in the lake by one fold object: the whole
  index (live files, recent deletions, live packs), so a new node reads one
  object instead of every journal ever written. The journals are deleted only
  once the fold is in the lake; a node reading them meanwhile lists again and
  finds the fold.

Each node compacts its own packs in the background (and folds once the
journals pile up); ``aifs gc`` does every node's, collects, and folds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from aifs.config import Config
from aifs.errors import LakeError, ObjectNotFound, PreconditionFailed
from aifs.lake.base import ObjectInfo, ObjectStore
from aifs.meta.store import MetaStore, valid_name
from aifs.pack.folds import SHARD_DIR, encode_sharded_fold, shard_dir, shard_key
from aifs.pack.index import (
    FOLD_SUFFIX,
    JOURNAL_DIR,
    PACK_DIR,
    PackedEntry,
    Record,
    checksum,
    encode_fold,
    pack_key,
)
from aifs.pack.packer import Packer

log = logging.getLogger(__name__)

BACKGROUND_EVERY = 300.0  # seconds between background compactions
FOLD_AFTER = 200  # journals in the lake before a background fold
OBJECTS_AT_ONCE = 32


@dataclass
class Upkeep:
    """What a compaction, collection or import did (``aifs gc``, ``aifs pack``)."""

    packs_compacted: int = 0
    entries_moved: int = 0
    packs_deleted: int = 0
    bytes_reclaimed: int = 0
    files_packed: int = 0
    bytes_packed: int = 0
    files_total: int = 0
    journals_folded: int = 0
    uploads_aborted: int = 0
    corrupt: list[str] = field(default_factory=list)


class Compactor:
    def __init__(self, packer: Packer, store: ObjectStore, meta: MetaStore,
                 config: Config) -> None:
        self.packer = packer
        self.index = packer.index
        self.store = store
        self.meta = meta
        self.config = config
        self.progress = Upkeep()  # of the import under way (aifs pack)

    async def run(self) -> None:
        """Background: compact this node's sparse packs now and then."""
        while True:
            await trio.sleep(BACKGROUND_EVERY)
            try:
                await self.compact(own_only=True)
                if len(self.packer.journals.replayed) >= FOLD_AFTER:
                    await self.fold(at_least=FOLD_AFTER)  # unless another node just did
            except LakeError as exc:
                log.warning("background compaction failed: %s", exc)

    # -- compaction --------------------------------------------------------------
    def _sparse(self, own_only: bool) -> list[str]:
        limit = self.config.pack_compact_below
        out = []
        for pack, info in self.index.all_packs().items():
            size, live = info.get("size", 0), info.get("live", 0)
            if not size or not live or live / size >= limit:
                continue
            if own_only and f"-{self.packer.node}-" not in pack:
                continue
            out.append(pack)
        return sorted(out)

    async def compact(self, own_only: bool = False, result: Upkeep | None = None) -> Upkeep:
        """Rewrite the live entries of sparse packs into new packs."""
        result = result or Upkeep()
        if not own_only:  # (this node's own packs' entries are in its index already;
            # one a pending shard says moved or deleted is moved in vain, no harm)
            await self.packer.journals.ensure_complete()  # every entry of every pack
        batch: list[tuple[PackedEntry, bytes]] = []
        size = 0
        for pack in self._sparse(own_only):
            members = self.index.members_of(pack)
            if not members:
                continue
            try:
                data = await self.store.get_range(pack_key(pack), 0,
                                                  max(m.offset + m.length for m in members))
            except ObjectNotFound:
                log.error("pack %s is gone from the lake; its %d files are lost", pack,
                          len(members))
                continue
            for entry in members:
                content = data[entry.offset:entry.offset + entry.length]
                if checksum(content) != entry.xxh3:
                    log.error("%s: damaged in pack %s; left where it is", entry.key, pack)
                    result.corrupt.append(entry.key)
                    continue
                batch.append((entry, content))
                size += entry.length
            result.packs_compacted += 1
            if size >= self.config.pack_size:
                await self._rewrite(batch, result)
                batch, size = [], 0
        if batch:
            await self._rewrite(batch, result)
        return result

    async def _rewrite(self, batch: list[tuple[PackedEntry, bytes]], result: Upkeep) -> None:
        pack = self.packer.new_pack_id()
        data = bytearray()
        records: list[Record] = []
        moves: list[tuple[PackedEntry, int]] = []
        for entry, content in batch:
            records.append({"op": "move", "key": entry.key, "from": [entry.pack, entry.offset],
                            "pack": pack, "off": len(data)})
            moves.append((entry, len(data)))
            data += content
        header = await self.packer.write_pack(pack, data)
        await self.packer.write_journal([header, *records])
        for entry, offset in moves:  # this node's inodes follow at once
            owner = self.meta.owner_of(entry.key)
            inode = self.meta.get(owner) if owner is not None else None
            if inode is not None and inode.pack == entry.pack \
                    and inode.pack_offset == entry.offset:
                moved = PackedEntry(entry.key, pack, offset, entry.length, entry.xxh3,
                                    entry.stamp)
                self.meta.update(inode.ino, pack=pack, pack_offset=offset, etag=moved.etag)
        result.entries_moved += len(moves)
        log.info("compacted %d files into pack %s (%d bytes)", len(moves), pack, len(data))

    # -- collection ---------------------------------------------------------------
    async def collect(self, grace: float | None = None,
                      result: Upkeep | None = None) -> Upkeep:
        """Delete packs no entry lives in any more, once dead for ``grace`` seconds."""
        result = result or Upkeep()
        grace = self.config.pack_gc_grace if grace is None else grace
        journals = self.packer.journals
        await journals.refresh()
        if journals.unreadable:  # it may describe live files in packs that look dead
            raise LakeError(f"{len(journals.unreadable)} journal(s) in the lake cannot be "
                            f"read ({journals.unreadable[0]}, ...): no pack is collected "
                            "until they are repaired or deleted")
        await journals.ensure_complete()  # a pack's live bytes, all counted
        generation = journals.generation
        now = time.time()
        doomed: list[ObjectInfo] = []
        async for page in self.store.iter_list(PACK_DIR, None):
            for obj in page.objects:
                pack = obj.key[len(PACK_DIR):]
                info = self.index.pack_info(pack)
                if info is not None and info.get("live", 0) > 0:
                    continue
                dead_since = (info or {}).get("dead_since") or obj.mtime
                if now - obj.mtime >= grace and now - dead_since >= grace:
                    doomed.append(obj)
        # A listing may have replayed meanwhile: a fold from scratch, or a
        # sharded fold's head whose entries (live bytes) are not read yet.
        await journals.ensure_complete()
        if journals.generation != generation:
            log.info("the pack index changed while packs were collected; "
                     "the collection waits for the next gc")
            return result
        doomed = [obj for obj in doomed
                  if (self.index.pack_info(obj.key[len(PACK_DIR):]) or {}).get("live", 0) <= 0]
        orphans = [obj.key for obj in await self._orphan_shards(now, grace)]
        for start in range(0, len(orphans), 1000):
            await self.store.delete_many(orphans[start:start + 1000])
        if orphans:
            log.info("deleted %d shards of folds no longer in the lake", len(orphans))
        for start in range(0, len(doomed), 1000):
            chunk = doomed[start:start + 1000]
            await self.store.delete_many([obj.key for obj in chunk])
            for obj in chunk:
                self.index.forget_pack(obj.key[len(PACK_DIR):])
                result.packs_deleted += 1
                result.bytes_reclaimed += obj.size
        if doomed:
            log.info("collected %d packs (%d bytes)", len(doomed),
                     sum(obj.size for obj in doomed))
        return result

    async def _orphan_shards(self, now: float, grace: float) -> list[ObjectInfo]:
        """Shards of folds whose head is not in the lake (a fold cut short
        before its head was put, or whose shards outlived it), once older
        than ``grace``: a fold being written now keeps its shards."""
        heads = set()
        async for page in self.store.iter_list(JOURNAL_DIR, None):
            heads |= {obj.key for obj in page.objects if obj.key.endswith(FOLD_SUFFIX)}
        orphans: list[ObjectInfo] = []
        async for page in self.store.iter_list(SHARD_DIR, None):
            for obj in page.objects:
                fold = obj.key[len(SHARD_DIR):].split("/", 1)[0]
                if JOURNAL_DIR + fold + FOLD_SUFFIX not in heads and now - obj.mtime >= grace:
                    orphans.append(obj)
        return orphans

    # -- folding --------------------------------------------------------------------
    async def fold(self, result: Upkeep | None = None, at_least: int = 2) -> Upkeep:
        """Replace the journals (and folds) in the lake by one fold of this
        node's index, once it has replayed them all (if there are ``at_least``)."""
        result = result or Upkeep()
        covers = sorted(await self.packer.journals.refresh())
        if len(covers) < max(2, at_least):
            return result
        await self.packer.journals.ensure_complete()
        keep_after = time.time_ns() - int(self.config.pack_gc_grace * 1e9)
        name = JOURNAL_DIR + self.packer.new_pack_id() + FOLD_SUFFIX
        per_shard = self.config.fold_shard_records
        records, shards = self.index.record_count(), 1
        while shards * per_shard < records:
            shards *= 2
        if shards == 1:
            body = await trio.to_thread.run_sync(
                lambda: encode_fold(self.packer.node, covers, self.index.snapshot(keep_after),
                                    keep_after))
        else:  # the shards first: a fold in the lake has all its shards there
            body, parts = await trio.to_thread.run_sync(
                lambda: encode_sharded_fold(self.packer.node, covers,
                                            self.index.snapshot(keep_after), keep_after,
                                            shards))
            slots = trio.Semaphore(16)

            async def put(shard: int, part: bytes) -> None:
                async with slots:
                    await self.store.put(shard_key(name, shard), part)

            async with trio.open_nursery() as nursery:
                for shard, part in enumerate(parts):
                    nursery.start_soon(put, shard, part)
        await self.store.put(name, body)
        self.index.apply([], name)
        doomed = list(covers)
        for covered in covers:  # the shards of sharded folds it covers go too
            if covered.endswith(FOLD_SUFFIX):
                async for page in self.store.iter_list(shard_dir(covered), None):
                    doomed += [obj.key for obj in page.objects]
        for start in range(0, len(doomed), 1000):  # only now: the fold stands for them
            await self.store.delete_many(doomed[start:start + 1000])
        result.journals_folded += len(covers)
        log.info("folded %d journals into %s (%d bytes%s)", len(covers), name, len(body),
                 f", {shards} shards" if shards > 1 else "")
        return result

    async def gc(self) -> Upkeep:
        """``aifs gc``: compact every node's sparse packs, collect, then fold
        the journals."""
        result = Upkeep()
        await self.packer.journals.refresh()
        await self.compact(own_only=False, result=result)
        await self.collect(result=result)
        await self.fold(result=result)
        return result

    # -- importing ----------------------------------------------------------------
    async def import_objects(self, prefix: str,
                             hidden: Callable[[str], bool] = lambda key: False) -> Upkeep:
        """Pack the small plain objects below ``prefix`` (``aifs pack``)."""
        result = self.progress = Upkeep()
        await self.packer.journals.refresh()
        await self.packer.journals.ensure_complete()
        threshold = self.packer.threshold
        todo: list[ObjectInfo] = []
        async for page in self.store.iter_list(prefix, None):
            for obj in page.objects:
                if obj.size >= threshold or obj.key.endswith("/") or hidden(obj.key):
                    continue
                if not all(valid_name(part) for part in obj.key[len(prefix):].split("/")):
                    continue
                current = self.index.entry(obj.key)
                if current is not None and current.origin == obj.etag:
                    continue  # packed already, unchanged since
                todo.append(obj)
        result.files_total = len(todo)
        log.info("aifs pack %r: %d small objects to pack", prefix, len(todo))
        batch: list[ObjectInfo] = []
        size = 0
        for obj in todo:
            if batch and size + obj.size > self.config.pack_size:
                await self._import_batch(batch, result)
                batch, size = [], 0
            batch.append(obj)
            size += obj.size
        if batch:
            await self._import_batch(batch, result)
        return result

    async def _import_batch(self, batch: list[ObjectInfo], result: Upkeep) -> None:
        contents: dict[str, bytes] = {}
        slots = trio.Semaphore(OBJECTS_AT_ONCE)

        async def fetch(obj: ObjectInfo) -> None:
            async with slots:
                try:
                    contents[obj.key] = await self.store.get_range(obj.key, 0, obj.size,
                                                                   if_match=obj.etag)
                except (ObjectNotFound, PreconditionFailed):
                    pass  # deleted or replaced since the listing: left as it is

        async with trio.open_nursery() as nursery:
            for obj in batch:
                nursery.start_soon(fetch, obj)
        pack = self.packer.new_pack_id()
        data = bytearray()
        records: list[Record] = []
        stamp = time.time_ns()
        for obj in batch:
            content = contents.get(obj.key)
            if content is None or len(content) != obj.size:
                continue
            entry = PackedEntry(obj.key, pack, len(data), len(content), checksum(content),
                                stamp, mtime_ns=int(obj.mtime * 1e9), origin=obj.etag)
            records.append(entry.record())
            data += content
            result.files_packed += 1
            result.bytes_packed += len(content)
        if not records:
            return
        header = await self.packer.write_pack(pack, data)
        await self.packer.write_journal([header, *records])
