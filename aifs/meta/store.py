"""LMDB metadata store: a node's fast index of the lake plus its own dirty state.

Every method is synchronous and runs one transaction; nothing awaits inside a
transaction. Deleting the store costs a re-listing and whatever was dirty.

Key schema (integers are unsigned 64-bit big-endian, so keys sort numerically):

=========  ===============================  ==========================================
database   key                              value
=========  ===============================  ==========================================
inode      ino                              Inode record (JSON)
dentry     parent ino ++ name bytes         child ino ++ cookie
cookie     parent ino ++ cookie             name bytes (readdir order: stable offsets)
objkey     lake key, UTF-8 (dirs end "/")   ino of the live inode that owns the key
pending    ino                              u64 sequence number: the inode has local
                                            state not yet in the lake (``Inode.pending``
                                            says which) since that point in the order
                                            of changes (commit markers wait for older)
tomb       lake key                         ino whose object must be deleted from the
                                            lake (0: none) ++ u64 serial (a key
                                            tombstoned again is told apart); hidden
                                            from listings
upload     ino ++ lake key                  JSON {key, upload_id, started}: a multipart
                                            upload in progress (aborted after a crash)
marker     ino ++ u64 sequence number       content of a commit marker as one close left
                                            it (published once what it commits is in)
link       hard-link group id (UTF-8)       u64 ino that holds the group's names here
                                            (a fresh node joins names it finds by it)
unclosed   ino                              b"": written through a handle since its last
                                            close or fsync (after a crash: not published)
sys        b"next_ino" / b"next_cookie"     u64 counters
           b"next_seq" / b"next_tomb"
           b"next_outbox"
           b"node"                          this cache directory's node id (packs)
           b"schema"                        schema version
=========  ===============================  ==========================================

The pack index (``packed``, ``packmember``, ``pack``, ``journal``, ``outbox``)
lives in the same environment; its table is in :mod:`aifs.meta.packindex`.

A lookup is one get in ``dentry``; readdir is a range scan of ``cookie`` from
the last cookie the kernel saw, so entries added or removed meanwhile never
shift the others. Cookies are allocated from one counter and never reused.
The environment is opened without fsync per commit (a killed daemon loses
nothing: commits are in the page cache); ``sync()`` makes it durable.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import lmdb
import xxhash

from aifs.errors import AifsError

log = logging.getLogger(__name__)

# JSON without spaces; one encoder for all (json.dumps with options builds one per call)
compact_json = json.JSONEncoder(separators=(",", ":")).encode

ROOT_INO = 1
FILE = "file"
DIR = "dir"
LINK = "symlink"
FIFO = "fifo"
CHR = "chr"
BLK = "blk"
SOCK = "sock"
#: kinds without content: their object (s3fs's form) is empty, the type is in ``mode``
SPECIAL = (FIFO, CHR, BLK, SOCK)
SCHEMA_VERSION = b"3"
#: what each older schema needs to become the current one (see ``_migrate``)
MIGRATIONS = {b"2": "mode 0 meant 'the default for the kind': that is -1 now"}
_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")

#: ``Inode.pending`` flags: what of the inode the lake does not have yet
DATA = 1  # the local copy (or symlink target) is newer than the lake object
META = 2  # attributes or xattrs are newer (for a directory: its marker object)
#: ``Inode.etag`` of a new inode whose key may still hold an older object
MAYBE_IN_LAKE = "?"


def u64(value: int) -> bytes:
    return _U64.pack(value)


def valid_name(name: str) -> bool:
    """Whether a lake key component can be a POSIX file name."""
    raw = name.encode("utf-8", "surrogateescape")
    return bool(raw) and name not in (".", "..") and len(raw) <= 255 and "\0" not in name


#: LMDB keys hold at most 511 bytes; a lake key may be PATH_MAX long. Longer
#: keys are stored as their first KEY_KEPT bytes, a NUL (never in a valid key)
#: and their xxh3-128; where keys are listed, the value carries the whole key.
KEY_KEPT = 400
KEY_RAW_MAX = 480


def key_bytes(key: str) -> bytes:
    raw = key.encode("utf-8", "surrogateescape")
    if len(raw) <= KEY_RAW_MAX:
        return raw
    return raw[:KEY_KEPT] + b"\0" + xxhash.xxh3_128_digest(raw)


def is_hashed(raw_key: bytes) -> bool:
    return len(raw_key) > KEY_KEPT and raw_key[KEY_KEPT:KEY_KEPT + 1] == b"\0"


def scan_prefix(prefix: str) -> bytes:
    """The bytes a range scan for keys starting with ``prefix`` starts from
    (and each found key starts with); long prefixes need a check of the
    whole key after."""
    return prefix.encode("utf-8", "surrogateescape")[:KEY_KEPT]


DECODED_KEPT = 16384


class SchemaError(AifsError):
    """The store was written by an aifs whose schema this one cannot migrate."""


def _migrate(env: lmdb.Environment, version: bytes) -> None:
    """Bring a store of an older schema up to date in one transaction: every
    record is kept (dirty data above all), only its form changes."""
    log.info("metadata schema %s -> %s: %s", version.decode(), SCHEMA_VERSION.decode(),
             MIGRATIONS[version])
    inodes = env.open_db(b"inode")
    sys_db = env.open_db(b"sys")
    with env.begin(write=True) as txn:
        updates = []
        for key, raw in txn.cursor(db=inodes):
            record = json.loads(bytes(raw))
            if record.get("mode", 0) == 0:
                record["mode"] = -1
                updates.append((bytes(key), compact_json(record).encode()))
        for key, raw in updates:
            txn.put(key, raw, db=inodes)
        txn.put(b"schema", SCHEMA_VERSION, db=sys_db)


@dataclass
class Inode:
    ino: int
    kind: str
    key: str
    parent: int
    size: int = 0
    etag: str = ""  # the lake version this inode's content came from ("" none)
    mtime_ns: int = 0
    atime_ns: int = 0  # 0: as mtime (never set explicitly)
    rdev: int = 0  # device number of a character or block device
    mode: int = -1  # permission bits (with set-ID and sticky); -1: the default for the kind
    uid: int = -1  # -1: the mounting user
    gid: int = -1
    listed_at: float = 0.0
    orphan: bool = False
    ctime: float = 0.0  # wall time of the last local change (listings never undo it)
    attrs_known: bool = False  # mode/owner/xattrs/kind read from the object (or local)
    pending: int = 0  # DATA | META
    target: str = ""  # symlink target
    pinned: bool = False  # node-local: kept in the cache (aifs pin), inherited below a dir
    pack: str = ""  # packed: the id of the pack object that holds the bytes ("" plain)
    pack_offset: int = 0  # ... where in the pack they start
    checksum: str = ""  # ... and their xxh3, verified on every read from the lake
    xattrs: dict[str, str] = field(default_factory=dict)  # user.* name -> base64 value
    #: hard links: [parent ino, lake key] of each name besides (parent, key)
    links: list[list] = field(default_factory=list)
    link_id: str = ""  # the names' group id, in each name's object metadata
    nlink_hint: int = 0  # st_nlink the lake's metadata told, before all names were seen

    def encode(self) -> bytes:
        """The record as stored: fields at their defaults are left out (most
        are, for a listed object: a third of the bytes of a full record), and
        ``decode`` gives them back."""
        return compact_json({name: value for name, value in self.__dict__.items()
                             if name not in _INODE_DEFAULTS
                             or value != _INODE_DEFAULTS[name]}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Inode:
        """The record as an Inode of its own (callers change it freely).

        Decoded records are remembered by their bytes: the same record is read
        many times (a lookup, an open, a release), and a copy costs a fraction
        of parsing the JSON again."""
        key = bytes(raw)
        known = _DECODED.get(key)
        if known is None:
            known = cls(**json.loads(key))
            if len(_DECODED) >= DECODED_KEPT:  # the older half goes, the recent stay
                for old in list(itertools.islice(_DECODED, DECODED_KEPT // 2)):
                    del _DECODED[old]
            _DECODED[key] = known
        inode = cls.__new__(cls)
        inode.__dict__.update(known.__dict__)
        if known.xattrs:
            inode.xattrs = dict(known.xattrs)
        if known.links:
            inode.links = [list(link) for link in known.links]
        return inode

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    @property
    def nlink(self) -> int:
        """Names of a non-directory (0 once unlinked and still open)."""
        if self.orphan:
            return 0
        return max(1 + len(self.links), self.nlink_hint)

    def keys(self) -> list[str]:
        """Every lake key of the inode's names, the primary first."""
        return [self.key] + [key for _, key in self.links]

    @property
    def packed(self) -> bool:
        """Whether the lake holds this file's bytes in a pack (not an object)."""
        return bool(self.pack)

    @property
    def in_lake(self) -> bool:
        """Whether an object may exist under this inode's key."""
        return bool(self.etag)


