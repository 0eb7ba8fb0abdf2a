"""A directory's first listing of plain files, kept as one record: a batch.

A walk of a big tree lists every directory once and reads it back once; four
records per file (inode, name, cookie, key) cost more than the walk itself.
So the plain files of a directory's *first* listing (no fields beyond what
LIST says, a key of their own, none this node deleted) are stored as one
record per directory: their names, sizes, times and ETags in listed order,
with a range of inode numbers and a range of cookies. Such an entry is
*virtual*: reads (``get``, ``lookup``, ``readdir``, ``owner_of`` ...) make
its :class:`Inode` from the batch, and the first write transaction that
touches any record of a batched directory or entry (a create in it, an
unlink, a rename, a change of one of its inodes, a refresh of its listing)
turns the whole batch into the four records per file that the listing would
have written (:meth:`BatchesMixin._materialize`), byte for byte, before it
goes on. Write transactions get this from :class:`Writing`, a transaction
whose ``get``, ``put`` and ``delete`` in the entry databases materialize
first: the rest of the store keeps reading and writing records as before.

The numbers are given out in one order with batches or without (a listing's
batched files first, the rest after): ``tests/unit/test_batches.py`` runs the same
operations on a store with batches and one without, compares every read,
and then the records themselves.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import lmdb

from aifs.meta.base import Database, StoreBase, Txn
from aifs.meta.inode import FILE, ROOT_INO, Inode, Listed
from aifs.meta.schema import (
    DB_BATCH,
    DB_BATCH_INO,
    DB_BATCH_ROWS,
    KEY_RAW_MAX,
    U64,
    U64X2,
    key_bytes,
    u64,
)

#: a batch's head (``batch``): first inode number, first cookie, count, then the
#: directory's key as listed (UTF-8)
HEAD = struct.Struct("<QQI")
#: one row (``batchrows``, rows back to back): size, mtime as LIST gave it (the
#: float), name length, ETag length; then the name and the ETag
ROW = struct.Struct("<QdHH")
#: batches kept parsed in memory (a READDIRPLUS or LOOKUP reads one at a time)
PARSED_KEPT = 64
#: the most files one batch holds: the write that materializes it runs on the
#: event loop (16,384 records: ~0.1 s); a directory with more gets records
BATCH_MAX = 16384


@dataclass
class Batch:
    parent: int
    first_ino: int
    first_cookie: int
    dir_key: str
    names: list[bytes]
    sizes: list[int]
    mtimes: list[float]
    etags: list[str]
    index: dict[bytes, int] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def find(self, name: bytes) -> int | None:
        if self.index is None:
            self.index = {name: i for i, name in enumerate(self.names)}
        return self.index.get(name)

    def key(self, i: int) -> str:
        return self.dir_key + self.names[i].decode("utf-8", "surrogateescape")

    def inode(self, i: int) -> Inode:
        """Entry ``i`` as the record the listing would have written decodes."""
        return listed_inode(self.listed(i), self.first_ino + i, self.parent)

    def listed(self, i: int) -> Listed:
        name = self.names[i].decode("utf-8", "surrogateescape")
        return Listed(name, FILE, self.dir_key + name, self.sizes[i], self.etags[i],
                      self.mtimes[i])


def batchable(entry: Listed, dir_key: str) -> bool:
    """Whether a listed child may be virtual: a plain file named as its key
    says, whose key is stored whole (not cut and hashed)."""
    return entry.kind == FILE and not entry.fields and entry.key == dir_key + entry.name \
        and "/" not in entry.name \
        and len(entry.key.encode("utf-8", "surrogateescape")) <= KEY_RAW_MAX


def encode(batch: Batch) -> tuple[bytes, bytes]:
    """A batch's head and rows, as stored."""
    head = HEAD.pack(batch.first_ino, batch.first_cookie, len(batch)) + batch.dir_key.encode(
        "utf-8", "surrogateescape")
    parts = []
    pack = ROW.pack
    for name, size, mtime, etag in zip(batch.names, batch.sizes, batch.mtimes, batch.etags,
                                       strict=True):
        raw_etag = etag.encode("utf-8", "surrogateescape")
        parts.append(pack(size, mtime, len(name), len(raw_etag)) + name + raw_etag)
    return head, b"".join(parts)


