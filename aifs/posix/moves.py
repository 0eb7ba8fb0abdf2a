"""What a rename does in the lake.

S3 has no rename: what the lake holds under the old name is copied server
side to the new one (a directory: every object below it, 16 at a time,
commit markers last) and the old keys become tombstones, deleted by the
promoter. Packed files move by records instead: a record under the new key
(the same bytes in the same pack) and a deletion under the old one.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import trio

from aifs.checkpoint import Checkpoints
from aifs.errors import LakeError, ObjectNotFound
from aifs.flush.promoter import Promoter
from aifs.lake.base import ObjectStore
from aifs.meta.objattrs import to_metadata as object_metadata
from aifs.meta.store import DATA, MAYBE_IN_LAKE, META, Inode, MetaStore
from aifs.pack.index import Record, deletion, is_packed_at, object_record
from aifs.pack.packer import Packer
from aifs.posix.inodes import Inodes
from aifs.posix.writes import Writes

log = logging.getLogger(__name__)

COPY_CONCURRENCY = 16


class Moves:
    def __init__(self, inodes: Inodes, store: ObjectStore, meta: MetaStore, packer: Packer,
                 promoter: Promoter, checkpoints: Checkpoints, writes: Writes) -> None:
        self.inodes = inodes
        self.writes = writes
        self.store = store
        self.meta = meta
        self.packer = packer
        self.packs = packer.index
        self.promoter = promoter
        self.checkpoints = checkpoints

    def packed(self, old_key: str, new_key: str, is_dir: bool) -> None:
        """Publish a rename of packed files: each gets a record under its new
        key (the same bytes) and a deletion under the old one. A packed copy
        made by ``aifs pack`` is dropped: its original was copied in the lake.
        A file replaced by the rename loses its packed record (asked here,
        after the rename's copy in the lake: its pack may have landed during
        it); the source's, if it moves, is stamped after that deletion.

        A record moves only when the renamed file's lake copy IS that record:
        the pack index may still name a file that was replaced while its pack
        was on the way (its bytes are no one's now), or an older version of a
        file changed since; those records are deleted, and the file's pending
        upload writes the new key."""
        now = time.time_ns()  # the deletions; a moved record is stamped now + 1
        records = []
        if is_dir:
            entries = self.packs.under(old_key)
        else:
            entry = self.packs.entry(old_key)
            entries = [entry] if entry is not None else []
            if self.packs.entry(new_key) is not None:  # the replaced file's
                records.append(deletion(new_key, now))
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

    async def in_lake(self, source: Inode, new_key: str) -> tuple[list[str], dict[str, str]]:
        """Copy what the lake holds of ``source`` to ``new_key`` (server side);
        return the old keys to delete and the ETags of the copies."""
        if self.store.keys_nest:
            await self.promoter.clear_way(new_key)
        if not source.is_dir:
            if not source.in_lake:
                return [], {}
            if source.packed and not source.pending & DATA:
                entry = self.packs.entry(source.key)
                if entry is not None and not entry.origin:
                    return [], {}  # no object: the pack index moves it
            if source.pending & DATA or source.etag == MAYBE_IN_LAKE:
                return [source.key], {}  # its upload goes to the new key
            if self.promoter.landing_at(new_key):
                # A stale upload to the new key is on the way (a file renamed or
                # deleted while it uploaded): a copy now could land before it.
                if self.inodes.local.has(source.ino):
                    self.writes.mark_dirty(source.ino)  # uploaded after it lands
                    return [source.key], {}
                await self.promoter.wait_landed(new_key)
            metadata = (object_metadata(source, self.inodes.uid, self.inodes.gid)
                        if source.pending & META else None)
            try:
                etag = await self.store.copy(source.key, new_key, metadata)
            except ObjectNotFound:
                return [], {}
            # what the copy's metadata says, for nodes that list it (as after an
            # upload), where this node knows it (not: another tool's object)
            if source.attrs_known or source.pending & META:
                self.packer.queue_records([object_record(
                    new_key, etag, object_metadata(source, self.inodes.uid, self.inodes.gid))])
            else:
                await self._describe_copies(
                    source.key, new_key, {new_key: etag}, {source.key: source.etag},
                    {r["key"]: r for r in self.packs.objects_below(source.key)})
            return [source.key], {new_key: etag}
        await self.promoter.wait_landed(new_key, below=True)  # (as above)
        listed: dict[str, str] = {}  # old key -> its ETag, as the lake gave it
        known: dict[str, Record] = {}  # old key -> the record aifs published of it
        old_keys, copies, markers = await self._objects_below(source, new_key, listed, known)
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
        await self._describe_copies(source.key, new_key, etags, listed, known)
        return old_keys, etags

    async def _describe_copies(self, old_key: str, new_key: str,
                               etags: dict[str, str], listed: dict[str, str],
                               known: dict[str, Record]) -> None:
        """Records of a renamed directory's copies, as an upload leaves: a
        node listing them takes their attributes from there (without one, a
        fresh node showed the copy's time and default modes), and one whose
        key no LIST finds (longer than the lake takes: lake.longkeys) is
        listed from its record alone. A record of the source is taken where
        it describes the version copied (its ETag as ``listed`` gives it; an
        object no LIST finds only aifs writes); an object no record describes
        (another tool's, or changed since) gets one only where no LIST would
        find it, from the copy's metadata (a HEAD: best effort, the copies
        are made). ``known``: the records below ``old_key``, by key."""
        records = []
        for dst, etag in etags.items():
            src = old_key + dst[len(new_key):]
            record = known.get(src)
            meta = None
            if record is not None and (src not in listed or record.get("etag") == listed[src]):
                meta = record.get("meta") or {}
            elif not self.store.listed(dst):
                try:
                    meta = dict((await self.store.head(dst)).metadata)
                except LakeError as exc:  # (ObjectNotFound: gone since)
                    log.warning("no record for %s: %s", dst, exc)
                    continue
            if meta is not None:
                records.append(object_record(dst, etag, meta))
        self.packer.queue_records(records)

    async def _objects_below(self, source: Inode, new_key: str, listed: dict[str, str],
                             known: dict[str, Record]) -> tuple[
            list[str], list[tuple[str, str]], list[tuple[str, str]]]:
        """The keys below a directory renamed to ``new_key``: all of them (to
        delete), the (old, new) pairs to copy, and the commit markers' pairs,
        copied after the rest; into ``listed`` each listed key's ETag, into
        ``known`` the records aifs published of objects below (one scan)."""
        old_keys: list[str] = []
        copies: list[tuple[str, str]] = []
        markers: list[tuple[str, str]] = []
        unpromoted: bool | None = None  # data below not yet in the lake (asked once)

        def take(key: str) -> None:
            nonlocal unpromoted
            old_keys.append(key)
            if self.meta.tombstoned(key):
                return
            owner = self.meta.owner_of(key)
            if owner is None and self.promoter.landing(key):
                return  # a removed entry's upload, landed: tombstoned on its reply
            owner_inode = self.meta.get(owner) if owner else None
            if owner_inode is not None and owner_inode.pending & DATA:
                return  # uploaded under its new key later
            if owner_inode is not None and owner_inode.packed:
                entry = self.packs.entry(key)
                if entry is not None and not entry.origin and is_packed_at(owner_inode, entry):
                    return  # a stale object under a packed file's name: deleted
            pair = (key, new_key + key[len(source.key):])
            if owner_inode is not None and self.checkpoints.is_marker(owner_inode):
                if unpromoted is None:
                    unpromoted = any(i.pending & DATA and i.key.startswith(source.key)
                                     for i in self.meta.pending_inodes())
                if unpromoted and self.inodes.local.has(owner_inode.ino):
                    return  # uploaded again, after the data it commits
                markers.append(pair)
            else:
                copies.append(pair)

        async for page in self.store.iter_list(source.key, None):
            for obj in page.objects:
                listed[obj.key] = obj.etag
                take(obj.key)
        # objects no LIST finds (keys longer than the lake takes): their records
        for record in self.packs.objects_below(source.key):
            known[record["key"]] = record
            if not self.store.listed(record["key"]):
                take(record["key"])
        return old_keys, copies, markers