_DECODED: dict[bytes, Inode] = {}
#: fields left out of a stored record when they hold these values
_INODE_DEFAULTS: dict[str, object] = {
    f.name: f.default_factory() if f.default_factory is not MISSING else f.default
    for f in fields(Inode) if f.default is not MISSING or f.default_factory is not MISSING}


def _tomb_key(raw_key: bytes, value: bytes) -> str:
    """The lake key of a tombstone record (whole, also where stored hashed)."""
    raw = bytes(value[16:]) if is_hashed(bytes(raw_key)) else bytes(raw_key)
    return raw.decode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class Listed:
    """One child of a directory as a LIST reported it."""

    name: str
    kind: str
    key: str
    size: int = 0
    etag: str = ""
    mtime: float = 0.0
    #: further inode fields a packed file's listing knows (pack, owner, mode ...)
    fields: dict[str, object] | None = None


#: disk space the metadata file holds from the start, so that creates, deletes and
#: promotions still record themselves when the cache disk fills up with data
RESERVE_BYTES = 64 << 20


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


class MetaStore:
    def __init__(self, path: Path, map_size: int = 1 << 36) -> None:
        self._settled_at: dict[int, float] = {}  # ino -> when it reached the lake
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.env = self._open(path, map_size)
        self.inodes = self.env.open_db(b"inode")
        self.dentries = self.env.open_db(b"dentry")
        self.cookies = self.env.open_db(b"cookie")
        self.objkeys = self.env.open_db(b"objkey")
        self.pendings = self.env.open_db(b"pending")
        self.tombs = self.env.open_db(b"tomb")
        self.uploads = self.env.open_db(b"upload")
        self.markers = self.env.open_db(b"marker")
        self.link_groups = self.env.open_db(b"link")
        self.unclosed_db = self.env.open_db(b"unclosed")
        self.sys = self.env.open_db(b"sys")
        with self.env.begin(write=True) as txn:
            txn.put(b"schema", SCHEMA_VERSION, db=self.sys)
            if txn.get(u64(ROOT_INO), db=self.inodes) is None:
                root = Inode(ROOT_INO, DIR, "", ROOT_INO, attrs_known=True)
                txn.put(u64(ROOT_INO), root.encode(), db=self.inodes)

    @staticmethod
    def _open(path: Path, map_size: int) -> lmdb.Environment:
        env = lmdb.open(str(path), map_size=map_size, max_dbs=20, subdir=True,
                        readahead=False, sync=False, metasync=False)
        _reserve(path / "data.mdb", RESERVE_BYTES)
        sys_db = env.open_db(b"sys")
        with env.begin(db=sys_db) as txn:
            version = txn.get(b"schema")
        if version is not None:
            version = bytes(version)
        if version not in (None, SCHEMA_VERSION):
            if version not in MIGRATIONS:
                env.close()
                raise SchemaError(
                    f"metadata in {path} has schema {version.decode(errors='replace')}, "
                    f"which this aifs cannot read (it reads {SCHEMA_VERSION.decode()}); "
                    "nothing was changed: mount it with the aifs that wrote it")
            _migrate(env, version)
        return env

    def node_id(self) -> str:
        """A name for this cache directory, made once: packs and journals carry it."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(b"node", db=self.sys)
            if raw is None:
                raw = uuid.uuid4().hex[:12].encode()
                txn.put(b"node", raw, db=self.sys)
        return bytes(raw).decode()

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    def sync(self) -> None:
        """Make every commit so far durable on the local disk."""
        self.env.sync(True)

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

    def cookie_of(self, parent: int, name: bytes) -> int | None:
        """The readdir cookie of entry ``name`` of ``parent`` (None: no such entry)."""
        with self.env.begin() as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
        return _U64x2.unpack(value[:16])[1] if value else None

    def exists(self, parent: int, name: bytes) -> bool:
        with self.env.begin() as txn:
            return txn.get(u64(parent) + name, db=self.dentries) is not None

    def owner_of(self, key: str) -> int | None:
        """The live inode that owns lake key ``key``, if any."""
        with self.env.begin() as txn:
            raw = txn.get(key_bytes(key), db=self.objkeys)
        return _U64.unpack(raw)[0] if raw else None

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

    def subtree_files(self, ino: int) -> Iterator[Inode]:
        """Every known non-directory inode at or below ``ino``."""
        stack = [ino]
        while stack:
            current = stack.pop()
            with self.env.begin() as txn:  # closed before yielding: callers may write
                raw = txn.get(u64(current), db=self.inodes)
                inode = Inode.decode(raw) if raw else None
                if inode is not None and inode.is_dir:
                    stack += [_U64.unpack(value[:8])[0]
                              for _, value in self._children(current, txn)]
            if inode is not None and not inode.is_dir:
                yield inode

    def subdir_count(self, parent: int) -> int:
        """How many children of ``parent`` are directories."""
        dir_kind = b'"kind":"dir"'
        with self.env.begin() as txn:
            count = 0
            for _, value in self._children(parent, txn):
                raw = txn.get(value[:8], db=self.inodes)
                if raw is not None and dir_kind in raw:
                    count += 1
        return count

    def children_count(self, parent: int) -> int:
        return sum(1 for _ in self._children(parent))

    def _children(self, parent: int,
                  txn: lmdb.Transaction | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(name, dentry value) of every child of ``parent``."""
        prefix = u64(parent)
        own = txn is None
        txn = txn or self.env.begin()
        try:
            cursor = txn.cursor(db=self.dentries)
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if not key.startswith(prefix):
                        break
                    yield bytes(key[8:]), bytes(value)
        finally:
            if own:
                txn.abort()

    def pending_inodes(self) -> list[Inode]:
        """Every inode with local state not yet in the lake."""
        with self.env.begin() as txn:
            out = []
            for key in txn.cursor(db=self.pendings).iternext(keys=True, values=False):
                raw = txn.get(key, db=self.inodes)
                if raw:
                    out.append(Inode.decode(raw))
        return out

    def tombstones(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {_tomb_key(k, v): _U64.unpack(v[:8])[0] for k, v in txn.cursor(db=self.tombs)}

    def tombstone_marks(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The stored values of some tombstones, to drop them later only if no
        one tombstoned the key again meanwhile (see :meth:`drop_tombstones`)."""
        with self.env.begin() as txn:
            return {key: bytes(txn.get(key_bytes(key), db=self.tombs) or b"") for key in keys}

    def drop_tombstones(self, marks: dict[str, bytes]) -> None:
        """Drop tombstones whose value is still the one in ``marks``: a key
        tombstoned again while its delete ran (an upload that landed after
        the delete) keeps its new tombstone."""
        with self.env.begin(write=True) as txn:
            for key, mark in marks.items():
                if txn.get(key_bytes(key), db=self.tombs) == mark:
                    txn.delete(key_bytes(key), db=self.tombs)

    def tombstoned(self, key: str) -> bool:
        with self.env.begin() as txn:
            return txn.get(key_bytes(key), db=self.tombs) is not None

    def tombstones_under(self, prefix: str) -> dict[str, int]:
        raw = scan_prefix(prefix)
        out = {}
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.tombs)
            if cursor.set_range(raw):
                for key, value in cursor:
                    if not key.startswith(raw):
                        break
                    full = _tomb_key(key, value)
                    if full.startswith(prefix):
                        out[full] = _U64.unpack(value[:8])[0]
        return out

    def uploads_in_progress(self) -> list[tuple[int, str, str, float]]:
        """(ino, key, upload id or "" if not known, wall time it started)."""
        with self.env.begin() as txn:
            out = []
            for k, v in txn.cursor(db=self.uploads):
                record = json.loads(v)
                out.append((_U64.unpack(k[:8])[0], record["key"], record["upload_id"],
                            record.get("started", 0.0)))
        return out

    # -- writes -----------------------------------------------------------
    def _counter(self, txn: lmdb.Transaction, name: bytes, start: int) -> int:
        raw = txn.get(name, db=self.sys)
        value = _U64.unpack(raw)[0] if raw else start
        txn.put(name, u64(value + 1), db=self.sys)
        return value

    def _put(self, txn: lmdb.Transaction, inode: Inode) -> None:
        key = u64(inode.ino)
        txn.put(key, inode.encode(), db=self.inodes)
        if inode.pending and not inode.orphan:
            if not txn.get(key, db=self.pendings):  # newly pending: next in order
                txn.put(key, u64(self._counter(txn, b"next_seq", 1)), db=self.pendings)
        else:
            txn.delete(key, db=self.pendings)

    def pending_set(self) -> set[int]:
        """The inodes with local state not yet in the lake (no record decoded)."""
        with self.env.begin() as txn:
            return {_U64.unpack(k)[0]
                    for k in txn.cursor(db=self.pendings).iternext(keys=True, values=False)}

    def pending_order(self) -> dict[int, int]:
        """ino -> sequence number of when it became pending (lower: earlier)."""
        with self.env.begin() as txn:
            return {_U64.unpack(k)[0]: _U64.unpack(v)[0] if len(v) == 8 else 0
                    for k, v in txn.cursor(db=self.pendings)}

    def renew_order(self, ino: int, content: bytes | None = None) -> int | None:
        """Count a pending inode as changed now (a commit marker closed or
        renamed); keep ``content`` as that version of the marker. Returns its
        new sequence number (None if it is not pending)."""
        with self.env.begin(write=True) as txn:
            if txn.get(u64(ino), db=self.pendings) is None:
                return None
            seq = self._counter(txn, b"next_seq", 1)
            txn.put(u64(ino), u64(seq), db=self.pendings)
            if content is not None:
                txn.put(u64(ino) + u64(seq), content, db=self.markers)
        return seq

    def marker_versions(self, ino: int) -> list[tuple[int, bytes]]:
        """(sequence number, content) of the kept versions of a marker, oldest first."""
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.markers)
            out = []
            if cursor.set_range(u64(ino)):
                for key, value in cursor:
                    if key[:8] != u64(ino):
                        break
                    out.append((_U64.unpack(key[8:])[0], bytes(value)))
        return out

    def drop_marker_versions(self, ino: int, up_to: int | None = None) -> None:
        """Forget kept versions of a marker (those up to sequence ``up_to``; all)."""
        with self.env.begin(write=True) as txn:
            self._drop_markers(txn, ino, up_to)

    def _drop_markers(self, txn: lmdb.Transaction, ino: int, up_to: int | None) -> None:
        cursor = txn.cursor(db=self.markers)
        if not cursor.set_range(u64(ino)):
            return
        while cursor.key()[:8] == u64(ino):
            if up_to is not None and _U64.unpack(cursor.key()[8:])[0] > up_to:
                break
            if not cursor.delete():
                break

    def _tomb(self, txn: lmdb.Transaction, key: str, ino: int) -> None:
        """Tombstone ``key``: the value is the inode, a number that changes
        each time and, for a long key stored hashed, the whole key."""
        raw = key_bytes(key)
        value = u64(ino) + u64(self._counter(txn, b"next_tomb", 1))
        if is_hashed(raw):
            value += key.encode("utf-8", "surrogateescape")
        txn.put(raw, value, db=self.tombs)

    def put(self, inode: Inode) -> None:
        """Store an inode record as it is (and index its pending state)."""
        with self.env.begin(write=True) as txn:
            self._put(txn, inode)

    def update(self, ino: int, **changes: object) -> Inode | None:
        """Change some fields of a stored inode; return it as stored."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(u64(ino), db=self.inodes)
            if not raw:
                return None
            inode = Inode.decode(raw)
            for name, value in changes.items():
                setattr(inode, name, value)
            self._put(txn, inode)
        return inode

    def set_times(self, times: dict[int, tuple[int, float]]) -> None:
        """Set (mtime_ns, ctime) of several inodes in one transaction."""
        with self.env.begin(write=True) as txn:
            for ino, (mtime_ns, ctime) in times.items():
                raw = txn.get(u64(ino), db=self.inodes)
                if raw:
                    inode = Inode.decode(raw)
                    inode.mtime_ns, inode.ctime = mtime_ns, ctime
                    txn.put(u64(ino), inode.encode(), db=self.inodes)

    def settle(self, ino: int, expect_key: str, done: int, **changes: object) -> Inode | None:
        """After a promotion: clear ``done`` flags and apply ``changes`` if the
        inode still has key ``expect_key`` (else nothing; it moved meanwhile)."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(u64(ino), db=self.inodes)
            if not raw:
                return None
            inode = Inode.decode(raw)
            if inode.key != expect_key:
                return inode
            for name, value in changes.items():
                setattr(inode, name, value)
            inode.pending &= ~done
            self._put(txn, inode)
            self._note_settled(ino)
        return inode

    def _note_settled(self, ino: int) -> None:
        """Remember when ``ino`` reached the lake (before its transaction
        commits): a LIST that started before that may not show it yet, and
        must not take it away (see apply_listing). In memory, pruned."""
        now = time.time()
        self._settled_at[ino] = now
        if len(self._settled_at) > 100_000:
            self._settled_at = {i: t for i, t in self._settled_at.items() if t > now - 600}

    def create(self, parent: int, name: bytes, inode: Inode, unclosed: bool = False) -> Inode:
        """Add a new child ``name`` of ``parent``; ``inode.ino`` is assigned here.
        ``unclosed``: created by an open for writing (see :meth:`mark_unclosed`),
        recorded in the same transaction, so no crash can publish it half made."""
        with self.env.begin(write=True) as txn:
            objkey = key_bytes(inode.key)
            if txn.get(objkey, db=self.tombs) is not None and not inode.etag:
                inode.etag = MAYBE_IN_LAKE  # an old object there is deleted or replaced
            inode.ino = self._counter(txn, b"next_ino", 2)
            cookie = self._counter(txn, b"next_cookie", 1)
            txn.put(u64(parent) + name, _U64x2.pack(inode.ino, cookie), db=self.dentries)
            txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
            txn.put(objkey, u64(inode.ino), db=self.objkeys)
            self._put(txn, inode)
            if unclosed:
                txn.put(u64(inode.ino), b"", db=self.unclosed_db)
        return inode

    def reincarnate(self, inode: Inode) -> Inode:
        """Give an entry whose file type turned out different (a symlink object
        listed as a file) a new inode number: the kernel cannot change the
        type of an inode it knows. The old number becomes an orphan."""
        with self.env.begin(write=True) as txn:
            parent = self._entry_of(txn, inode)
            if parent is None:
                return inode
            name, value = parent
            self._remove(txn, inode.parent, name, value, tomb=False)
            inode.ino = self._counter(txn, b"next_ino", 2)
            inode.orphan = False
            cookie = self._counter(txn, b"next_cookie", 1)
            txn.put(u64(inode.parent) + name, _U64x2.pack(inode.ino, cookie), db=self.dentries)
            txn.put(u64(inode.parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(inode.key), u64(inode.ino), db=self.objkeys)
            self._put(txn, inode)
        return inode

    def _entry_of(self, txn: lmdb.Transaction, inode: Inode) -> tuple[bytes, bytes] | None:
        """(name, dentry value) of ``inode`` in its parent, found by its key."""
        name = key_bytes(inode.key.rstrip("/").rsplit("/", 1)[-1])
        value = txn.get(u64(inode.parent) + name, db=self.dentries)
        if value is None or _U64x2.unpack(value[:16])[0] != inode.ino:
            return None
        return name, bytes(value)

    def remove(self, parent: int, name: bytes) -> Inode | None:
        """Unlink ``name`` from ``parent``: the inode becomes an orphan and, if
        the lake may hold its object, that key is tombstoned."""
        with self.env.begin(write=True) as txn:
            value = txn.get(u64(parent) + name, db=self.dentries)
            if value is None:
                return None
            return self._remove(txn, parent, name, bytes(value), tomb=True)

    def _remove(self, txn: lmdb.Transaction, parent: int, name: bytes, value: bytes,
                tomb: bool) -> Inode | None:
        ino, cookie = _U64x2.unpack(value[:16])
        txn.delete(u64(parent) + name, db=self.dentries)
        txn.delete(u64(parent) + u64(cookie), db=self.cookies)
        raw = txn.get(u64(ino), db=self.inodes)
        if not raw:
            return None
        inode = Inode.decode(raw)
        if inode.links:
            self._drop_name(txn, inode, self._key_of(txn, parent, name), tomb)
            return inode
        objkey = key_bytes(inode.key)
        if txn.get(objkey, db=self.objkeys) == u64(ino):
            txn.delete(objkey, db=self.objkeys)
            if tomb and (inode.in_lake or (inode.is_dir and not inode.pending & META)):
                self._tomb(txn, inode.key, ino)
        inode.orphan = True
        self._put(txn, inode)
        return inode

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               new_key: str, tombstones: Iterable[str] = (),
               etags: dict[str, str] | None = None,
               has_local: Callable[[int], bool] = lambda ino: False,
               ) -> tuple[Inode, Inode | None]:
        """Move an entry (and, for a directory, the keys of its whole listed
        subtree) to ``new_parent``/``new_name`` with lake key ``new_key``.

        An entry already at the target is unlinked and returned. ``tombstones``
        are old lake keys to delete; ``etags`` are the new ETags of objects
        copied in the lake (by new key). ``has_local`` tells which inodes have
        a local copy to upload again if their object could not be copied.
        """
        etags = etags or {}
        with self.env.begin(write=True) as txn:
            value = txn.get(u64(old_parent) + old_name, db=self.dentries)
            if value is None:
                raise KeyError(old_name)
            ino, _ = _U64x2.unpack(value[:16])
            replaced = None
            target = txn.get(u64(new_parent) + new_name, db=self.dentries)
            if target is not None:
                replaced = self._remove(txn, new_parent, new_name, bytes(target), tomb=True)
            self._remove_dentry(txn, old_parent, old_name, bytes(value))
            cookie = self._counter(txn, b"next_cookie", 1)
            txn.put(u64(new_parent) + new_name, _U64x2.pack(ino, cookie), db=self.dentries)
            txn.put(u64(new_parent) + u64(cookie), new_name, db=self.cookies)
            now = time.time()
            self._rekey(txn, ino, new_key, etags, now, has_local, parent=new_parent,
                        old_key=self._key_of(txn, old_parent, old_name))
            for key in tombstones:
                if txn.get(key_bytes(key), db=self.objkeys) is None:
                    self._tomb(txn, key, 0)
            moved = Inode.decode(txn.get(u64(ino), db=self.inodes))
        return moved, replaced

    # -- hard links -------------------------------------------------------------
    def _key_of(self, txn: lmdb.Transaction, parent: int, name: bytes) -> str:
        """The lake key of a non-directory ``name`` in ``parent``."""
        directory = Inode.decode(txn.get(u64(parent), db=self.inodes))
        return directory.key + name.decode("utf-8", "surrogateescape")

    def _drop_name(self, txn: lmdb.Transaction, inode: Inode, key: str, tomb: bool) -> None:
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

    def link(self, ino: int, parent: int, name: bytes, key: str, link_id: str) -> Inode:
        """Give ``ino`` one more name: ``name`` in ``parent``, lake key ``key``."""
        with self.env.begin(write=True) as txn:
            inode = Inode.decode(txn.get(u64(ino), db=self.inodes))
            cookie = self._counter(txn, b"next_cookie", 1)
            txn.put(u64(parent) + name, _U64x2.pack(ino, cookie), db=self.dentries)
            txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(key), u64(ino), db=self.objkeys)
            inode.links.append([parent, key])
            if not inode.link_id:
                inode.link_id = link_id
                txn.put(link_id.encode(), u64(ino), db=self.link_groups)
            inode.nlink_hint = 0
            inode.ctime = time.time()
            inode.pending |= META  # the new name's object is made with the metadata
            self._put(txn, inode)
        return inode

    def join_link_group(self, inode: Inode) -> Inode:
        """A fresh node found a name whose object belongs to a hard-link group:
        if another inode here holds the group, the name becomes one of its
        names (this inode an orphan); else this inode holds the group."""
        with self.env.begin(write=True) as txn:
            raw_owner = txn.get(inode.link_id.encode(), db=self.link_groups)
            owner_raw = txn.get(raw_owner, db=self.inodes) if raw_owner else None
            owner = Inode.decode(owner_raw) if owner_raw else None
            if owner is None or owner.orphan or owner.link_id != inode.link_id \
                    or owner.ino == inode.ino:
                txn.put(inode.link_id.encode(), u64(inode.ino), db=self.link_groups)
                self._put(txn, inode)
                return inode
            if inode.key in owner.keys():
                return owner
            entry = self._entry_of(txn, inode)
            if entry is None:
                return inode
            name, value = entry
            self._remove_dentry(txn, inode.parent, name, value)
            cookie = self._counter(txn, b"next_cookie", 1)
            txn.put(u64(inode.parent) + name, _U64x2.pack(owner.ino, cookie), db=self.dentries)
            txn.put(u64(inode.parent) + u64(cookie), name, db=self.cookies)
            txn.put(key_bytes(inode.key), u64(owner.ino), db=self.objkeys)
            owner.links.append([inode.parent, inode.key])
            owner.nlink_hint = max(owner.nlink_hint, inode.nlink_hint)
            self._put(txn, owner)
            inode.orphan = True
            self._put(txn, inode)
        return owner

    def _remove_dentry(self, txn: lmdb.Transaction, parent: int, name: bytes,
                       value: bytes) -> None:
        _, cookie = _U64x2.unpack(value[:16])
        txn.delete(u64(parent) + name, db=self.dentries)
        txn.delete(u64(parent) + u64(cookie), db=self.cookies)

    def _rekey(self, txn: lmdb.Transaction, ino: int, new_key: str, etags: dict[str, str],
               now: float, has_local: Callable[[int], bool],
               parent: int | None = None, old_key: str | None = None) -> None:
        inode = Inode.decode(txn.get(u64(ino), db=self.inodes))
        if inode.links and old_key is not None:
            self._move_name(txn, inode, old_key, new_key, parent)
            return
        old_key = inode.key
        old = key_bytes(old_key)
        if txn.get(old, db=self.objkeys) == u64(ino):
            txn.delete(old, db=self.objkeys)
        inode.key = new_key
        if parent is not None:
            inode.parent = parent
        if new_key in etags:
            inode.etag = etags[new_key]
            inode.pack, inode.pack_offset, inode.checksum = "", 0, ""
        elif inode.packed and not inode.pending & DATA:
            pass  # the pack index moves it (no object of its own to copy)
        elif not inode.is_dir:
            if inode.in_lake and inode.etag != MAYBE_IN_LAKE:
                # Landed while the move was under way (after its listing): its
                # object under the old key was not copied. Delete it; upload the
                # local copy. Also when the file changed meanwhile and is pending
                # again: its etag is all that says the old key holds an object.
                self._tomb(txn, old_key, 0)
                if has_local(ino):
                    inode.pending |= DATA
            # No object of its own under the new key; an older one may be there.
            tombed = txn.get(key_bytes(new_key), db=self.tombs) is not None
            inode.etag = MAYBE_IN_LAKE if tombed else ""
        inode.ctime = now
        txn.put(key_bytes(new_key), u64(ino), db=self.objkeys)
        self._put(txn, inode)
        if inode.is_dir:
            for name, value in list(self._children(ino, txn)):
                child = _U64x2.unpack(value[:16])[0]
                kind = Inode.decode(txn.get(u64(child), db=self.inodes)).kind
                suffix = "/" if kind == DIR else ""
                text = name.decode("utf-8", "surrogateescape") + suffix
                self._rekey(txn, child, new_key + text, etags, now, has_local,
                            old_key=old_key + text)

    def _move_name(self, txn: lmdb.Transaction, inode: Inode, old_key: str, new_key: str,
                   parent: int | None) -> None:
        """Rename one name of a hard-linked inode. Its old object is deleted;
        the promoter makes the new one (a copy, with the group's metadata)."""
        if old_key == inode.key:
            inode.key = new_key
            if parent is not None:
                inode.parent = parent
        else:
            for link in inode.links:
                if link[1] == old_key:
                    link[1] = new_key
                    if parent is not None:
                        link[0] = parent
        raw = key_bytes(old_key)
        if txn.get(raw, db=self.objkeys) == u64(inode.ino):
            txn.delete(raw, db=self.objkeys)
        self._tomb(txn, old_key, 0)
        txn.put(key_bytes(new_key), u64(inode.ino), db=self.objkeys)
        inode.ctime = time.time()
        inode.pending |= META
        self._put(txn, inode)

    def add_tombstone(self, key: str, ino: int = 0) -> None:
        with self.env.begin(write=True) as txn:
            self._tomb(txn, key, ino)

    def drop_tombstone(self, key: str) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(key_bytes(key), db=self.tombs)

    def record_upload(self, ino: int, key: str, upload_id: str | None,
                      started: float = 0.0) -> None:
        """Record a multipart upload: ``upload_id`` "" before it is created (a
        crash then leaves an upload we must find by key), None once it ended."""
        with self.env.begin(write=True) as txn:
            txn.delete(u64(ino), db=self.uploads)  # the one-per-inode form of schema 2
            if upload_id is None:
                txn.delete(u64(ino) + key_bytes(key), db=self.uploads)
            else:
                record = {"key": key, "upload_id": upload_id, "started": started}
                txn.put(u64(ino) + key_bytes(key), json.dumps(record).encode(),
                        db=self.uploads)

    def apply_listing(self, parent: int, listed: Iterable[Listed], now: float | None = None,
                      started: float | None = None) -> tuple[list[int], list[int]]:
        """Make ``parent``'s children match a fresh LIST; return the inodes
        removed and those whose object another writer replaced.

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
        with self.env.begin(write=True) as txn:
            existing = dict(self._children(parent, txn))
            for entry in listed:
                name = key_bytes(entry.name)
                if txn.get(key_bytes(entry.key), db=self.tombs) is not None \
                        and not (entry.fields or {}).get("pack"):
                    continue  # deleted here; a packed file's own record says if it lives
                value = existing.pop(name, None)
                if value is not None:
                    current = Inode.decode(txn.get(value[:8], db=self.inodes))
                    if current.pending or current.ctime >= started or current.links \
                            or self._settled_at.get(current.ino, 0.0) >= started:
                        continue  # (a hard-linked inode's names are this node's)
                    if current.kind == entry.kind or (current.kind == LINK
                                                      and entry.kind == FILE):
                        if current.etag == entry.etag and current.key == entry.key \
                                and not current.attrs_known and entry.fields \
                                and entry.fields.get("attrs_known"):
                            # the record of this version came after it was listed
                            for name, field_value in entry.fields.items():
                                setattr(current, name, field_value)
                            self._put(txn, current)
                        elif current.etag != entry.etag or current.key != entry.key:
                            replaced.append(current.ino)
                            current.size, current.etag = entry.size, entry.etag
                            current.mtime_ns, current.key = int(entry.mtime * 1e9), entry.key
                            if current.kind != DIR:
                                current.attrs_known = False
                                current.kind = entry.kind
                                current.pack, current.pack_offset, current.checksum = "", 0, ""
                                for name, field_value in (entry.fields or {}).items():
                                    setattr(current, name, field_value)
                            self._put(txn, current)
                        continue
                    removed.append(_U64x2.unpack(value[:16])[0])
                    self._remove(txn, parent, name, value, tomb=False)
                self._link(txn, parent, name, entry)
            for name, value in existing.items():
                raw = txn.get(value[:8], db=self.inodes)
                if raw:
                    current = Inode.decode(raw)
                    if current.pending or current.ctime >= started \
                            or self._settled_at.get(current.ino, 0.0) >= started:
                        continue  # in the lake since the LIST began, or not yet
                removed.append(_U64x2.unpack(value[:16])[0])
                self._remove(txn, parent, name, value, tomb=False)
            raw = txn.get(prefix, db=self.inodes)
            if raw:
                dir_inode = Inode.decode(raw)
                dir_inode.listed_at = time.time() if now is None else now
                txn.put(prefix, dir_inode.encode(), db=self.inodes)
        return removed, replaced

    def _link(self, txn: lmdb.Transaction, parent: int, name: bytes, entry: Listed) -> int:
        objkey = key_bytes(entry.key)
        raw_ino = txn.get(objkey, db=self.objkeys)
        if raw_ino is not None and b'"links":[[' in (txn.get(raw_ino, db=self.inodes) or b""):
            raw_ino = None  # a name of a hard-linked inode: that record stays whole
        ino = _U64.unpack(raw_ino)[0] if raw_ino else self._counter(txn, b"next_ino", 2)
        cookie = self._counter(txn, b"next_cookie", 1)
        inode = Inode(ino, entry.kind, entry.key, parent, entry.size, entry.etag,
                      int(entry.mtime * 1e9))
        for field_name, value in (entry.fields or {}).items():
            setattr(inode, field_name, value)
        txn.put(u64(ino), inode.encode(), db=self.inodes)
        txn.put(u64(parent) + name, _U64x2.pack(ino, cookie), db=self.dentries)
        txn.put(u64(parent) + u64(cookie), name, db=self.cookies)
        txn.put(objkey, u64(ino), db=self.objkeys)
        return ino

    # -- files written and not closed (see core.Filesystem.recover) ---------------
    def mark_unclosed(self, ino: int) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(u64(ino), b"", db=self.unclosed_db)

    def clear_unclosed(self, ino: int) -> None:
        with self.env.begin(write=True) as txn:
            txn.delete(u64(ino), db=self.unclosed_db)

    def unclosed(self) -> list[int]:
        with self.env.begin() as txn:
            return [_U64.unpack(k)[0] for k, _ in txn.cursor(db=self.unclosed_db)]

    def unpublish(self, ino: int) -> Inode | None:
        """Forget a file whose writes must not reach the lake (it was open for
        writing at a crash): its entry goes, without a tombstone, and its
        directory is listed again, so the lake's last version (if any) shows."""
        with self.env.begin(write=True) as txn:
            txn.delete(u64(ino), db=self.unclosed_db)
            raw = txn.get(u64(ino), db=self.inodes)
            if not raw:
                return None
            inode = Inode.decode(raw)
            entry = self._entry_of(txn, inode)
            if entry is not None:
                self._remove(txn, inode.parent, entry[0], entry[1], tomb=False)
            parent_raw = txn.get(u64(inode.parent), db=self.inodes)
            if parent_raw:
                parent = Inode.decode(parent_raw)
                parent.listed_at = 0.0
                txn.put(u64(parent.ino), parent.encode(), db=self.inodes)
            self._delete_tree(txn, ino)  # (its upload records stay: aborted at start)
        return inode

    def delete_orphan(self, ino: int) -> None:
        """Drop an orphan's record (and, for a directory, its subtree)."""
        with self.env.begin(write=True) as txn:
            self._delete_tree(txn, ino)

    def _delete_tree(self, txn: lmdb.Transaction, ino: int) -> None:
        self._drop_markers(txn, ino, None)
        raw = txn.get(u64(ino), db=self.inodes)
        if not raw:
            return
        inode = Inode.decode(raw)
        if inode.is_dir:
            for name, value in list(self._children(ino, txn)):
                self._remove(txn, ino, name, value, tomb=False)
                self._delete_tree(txn, _U64x2.unpack(value[:16])[0])
        txn.delete(u64(ino), db=self.inodes)
        txn.delete(u64(ino), db=self.pendings)

    def purge_orphans(self) -> list[int]:
        """At mount time no kernel reference exists: drop every orphan."""
        with self.env.begin(write=True) as txn:
            orphans = [Inode.decode(v).ino for _, v in txn.cursor(db=self.inodes)
                       if b'"orphan":true' in v]
            for ino in orphans:
                self._delete_tree(txn, ino)
        return orphans

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