def decode(parent: int, head: bytes, rows: bytes) -> Batch:
    first_ino, first_cookie, count = HEAD.unpack_from(head)
    dir_key = head[HEAD.size:].decode("utf-8", "surrogateescape")
    names: list[bytes] = []
    sizes: list[int] = []
    mtimes: list[float] = []
    etags: list[str] = []
    offset, unpack, size = 0, ROW.unpack_from, ROW.size
    for _ in range(count):
        length, mtime, name_len, etag_len = unpack(rows, offset)
        offset += size
        names.append(rows[offset:offset + name_len])
        offset += name_len
        etags.append(rows[offset:offset + etag_len].decode("utf-8", "surrogateescape"))
        offset += etag_len
        sizes.append(length)
        mtimes.append(mtime)
    return Batch(parent, first_ino, first_cookie, dir_key, names, sizes, mtimes, etags)


def listed_inode(entry: Listed, ino: int, parent: int) -> Inode:
    """The inode a listed child gets (its record, or made from its batch)."""
    inode = Inode(ino, entry.kind, entry.key, parent, entry.size, entry.etag,
                  int(entry.mtime * 1e9))
    if entry.fields:
        inode.__dict__.update(entry.fields)  # (plain fields: what setattr would do)
    return inode


def entry_records(parent: int, name: bytes, objkey: bytes, entry: Listed, ino: int,
                  cookie: int) -> tuple[tuple[bytes, bytes], ...]:
    """A listed child's records, as (key, value) of the inode, dentry, cookie
    and object-key databases (``_entry_dbs``)."""
    prefix, raw_ino = u64(parent), u64(ino)
    return ((raw_ino, listed_inode(entry, ino, parent).encode_kept()),
            (prefix + name, U64X2.pack(ino, cookie)), (prefix + u64(cookie), name),
            (objkey, raw_ino))


class Writing:
    """A write transaction that materializes a batch before any of its
    entries' records is read, written or deleted (see the module's doc)."""

    def __init__(self, store: BatchesMixin, txn: lmdb.Transaction[bytes]) -> None:
        self.raw = txn
        self._store = store
        self._entry_dbs = store._entry_dbs()

    def get(self, key: bytes, default: None = None,
            db: Database | None = None) -> bytes | None:
        value = self.raw.get(key, db=db)
        if value is None and db in self._entry_dbs \
                and self._store._materialize_for(self.raw, key, db):
            value = self.raw.get(key, db=db)
        return default if value is None else value

    def put(self, key: bytes, value: bytes, db: Database | None = None,
            **options: bool) -> bool:
        if db in self._entry_dbs:
            self._store._materialize_for(self.raw, key, db)
        return self.raw.put(key, value, db=db, **options)

    def delete(self, key: bytes, value: bytes = b"",
               db: Database | None = None) -> bool:
        if db in self._entry_dbs:
            self._store._materialize_for(self.raw, key, db)
        return self.raw.delete(key, value, db=db)

    def cursor(self, db: Database | None = None) -> lmdb.Cursor[bytes]:
        """(The cursors of write paths scan records that are never virtual:
        ``_children`` materializes its directory first.)"""
        return self.raw.cursor(db=db)


