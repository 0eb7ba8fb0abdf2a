"""Applying a directory listing: the lake's view of a directory, merged into the store.

``ListingMixin.apply_listing`` makes a directory's children match a fresh
LIST in one transaction, with this node's local state winning (tombstones,
pending changes, changes since the LIST started, hard-linked names); ``_link``
adds one listed child. A mixin over :class:`aifs.meta.base.StoreBase` (see
there why mixins): the merge is one transaction built from the base's
primitives, and callers keep calling ``MetaStore.apply_listing``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from aifs.meta.base import Database, Txn
from aifs.meta.batches import BATCH_MAX, BatchesMixin, Writing, batchable, entry_records
from aifs.meta.inode import DIR, FILE, LINK, Inode, Listed
from aifs.meta.schema import SYS_NEXT_COOKIE, SYS_NEXT_INO, U64, U64X2, key_bytes, u64


class ListingMixin(BatchesMixin):
    def apply_listing(self, parent: int, listed: Iterable[Listed], now: float | None = None,
                      started: float | None = None, names: list[bytes] | None = None,
                      ) -> tuple[list[int], list[int]]:
        """Make ``parent``'s children match a fresh LIST; return the inodes
        removed and those whose object another writer replaced (and add to
        ``names`` the names that came or went).

        Local state wins over the listing: tombstoned keys stay hidden, entries
        with pending changes or changed locally since the LIST ``started``
        stay as they are. An object whose ETag changed is another writer's new
        version: its size and mtime are taken and its attributes read anew.
        Removed inodes stay as orphans until the kernel forgets them.
        """
        prefix = u64(parent)
        removed: list[int] = []
        replaced: list[int] = []
        started = time.time() if started is None else started
        with self._write() as txn:
            counters = _Counters(txn, self.sys)
            existing = dict(self._children(parent, txn))  # (a batch: materialized)
            if not existing:  # a first listing: every entry is new
                raw = txn.get(prefix, db=self.inodes)
                directory = Inode.decode(raw) if raw else None
                if directory is not None:
                    self._materialize_key_owner(txn.raw, directory.key, parent)
                # (an orphan's files have no directory key to be found by)
                dir_key = directory.key if directory and not directory.orphan else None
                listed = self._link_new(txn, parent, listed, counters, names, dir_key)
            for entry in listed:
                name = key_bytes(entry.name)
                if self._deleted_here(txn, key_bytes(entry.key), entry):
                    continue
                value = existing.pop(name, None)
                if value is not None:
                    raw = txn.get(value[:8], db=self.inodes)
                    assert raw is not None  # (a dentry's inode has a record)
                    current = Inode.decode(raw)
                    if current.pending or current.ctime >= started or current.links \
                            or self._settled_at.get(current.ino, 0.0) >= started:
                        continue  # (a hard-linked inode's names are this node's)
                    if current.kind == entry.kind or (current.kind == LINK
                                                      and entry.kind == FILE):
                        if current.etag == entry.etag and current.key == entry.key \
                                and not current.attrs_known and entry.fields \
                                and entry.fields.get("attrs_known"):
                            # the record of this version came after it was listed
                            for field_name, field_value in entry.fields.items():
                                setattr(current, field_name, field_value)
                            self._put(txn, current)
                        elif current.etag != entry.etag or current.key != entry.key:
                            replaced.append(current.ino)
                            current.size, current.etag = entry.size, entry.etag
                            current.mtime_ns, current.key = int(entry.mtime * 1e9), entry.key
                            if current.kind != DIR:
                                current.attrs_known = False
                                current.kind = entry.kind
                                current.pack, current.pack_offset, current.checksum = "", 0, ""
                                for field_name, field_value in (entry.fields or {}).items():
                                    setattr(current, field_name, field_value)
                            self._put(txn, current)
                        continue
                    removed.append(U64X2.unpack(value[:16])[0])
                    self._remove(txn, parent, name, value, tomb=False)
                if names is not None:
                    names.append(name)
                self._link(txn, parent, name, entry, counters)
            counters.write()
            for name, value in existing.items():
                raw = txn.get(value[:8], db=self.inodes)
                if raw:
                    current = Inode.decode(raw)
                    if current.pending or current.ctime >= started \
                            or self._settled_at.get(current.ino, 0.0) >= started:
                        continue  # in the lake since the LIST began, or not yet
                removed.append(U64X2.unpack(value[:16])[0])
                self._remove(txn, parent, name, value, tomb=False)
                if names is not None:
                    names.append(name)
            raw = txn.get(prefix, db=self.inodes)
            if raw:
                dir_inode = Inode.decode(raw)
                dir_inode.listed_at = time.time() if now is None else now
                txn.put(prefix, dir_inode.encode(), db=self.inodes)
        return removed, replaced

    def _link_new(self, txn: Writing, parent: int, listed: Iterable[Listed],
                  counters: _Counters, names: list[bytes] | None,
                  dir_key: str | None) -> list[Listed]:
        """Link the entries of a directory with no children yet in bulk (a
        directory's first listing: a walk of a big tree does this for every
        file): its plain files as one batch (:mod:`aifs.meta.batches`),
        numbered first, then the others' records (``_put_records``). Return
        those left to the general path: a key with an inode already (a hard
        link's name, a moved name), a name or key listed twice."""
        raw = txn.raw  # (no batch here to materialize: the directory has no child)
        left: list[Listed] = []
        seen: set[bytes] = set()
        seen_keys: set[bytes] = set()
        tombs = raw.stat(self.tombs)["entries"] > 0
        plain: list[tuple[bytes, bytes, Listed]] = []
        rest: list[tuple[bytes, bytes, Listed]] = []
        for entry in listed:
            objkey = key_bytes(entry.key)
            if tombs and self._deleted_here(raw, objkey, entry):
                continue
            name = key_bytes(entry.name)
            if name in seen or objkey in seen_keys \
                    or raw.get(objkey, db=self.objkeys) is not None:
                left.append(entry)  # (in order: a name listed again goes there too)
                seen.add(name)
                continue
            seen.add(name)
            seen_keys.add(objkey)
            batch = dir_key is not None and batchable(entry, dir_key)
            (plain if batch else rest).append((name, objkey, entry))
            if names is not None:
                names.append(name)
        first_ino = ino = counters.peek(SYS_NEXT_INO, 2)
        cookie = counters.peek(SYS_NEXT_COOKIE, 1)
        if plain and self.batches_enabled and len(plain) <= BATCH_MAX:
            assert dir_key is not None
            self._store_batch(raw, parent, dir_key, ino, cookie,
                              [entry for _, _, entry in plain])
            ino += len(plain)
            cookie += len(plain)
        else:
            rest = plain + rest  # (numbered as a batch would be: the same store after)
        self._put_records(raw, parent, ((name, objkey, entry, ino + i, cookie + i)
                                        for i, (name, objkey, entry) in enumerate(rest)))
        ino += len(rest)
        cookie += len(rest)
        if ino != first_ino:  # (nothing taken: the counters are not written)
            counters.set(SYS_NEXT_INO, ino)
            counters.set(SYS_NEXT_COOKIE, cookie)
        return left

    def _link(self, txn: Txn, parent: int, name: bytes, entry: Listed,
              counters: _Counters) -> int:
        objkey = key_bytes(entry.key)
        raw_ino = txn.get(objkey, db=self.objkeys)
        if raw_ino is not None and b'"links":[[' in (txn.get(raw_ino, db=self.inodes) or b""):
            raw_ino = None  # a name of a hard-linked inode: that record stays whole
        ino = U64.unpack(raw_ino)[0] if raw_ino else counters.next(SYS_NEXT_INO, 2)
        cookie = counters.next(SYS_NEXT_COOKIE, 1)
        records = entry_records(parent, name, objkey, entry, ino, cookie)
        for db, (key, value) in zip(self._entry_dbs(), records, strict=True):
            txn.put(key, value, db=db)
        return ino

    def _deleted_here(self, txn: Txn, objkey: bytes, entry: Listed) -> bool:
        """A listed object this node deleted (its key tombstoned): hidden,
        unless packed (a packed file's own record says if it lives)."""
        return txn.get(objkey, db=self.tombs) is not None \
            and not (entry.fields or {}).get("pack")


class _Counters:
    """The inode and cookie counters of one listing's transaction, read once
    and written once at its end (not a get and a put per entry listed)."""

    def __init__(self, txn: Txn, db: Database) -> None:
        self.txn, self.db = txn, db
        self.values: dict[bytes, int] = {}

    def peek(self, name: bytes, start: int) -> int:
        """The counter's next value, not taken."""
        value = self.values.get(name)
        if value is None:
            raw = self.txn.get(name, db=self.db)
            value = U64.unpack(raw)[0] if raw else start
        return value

    def next(self, name: bytes, start: int) -> int:
        value = self.peek(name, start)
        self.values[name] = value + 1
        return value

    def set(self, name: bytes, value: int) -> None:
        """The counter's next value is ``value`` (numbers below it taken)."""
        self.values[name] = value

    def write(self) -> None:
        for name, value in self.values.items():
            self.txn.put(name, u64(value), db=self.db)
        self.values.clear()
