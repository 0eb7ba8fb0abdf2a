"""LMDB metadata store: a node's fast index of the lake.

Every method is synchronous and runs one transaction; nothing awaits inside a
transaction. Deleting the store costs a re-listing, never data.

Key schema (integers are unsigned 64-bit big-endian, so keys sort numerically):

=========  ===============================  ==========================================
database   key                              value
=========  ===============================  ==========================================
inode      ino                              Inode record (JSON)
dentry     parent ino ++ name bytes         child ino ++ cookie
cookie     parent ino ++ cookie             name bytes (readdir order: stable offsets)
objkey     lake key, UTF-8 (dirs end "/")   ino (the same key keeps its number)
sys        b"next_ino" / b"next_cookie"     u64 counters
           b"schema"                        schema version
=========  ===============================  ==========================================

A lookup is one get in ``dentry``; readdir is a range scan of ``cookie`` from
the last cookie the kernel saw, so entries added or removed meanwhile never
shift the others. Cookies are allocated from one counter and never reused.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb

ROOT_INO = 1
FILE = "file"
DIR = "dir"
SCHEMA_VERSION = b"1"
_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")


def u64(value: int) -> bytes:
    return _U64.pack(value)


def valid_name(name: str) -> bool:
    """Whether a lake key component can be a POSIX file name."""
    raw = name.encode("utf-8", "surrogateescape")
    return bool(raw) and name not in (".", "..") and len(raw) <= 255 and "\0" not in name


@dataclass
class Inode:
    ino: int
    kind: str
    key: str
    parent: int
    size: int = 0
    etag: str = ""
    mtime: float = 0.0
    mode: int = 0
    uid: int = -1
    gid: int = -1
    listed_at: float = 0.0
    orphan: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Inode:
        return cls(**json.loads(raw))

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR


@dataclass(frozen=True)
class Listed:
    """One child of a directory as a LIST reported it."""

    name: str
    kind: str
    key: str
    size: int = 0
    etag: str = ""
    mtime: float = 0.0


class MetaStore:
    def __init__(self, path: Path, map_size: int = 1 << 36) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=8, subdir=True,
                             readahead=False)
        self.inodes = self.env.open_db(b"inode")
        self.dentries = self.env.open_db(b"dentry")
        self.cookies = self.env.open_db(b"cookie")
        self.objkeys = self.env.open_db(b"objkey")
        self.sys = self.env.open_db(b"sys")
        with self.env.begin(write=True) as txn:
            version = txn.get(b"schema", db=self.sys)
            if version not in (None, SCHEMA_VERSION):
                raise RuntimeError(f"metadata schema {version!r} is not {SCHEMA_VERSION!r}")
            txn.put(b"schema", SCHEMA_VERSION, db=self.sys)
            if txn.get(u64(ROOT_INO), db=self.inodes) is None:
                root = Inode(ROOT_INO, DIR, "", ROOT_INO)
                txn.put(u64(ROOT_INO), root.encode(), db=self.inodes)

    def close(self) -> None:
        self.env.close()

    # -- reads ------------------------------------------------------------
    def get(self, ino: int) -> Inode | None:
        with self.env.begin() as txn:
            raw = txn.get(u64(ino), db=self.inodes)
        return Inode.decode(raw) if raw else None

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        with self.env.begin() as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
            if value is None:
                return None
            raw = txn.get(value[:8], db=self.inodes)
        return Inode.decode(raw) if raw else None

    def readdir(self, parent: int, after_cookie: int,
                limit: int) -> list[tuple[int, bytes, Inode]]:
        """Up to ``limit`` children with cookie > ``after_cookie``, in cookie order."""
        out: list[tuple[int, bytes, Inode]] = []
        prefix = u64(parent)
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.cookies)
            if not cursor.set_range(prefix + u64(after_cookie + 1)):
                return out
            for key, name in cursor:
                if not key.startswith(prefix) or len(out) >= limit:
                    break
                value = txn.get(prefix + name, db=self.dentries)
                raw = txn.get(value[:8], db=self.inodes) if value else None
                if raw:
                    out.append((_U64.unpack(key[8:])[0], bytes(name), Inode.decode(raw)))
        return out

    def children_count(self, parent: int) -> int:
        prefix = u64(parent)
        count = 0
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.dentries)
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    count += 1
        return count

    # -- writes -----------------------------------------------------------
    def _counter(self, txn: lmdb.Transaction, name: bytes, start: int) -> int:
        raw = txn.get(name, db=self.sys)
        value = _U64.unpack(raw)[0] if raw else start
        txn.put(name, u64(value + 1), db=self.sys)
        return value

    def apply_listing(self, parent: int, listed: Iterable[Listed],
                      now: float | None = None) -> list[int]:
        """Make ``parent``'s children match a fresh LIST; return inodes removed.

        Removed inodes stay as orphans until the kernel forgets them.
        """
        prefix = u64(parent)
        removed: list[int] = []
        with self.env.begin(write=True) as txn:
            existing: dict[bytes, bytes] = {}
            cursor = txn.cursor(db=self.dentries)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    existing[bytes(key[8:])] = bytes(value)
            for entry in listed:
                name = entry.name.encode("utf-8", "surrogateescape")
                value = existing.pop(name, None)
                if value is not None:
                    current = Inode.decode(txn.get(value[:8], db=self.inodes))
                    if current.kind == entry.kind:
                        if (current.size, current.etag, current.mtime, current.key) != (
                                entry.size, entry.etag, entry.mtime, entry.key):
                            current.size, current.etag = entry.size, entry.etag
                            current.mtime, current.key = entry.mtime, entry.key
                            txn.put(value[:8], current.encode(), db=self.inodes)
                        continue
                    removed.append(self._unlink(txn, parent, name, value))
                self._link(txn, parent, name, entry)
            for name, value in existing.items():
                removed.append(self._unlink(txn, parent, name, value))
            raw = txn.get(prefix, db=self.inodes)
            if raw:
                dir_inode = Inode.decode(raw)
                dir_inode.listed_at = time.time() if now is None else now
                txn.put(prefix, dir_inode.encode(), db=self.inodes)
        return removed

    def _link(self, txn: lmdb.Transaction, parent: int, name: bytes, entry: Listed) -> int:
        objkey = entry.key.encode("utf-8", "surrogateescape")
        raw_ino = txn.get(objkey, db=self.objkeys)
        ino = _U64.unpack(raw_ino)[0] if raw_ino else self._counter(txn, b"next_ino", 2)
        cookie = self._counter(txn, b"next_cookie", 1)
        inode = Inode(ino, entry.kind, entry.key, parent, entry.size, entry.etag, entry.mtime)
        txn.put(u64(ino), inode.encode(), db=self.inodes)
        txn.put(u64(parent) + name, _U64x2.pack(ino, cookie), db=self.dentries)
        txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
        txn.put(objkey, u64(ino), db=self.objkeys)
        return ino

    def _unlink(self, txn: lmdb.Transaction, parent: int, name: bytes, value: bytes) -> int:
        ino, cookie = _U64x2.unpack(value[:16])
        txn.delete(u64(parent) + name, db=self.dentries)
        txn.delete(u64(parent) + u64(cookie), db=self.cookies)
        raw = txn.get(u64(ino), db=self.inodes)
        if raw:
            inode = Inode.decode(raw)
            txn.delete(inode.key.encode("utf-8", "surrogateescape"), db=self.objkeys)
            inode.orphan = True
            txn.put(u64(ino), inode.encode(), db=self.inodes)
        return ino

    def delete_orphan(self, ino: int) -> None:
        """Drop an orphan's record (and, for a directory, its subtree)."""
        with self.env.begin(write=True) as txn:
            self._delete_tree(txn, ino)

    def _delete_tree(self, txn: lmdb.Transaction, ino: int) -> None:
        raw = txn.get(u64(ino), db=self.inodes)
        if not raw:
            return
        inode = Inode.decode(raw)
        if inode.is_dir:
            prefix = u64(ino)
            children: list[tuple[bytes, bytes]] = []
            cursor = txn.cursor(db=self.dentries)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    children.append((bytes(key[8:]), bytes(value)))
            for name, value in children:
                child = self._unlink(txn, ino, name, value)
                self._delete_tree(txn, child)
        txn.delete(u64(ino), db=self.inodes)

    def purge_orphans(self) -> int:
        """At mount time no kernel reference exists: drop every orphan."""
        with self.env.begin(write=True) as txn:
            orphans = [Inode.decode(v).ino for _, v in txn.cursor(db=self.inodes)
                       if b'"orphan":true' in v]
            for ino in orphans:
                self._delete_tree(txn, ino)
        return len(orphans)

    def expire_all(self) -> None:
        """Mark every directory listing stale (for a remount after a long pause)."""
        with self.env.begin(write=True) as txn:
            updates = []
            for key, raw in txn.cursor(db=self.inodes):
                inode = Inode.decode(raw)
                if inode.is_dir and inode.listed_at:
                    inode.listed_at = 0.0
                    updates.append((bytes(key), inode.encode()))
            for key, raw in updates:
                txn.put(key, raw, db=self.inodes)
