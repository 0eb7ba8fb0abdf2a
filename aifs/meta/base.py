"""The metadata store's foundation: its LMDB environment and the steps inside a transaction.

``StoreBase`` opens the environment (migrating an older schema, reserving
disk space) and its databases (:mod:`aifs.meta.schema` tables them), and
holds the primitives that every part of the store builds its transactions
from: counters, storing an inode with its ``pending`` index, tombstoning a
key, finding, unlinking and dropping entries and subtrees. They take the
caller's transaction and never open one, so a public method composed of
several stays one transaction.

The public methods live in mixins over this base, one per responsibility
(:mod:`aifs.meta.listing`, :mod:`aifs.meta.names`,
:mod:`aifs.meta.promotion`), assembled with the reads and plain writes into
:class:`aifs.meta.store.MetaStore`. Mixins rather than helper functions: the
methods keep their one home on ``MetaStore`` (callers and tests are
unchanged), and each mixin sees the primitives here as ``self``'s, with no
transaction or handle threaded through arguments.

Every public method is synchronous and runs one transaction; nothing awaits
inside a transaction.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import lmdb

from aifs.meta.inode import DIR, META, ROOT_INO, Inode
from aifs.meta.schema import (
    DB_COOKIE,
    DB_DENTRY,
    DB_INODE,
    DB_LINK,
    DB_MARKER,
    DB_OBJKEY,
    DB_PENDING,
    DB_SYS,
    DB_TOMB,
    DB_UNCLOSED,
    DB_UPLOAD,
    MAX_DBS,
    MIGRATIONS,
    SCHEMA_VERSION,
    SYS_NEXT_SEQ,
    SYS_NEXT_TOMB,
    SYS_NODE,
    SYS_SCHEMA,
    U64,
    U64X2,
    SchemaError,
    is_hashed,
    key_bytes,
    migrate,
    u64,
)

log = logging.getLogger(__name__)


#: disk space the metadata file holds from the start, so that creates, deletes and
#: promotions still record themselves when the cache disk fills up with data
RESERVE_BYTES = 64 << 20


def _encode_now(record: dict[str, Any] | list[Any]) -> bytes | None:
    """An inode record of any schema as schema 5 stores it (None: it is; a
    migration cut short leaves some records so, and the next one sees them)."""
    if isinstance(record, list) and isinstance(record[1], int):
        return None
    return Inode.from_json(record).encode()


def _reserve(data_file: Path, size: int) -> None:
    """Give the LMDB file ``size`` bytes of real blocks (it grows by writes
    into a sparse file, which fail with ENOSPC on a full disk)."""
    try:
        if data_file.stat().st_size >= size:
            return
        fd = os.open(data_file, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot reserve %d MiB for metadata in %s: %s", size >> 20, data_file,
                    exc.strerror)


#: an LMDB database handle (``Environment.open_db``); lmdb names its type only
#: privately (``_Database``), which aifs does not import
Database = Any


class Txn(Protocol):
    """What the primitives below use of a transaction: lmdb's own (opened
    without ``buffers``: values are bytes) or a
    :class:`aifs.meta.batches.Writing`, which materializes batches first."""

    def get(self, key: bytes, default: None = None,
            db: Database | None = None) -> bytes | None: ...

    def put(self, key: bytes, value: bytes, *, db: Database | None = None) -> bool: ...

    def delete(self, key: bytes, value: bytes = b"", *,
               db: Database | None = None) -> bool: ...

    def cursor(self, db: Database | None = None) -> lmdb.Cursor[bytes]: ...


class StoreBase:
    # -- the environment -----------------------------------------------------------
    def __init__(self, path: Path, map_size: int = 1 << 36) -> None:
        self._settled_at: dict[int, float] = {}  # ino -> when it reached the lake
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.env = self._open(path, map_size)
        self.inodes = self.env.open_db(DB_INODE)
        self.dentries = self.env.open_db(DB_DENTRY)
        self.cookies = self.env.open_db(DB_COOKIE)
        self.objkeys = self.env.open_db(DB_OBJKEY)
        self.pendings = self.env.open_db(DB_PENDING)
        self.tombs = self.env.open_db(DB_TOMB)
        self.uploads = self.env.open_db(DB_UPLOAD)
        self.markers = self.env.open_db(DB_MARKER)
        self.link_groups = self.env.open_db(DB_LINK)
        self.unclosed_db = self.env.open_db(DB_UNCLOSED)
        self.sys = self.env.open_db(DB_SYS)
        with self.env.begin(write=True) as txn:
            txn.put(SYS_SCHEMA, SCHEMA_VERSION, db=self.sys)
            if txn.get(u64(ROOT_INO), db=self.inodes) is None:
                root = Inode(ROOT_INO, DIR, "", ROOT_INO, attrs_known=True)
                txn.put(u64(ROOT_INO), root.encode(), db=self.inodes)

    @staticmethod
    def _open(path: Path, map_size: int) -> lmdb.Environment:
        env = lmdb.open(str(path), map_size=map_size, max_dbs=MAX_DBS, subdir=True,
                        readahead=False, sync=False, metasync=False)
        _reserve(path / "data.mdb", RESERVE_BYTES)
        sys_db = env.open_db(DB_SYS)
        with env.begin(db=sys_db) as txn:
            version = txn.get(SYS_SCHEMA)
        if version is not None:
            version = bytes(version)
        if version is not None and version != SCHEMA_VERSION:
            if version not in MIGRATIONS:
                env.close()
                raise SchemaError(
                    f"metadata in {path} has schema {version.decode(errors='replace')}, "
                    f"which this aifs cannot read (it reads {SCHEMA_VERSION.decode()}); "
                    "nothing was changed: mount it with the aifs that wrote it")
            migrate(env, version, _encode_now)
        return env

    def node_id(self) -> str:
        """A name for this cache directory, made once: packs and journals carry it."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(SYS_NODE, db=self.sys)
            if raw is None:
                raw = uuid.uuid4().hex[:12].encode()
                txn.put(SYS_NODE, raw, db=self.sys)
        return bytes(raw).decode()

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    def sync(self) -> None:
        """Make every commit so far durable on the local disk."""
        self.env.sync(True)

    # -- primitives: inside the caller's transaction, never opening one ------------
    def _children(self, parent: int,
                  txn: Txn | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(name, dentry value) of every child of ``parent`` that has records
        (in a write transaction, every child: a batch is materialized first;
        readers add ``_virtual_children``)."""
        prefix = u64(parent)
        own: lmdb.Transaction[bytes] | None = None
        if txn is None:
            txn = own = self.env.begin()
        txn = self._materialized(txn, parent)
        try:
            cursor = txn.cursor(db=self.dentries)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    yield bytes(key[8:]), bytes(value)
        finally:
            if own is not None:
                own.abort()

    def _materialized(self, txn: Txn, parent: int) -> Txn:
        """In a write transaction: ``parent``'s batch made records (see
        :mod:`aifs.meta.batches`, which overrides this); the raw transaction."""
        return txn

    def _counter(self, txn: Txn, name: bytes, start: int) -> int:
        raw = txn.get(name, db=self.sys)
        value = U64.unpack(raw)[0] if raw else start
        txn.put(name, u64(value + 1), db=self.sys)
        return value

    def _put(self, txn: Txn, inode: Inode) -> None:
        key = u64(inode.ino)
        txn.put(key, inode.encode_stored(), db=self.inodes)
        if inode.pending and not inode.orphan:
            if not txn.get(key, db=self.pendings):  # newly pending: next in order
                txn.put(key, u64(self._counter(txn, SYS_NEXT_SEQ, 1)), db=self.pendings)
        else:
            txn.delete(key, db=self.pendings)

    def _tomb(self, txn: Txn, key: str, ino: int) -> None:
        """Tombstone ``key``: the value is the inode, a number that changes
        each time and, for a long key stored hashed, the whole key."""
        raw = key_bytes(key)
        value = u64(ino) + u64(self._counter(txn, SYS_NEXT_TOMB, 1))
        if is_hashed(raw):
            value += key.encode("utf-8", "surrogateescape")
        txn.put(raw, value, db=self.tombs)

    def _entry_of(self, txn: Txn, inode: Inode) -> tuple[bytes, bytes] | None:
        """(name, dentry value) of ``inode`` in its parent, found by its key."""
        name = inode.name
        value = txn.get(u64(inode.parent) + name, db=self.dentries)
        if value is None or U64X2.unpack(value[:16])[0] != inode.ino:
            return None
        return name, bytes(value)

    def _remove_dentry(self, txn: Txn, parent: int, name: bytes,
                       value: bytes) -> None:
        _, cookie = U64X2.unpack(value[:16])
        txn.delete(u64(parent) + name, db=self.dentries)
        txn.delete(u64(parent) + u64(cookie), db=self.cookies)

    def _remove(self, txn: Txn, parent: int, name: bytes, value: bytes,
                tomb: bool) -> Inode | None:
        ino, cookie = U64X2.unpack(value[:16])
        txn.delete(u64(parent) + name, db=self.dentries)
        txn.delete(u64(parent) + u64(cookie), db=self.cookies)
        raw = txn.get(u64(ino), db=self.inodes)
        if not raw:
            return None
        inode = Inode.decode(raw)
        if inode.links:
            self._drop_name(txn, inode, self._key_of(txn, parent, name), tomb)
            return inode
        if inode.is_dir:  # (its batched files are found by its key: records first)
            self._materialized(txn, ino)
        objkey = key_bytes(inode.key)
        if txn.get(objkey, db=self.objkeys) == u64(ino):
            txn.delete(objkey, db=self.objkeys)
            if tomb and (inode.in_lake or (inode.is_dir and not inode.pending & META)):
                self._tomb(txn, inode.key, ino)
        inode.orphan = True
        self._put(txn, inode)
        return inode

    def _key_of(self, txn: Txn, parent: int, name: bytes) -> str:
        """The lake key of a non-directory ``name`` in ``parent``."""
        raw = txn.get(u64(parent), db=self.inodes)
        assert raw is not None  # (a name's directory has a record)
        directory = Inode.decode(raw)
        return directory.key + name.decode("utf-8", "surrogateescape")

    def _drop_name(self, txn: Txn, inode: Inode, key: str, tomb: bool) -> None:
        """One name of a hard-linked inode is gone (its dentry already): the
        inode keeps the others; the first left becomes its primary key."""
        if key == inode.key:
            inode.parent, inode.key = inode.links.pop(0)
        else:
            inode.links = [link for link in inode.links if link[1] != key]
        raw = key_bytes(key)
        if txn.get(raw, db=self.objkeys) == u64(inode.ino):
            txn.delete(raw, db=self.objkeys)
        if tomb:
            self._tomb(txn, key, 0)
        inode.nlink_hint = 0
        inode.ctime = time.time()
        inode.pending |= META  # each object's metadata says how many names are left
        self._put(txn, inode)

    def _drop_markers(self, txn: Txn, ino: int, up_to: int | None) -> None:
        cursor = txn.cursor(db=self.markers)
        if not cursor.set_range(u64(ino)):
            return
        while cursor.key()[:8] == u64(ino):
            if up_to is not None and U64.unpack(cursor.key()[8:])[0] > up_to:
                break
            if not cursor.delete():
                break

    def _delete_tree(self, txn: Txn, ino: int) -> None:
        self._drop_markers(txn, ino, None)
        raw = txn.get(u64(ino), db=self.inodes)
        if not raw:
            return
        inode = Inode.decode(raw)
        if inode.is_dir:
            for name, value in list(self._children(ino, txn)):
                child = self._remove(txn, ino, name, value, tomb=False)
                if child is not None and not child.orphan:
                    continue  # a hard-linked file: it lives on by its other names
                self._delete_tree(txn, U64X2.unpack(value[:16])[0])
        txn.delete(u64(ino), db=self.inodes)
        txn.delete(u64(ino), db=self.pendings)