class BatchesMixin(StoreBase):
    def _init_batches(self, enabled: bool) -> None:
        self.batches_enabled = enabled
        self.batch_heads = self.env.open_db(DB_BATCH)
        self.batch_rows = self.env.open_db(DB_BATCH_ROWS)
        self.batch_inos = self.env.open_db(DB_BATCH_INO)
        self._parsed: dict[int, Batch] = {}
        self._parsed_lock = threading.Lock()  # (listings parse in worker threads)
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.batch_inos)
            #: no inode number above this is virtual (a bound, never too low)
            self._batched_below = U64.unpack(cursor.key())[0] if cursor.last() else 0

    @contextlib.contextmanager
    def _write(self) -> Iterator[Writing]:
        """A write transaction of the entry databases (see :class:`Writing`)."""
        try:
            with self.env.begin(write=True) as txn:
                yield Writing(self, txn)
        except BaseException:
            self._drop_parsed()  # (a batch parsed inside it may not exist)
            raise

    def _entry_dbs(self) -> tuple[Database, ...]:
        """The databases of :func:`entry_records`, in its order."""
        return self.inodes, self.dentries, self.cookies, self.objkeys

    def _put_records(self, txn: lmdb.Transaction[bytes], parent: int,
                     rows: Iterable[tuple[bytes, bytes, Listed, int, int]]) -> None:
        """The records of listed children (name, key, entry, ino, cookie), in
        bulk: one ``putmulti`` per database (a third of a ``put`` per record)."""
        columns: tuple[list[tuple[bytes, bytes]], ...] = ([], [], [], [])
        for name, objkey, entry, ino, cookie in rows:
            for column, record in zip(columns, entry_records(parent, name, objkey, entry,
                                                             ino, cookie), strict=True):
                column.append(record)
        for db, items in zip(self._entry_dbs(), columns, strict=True):
            txn.cursor(db=db).putmulti(items)

    # -- reads --------------------------------------------------------------------
    def _batch(self, txn: lmdb.Transaction[bytes] | Writing, parent: int) -> Batch | None:
        raw_txn = txn.raw if isinstance(txn, Writing) else txn
        head = raw_txn.get(u64(parent), db=self.batch_heads)
        if head is None:
            return None
        first_ino = HEAD.unpack_from(head)[0]
        batch = self._parsed.get(parent)
        if batch is None or batch.first_ino != first_ino:
            rows = raw_txn.get(u64(parent), db=self.batch_rows)
            assert rows is not None  # (stored with its head, in one transaction)
            batch = decode(parent, bytes(head), bytes(rows))
            self._keep(batch)
        return batch

    def batch_after(self, parent: int, after_cookie: int) -> tuple[Batch, int] | None:
        """``parent``'s batch and the index of its entry just after cookie
        ``after_cookie``, if that entry is batched (read-only: the batch must
        not be changed); None if it is not."""
        with self.env.begin() as txn:
            batch = self._batch(txn, parent)
        if batch is None:
            return None
        start = max(0, after_cookie + 1 - batch.first_cookie)  # (its cookies come first)
        return (batch, start) if start < len(batch) else None

    def _keep(self, batch: Batch) -> None:
        with self._parsed_lock:
            self._parsed.pop(batch.parent, None)
            if len(self._parsed) >= PARSED_KEPT:
                self._parsed.pop(next(iter(self._parsed)), None)
            self._parsed[batch.parent] = batch

    def _drop_parsed(self, parent: int | None = None) -> None:
        with self._parsed_lock:
            if parent is None:
                self._parsed.clear()
            else:
                self._parsed.pop(parent, None)

    def _batch_of_ino(self, txn: lmdb.Transaction[bytes], ino: int) -> tuple[Batch, int] | None:
        """The batch that holds inode ``ino`` virtually, and its row."""
        if ino > self._batched_below:
            return None
        cursor = txn.cursor(db=self.batch_inos)
        if not cursor.set_range(u64(ino)):
            return None
        batch = self._batch(txn, U64.unpack(cursor.value())[0])
        if batch is None or not batch.first_ino <= ino < batch.first_ino + len(batch):
            return None
        return batch, ino - batch.first_ino

    def _virtual(self, txn: lmdb.Transaction[bytes], ino: int) -> Inode | None:
        found = self._batch_of_ino(txn, ino)
        return found[0].inode(found[1]) if found else None

    def _virtual_entry(self, txn: lmdb.Transaction[bytes], parent: int,
                       name: bytes) -> tuple[Batch, int] | None:
        batch = self._batch(txn, parent)
        if batch is None:
            return None
        i = batch.find(name)
        return None if i is None else (batch, i)

    def _key_parent(self, txn: lmdb.Transaction[bytes], raw_key: bytes) -> int | None:
        """The directory a file's lake key (as stored, not hashed) is in."""
        if len(raw_key) > KEY_RAW_MAX or raw_key.endswith(b"/"):
            return None
        cut = raw_key.rfind(b"/")
        if cut < 0:
            return ROOT_INO
        owner = txn.get(raw_key[:cut + 1], db=self.objkeys)
        return U64.unpack(owner)[0] if owner is not None else None

    def _materialize_key_owner(self, txn: lmdb.Transaction[bytes], dir_key: str,
                               parent: int) -> None:
        """Before ``parent`` (a directory of key ``dir_key``) links listed
        files by their keys: the batch of another directory known by that
        key (``parent`` an orphan of the same name) becomes records, so that
        a key it holds is seen as taken, as its record would be."""
        if dir_key == "":
            owner: int | None = ROOT_INO
        else:
            raw = txn.get(key_bytes(dir_key), db=self.objkeys)
            owner = U64.unpack(raw)[0] if raw is not None else None
        if owner is not None and owner != parent:
            self._materialize(txn, owner)

    def _virtual_key(self, txn: lmdb.Transaction[bytes],
                     raw_key: bytes) -> tuple[Batch, int] | None:
        parent = self._key_parent(txn, raw_key)
        if parent is None:
            return None
        found = self._virtual_entry(txn, parent, raw_key[raw_key.rfind(b"/") + 1:])
        if found is None or key_bytes(found[0].key(found[1])) != raw_key:
            return None
        return found

    def _virtual_children(self, txn: lmdb.Transaction[bytes],
                          parent: int) -> Iterator[tuple[bytes, bytes]]:
        """(name, dentry value) of ``parent``'s virtual children, as
        :meth:`_children` gives the others."""
        batch = self._batch(txn, parent)
        if batch is not None:
            for i, name in enumerate(batch.names):
                yield name, U64X2.pack(batch.first_ino + i, batch.first_cookie + i)

    # -- writes -------------------------------------------------------------------
    def _store_batch(self, txn: lmdb.Transaction[bytes], parent: int, dir_key: str, first_ino: int,
                     first_cookie: int, entries: list[Listed]) -> None:
        """Keep ``entries`` as ``parent``'s batch, numbered in order from
        ``first_ino`` and ``first_cookie``."""
        batch = Batch(parent, first_ino, first_cookie, dir_key,
                      [entry.name.encode("utf-8", "surrogateescape") for entry in entries],
                      [entry.size for entry in entries], [entry.mtime for entry in entries],
                      [entry.etag for entry in entries])
        head, rows = encode(batch)
        # kept parsed for the READDIRPLUS that follows (a batch whose head did not
        # commit is never used: _batch checks the head's first inode number)
        self._keep(batch)
        last = first_ino + len(entries) - 1
        txn.put(u64(parent), head, db=self.batch_heads)
        txn.put(u64(parent), rows, db=self.batch_rows)
        txn.put(u64(last), u64(parent), db=self.batch_inos)
        self._batched_below = max(self._batched_below, last)

    def _materialized(self, txn: Txn, parent: int) -> Txn:
        if isinstance(txn, Writing):
            self._materialize(txn.raw, parent)
            return txn.raw
        return txn

    def materialize_all(self) -> int:
        """Turn every batch into records (tests compare stores so); how many."""
        with self.env.begin(write=True) as txn:
            parents = [U64.unpack(key)[0] for key in
                       txn.cursor(db=self.batch_heads).iternext(keys=True, values=False)]
            for parent in parents:
                self._materialize(txn, parent)
        return len(parents)

    def _materialize_for(self, txn: lmdb.Transaction[bytes], key: bytes,
                         db: Database | None) -> bool:
        """Materialize the batch that holds what ``key`` of entry database
        ``db`` names, if one does; whether one did."""
        if not self._batched_below:  # no batch was ever kept
            return False
        if db is self.dentries or db is self.cookies:  # parent ino ++ ...
            return self._materialize(txn, U64.unpack(key[:8])[0])
        if db is self.inodes:
            found = self._batch_of_ino(txn, U64.unpack(key[:8])[0])
        else:
            found = self._virtual_key(txn, bytes(key))
        if found is None:
            return False
        self._expand(txn, found[0])
        return True

    def _materialize(self, txn: lmdb.Transaction[bytes], parent: int) -> bool:
        """Turn ``parent``'s batch, if it has one, into records; whether it had."""
        batch = self._batch(txn, parent)
        if batch is None:
            return False
        self._expand(txn, batch)
        return True

    def _expand(self, txn: lmdb.Transaction[bytes], batch: Batch) -> None:
        """``batch`` becomes the records its listing would have written."""
        rows = []
        for i, name in enumerate(batch.names):
            entry = batch.listed(i)
            rows.append((name, key_bytes(entry.key), entry, batch.first_ino + i,
                         batch.first_cookie + i))
        self._put_records(txn, batch.parent, rows)
        txn.delete(u64(batch.parent), db=self.batch_heads)
        txn.delete(u64(batch.parent), db=self.batch_rows)
        txn.delete(u64(batch.first_ino + len(batch) - 1), db=self.batch_inos)
        self._drop_parsed(batch.parent)
