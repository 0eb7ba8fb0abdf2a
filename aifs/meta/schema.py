"""The on-disk form of the metadata: every LMDB database, key and value.

This is the one table of the metadata store's environment. Code names a
database or a ``sys`` key by the constants below, never by a literal, and
encodes keys with the helpers below; a change of anything in this table is a
schema change (``SCHEMA_VERSION``, and an entry in ``MIGRATIONS``).

Integers are unsigned 64-bit big-endian (``u64``), so keys sort numerically;
``++`` is concatenation. Lake keys are stored as ``key_bytes`` makes them
(a key longer than ``KEY_RAW_MAX`` bytes is cut and hashed; where keys are
listed, the value carries the whole key).

Inodes, names and this node's dirty state (:mod:`aifs.meta.store`):

==========  ===============================  ==========================================
database    key                              value
==========  ===============================  ==========================================
inode       ino                              Inode record (JSON, see
                                             :meth:`aifs.meta.inode.Inode.encode`)
dentry      parent ino ++ name bytes         child ino ++ cookie
cookie      parent ino ++ cookie             name bytes (readdir order: stable offsets)
objkey      lake key, UTF-8 (dirs end "/")   ino of the live inode that owns the key
pending     ino                              u64 sequence number: the inode has local
                                             state not yet in the lake (``Inode.pending``
                                             says which) since that point in the order
                                             of changes (commit markers wait for older)
tomb        lake key                         ino whose object must be deleted from the
                                             lake (0: none) ++ u64 serial (a key
                                             tombstoned again is told apart) ++, for a
                                             key stored hashed, the whole key; hidden
                                             from listings
upload      ino ++ lake key                  JSON {key, upload_id, started}: a multipart
                                             upload in progress (aborted after a crash)
marker      ino ++ u64 sequence number       content of a commit marker as one close left
                                             it (published once what it commits is in)
link        hard-link group id (UTF-8)       u64 ino that holds the group's names here
                                             (a fresh node joins names it finds by it)
unclosed    ino                              b"": written through a handle since its last
                                             close or fsync (after a crash: not published)
batch       parent ino                       a first listing's plain files, virtual
                                             (:mod:`aifs.meta.batches`): first ino
                                             and first cookie (u64, little-endian;
                                             numbered in order), u32 count, the
                                             directory's key as listed
batchrows   parent ino                       that batch's rows: size, mtime, name, ETag
batchino    u64 last ino of a batch          parent ino (which batch holds an inode)
sys         a name (the last table)          counters and settings of the store and the
                                             pack index, one per key
==========  ===============================  ==========================================

The pack index (:mod:`aifs.pack.index`; ``docs/packing.md``):

==========  ===============================  ==========================================
database    key                              value
==========  ===============================  ==========================================
packed      lake key, UTF-8                  the newest record of the key (JSON): a put
                                             (where its bytes are), a del (gone) or an
                                             obj (a plain object: its ETag and metadata)
packmember  pack id ++ NUL ++ u64 offset     lake key of a live entry of that pack
pack        pack id                          JSON {size, live, t, dead_since}: live
                                             bytes, for compaction and collection
journal     journal (or fold) name           replayed here already: empty, or "!"
                                             if it could not be read
outbox      u64 sequence number              a record of a local change without new
                                             data (delete, rename, chmod) waiting to
                                             be published in the next journal
==========  ===============================  ==========================================

The keys of ``sys``:

===================  =============================================================
key                  value
===================  =============================================================
next_ino             u64 counter: the next inode number (from 2; 1 is the root)
next_cookie          u64 counter: the next readdir cookie (never reused)
next_seq             u64 counter: the next ``pending`` sequence number
next_tomb            u64 counter: the next tombstone serial
next_outbox          u64 counter: the next ``outbox`` sequence number
node                 this cache directory's node id (packs and journals carry it)
schema               schema version (``SCHEMA_VERSION``)
packs_replayed_at    u64 wall time (ns) of the LIST of the last complete replay
packs_pending        JSON {fold name: {sizes, done}}: sharded folds replayed here
                     but for some of their shards (read as directories are listed)
===================  =============================================================
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from typing import Any

import lmdb
import xxhash

from aifs.errors import AifsError

log = logging.getLogger(__name__)

# -- databases ----------------------------------------------------------------
DB_INODE = b"inode"
DB_DENTRY = b"dentry"
DB_COOKIE = b"cookie"
DB_OBJKEY = b"objkey"
DB_PENDING = b"pending"
DB_TOMB = b"tomb"
DB_UPLOAD = b"upload"
DB_MARKER = b"marker"
DB_LINK = b"link"
DB_UNCLOSED = b"unclosed"
DB_SYS = b"sys"
DB_BATCH = b"batch"
DB_BATCH_ROWS = b"batchrows"
DB_BATCH_INO = b"batchino"
DB_PACKED = b"packed"
DB_PACKMEMBER = b"packmember"
DB_PACK = b"pack"
DB_JOURNAL = b"journal"
DB_OUTBOX = b"outbox"
#: every database of the environment (the tables above), in their order
DATABASES = (DB_INODE, DB_DENTRY, DB_COOKIE, DB_OBJKEY, DB_PENDING, DB_TOMB, DB_UPLOAD,
             DB_MARKER, DB_LINK, DB_UNCLOSED, DB_BATCH, DB_BATCH_ROWS, DB_BATCH_INO,
             DB_SYS, DB_PACKED, DB_PACKMEMBER, DB_PACK,
             DB_JOURNAL, DB_OUTBOX)
#: the most named databases the environment is opened for (room to add some)
MAX_DBS = 20

# -- keys of ``sys`` ----------------------------------------------------------
SYS_NEXT_INO = b"next_ino"
SYS_NEXT_COOKIE = b"next_cookie"
SYS_NEXT_SEQ = b"next_seq"
SYS_NEXT_TOMB = b"next_tomb"
SYS_NEXT_OUTBOX = b"next_outbox"
SYS_NODE = b"node"
SYS_SCHEMA = b"schema"
SYS_PACKS_REPLAYED_AT = b"packs_replayed_at"
SYS_PACKS_PENDING = b"packs_pending"

SCHEMA_VERSION = b"6"
#: what each older schema needs to become the current one (see ``migrate``)
MIGRATIONS = {
    b"2": "mode 0 meant 'the default for the kind': that is -1 now; inode records compact",
    b"3": "inode records compact (a list of the common fields, not an object)",
    b"4": "inode records: the kind a number, an ETag's quotes left out",
    b"5": "a first listing's plain files may be one record per directory (batches)",
}

# -- encodings ----------------------------------------------------------------
#: JSON without spaces; one encoder for all (json.dumps with options builds one per call)
compact_json = json.JSONEncoder(separators=(",", ":")).encode
# (set by JSONDecoder.__init__, which typeshed does not declare)
_scan_json = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def stored_json(raw: bytes) -> Any:
    """A JSON value this store wrote (``compact_json``, UTF-8): the decoder's
    scanner called directly, which skips what ``json.loads`` adds for input
    from outside (encoding detection, trailing-data check): a third faster
    on the records listings read by the thousand."""
    return _scan_json(raw.decode(), 0)[0]

U64 = struct.Struct(">Q")
U64X2 = struct.Struct(">QQ")


def u64(value: int) -> bytes:
    return U64.pack(value)


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


# -- versions -----------------------------------------------------------------
class SchemaError(AifsError):
    """The store was written by an aifs whose schema this one cannot migrate."""


MIGRATE_CHUNK = 10_000  # inode records rewritten per transaction


def migrate(env: lmdb.Environment, version: bytes,
            encode: Callable[[dict[str, Any] | list[Any]], bytes | None]) -> None:
    """Bring a store of an older schema up to date: every record is kept
    (dirty data above all), only its form changes. ``encode`` stores an inode
    record (as any schema wrote it, parsed) as now, or returns None where it
    already is. Records are rewritten
    in transactions of :data:`MIGRATE_CHUNK` (a store of millions would
    outgrow one), the schema set last: cut short, the next open goes on
    (a record is read in either form)."""
    log.info("metadata schema %s -> %s: %s", version.decode(), SCHEMA_VERSION.decode(),
             MIGRATIONS[version])
    inodes = env.open_db(DB_INODE)
    sys_db = env.open_db(DB_SYS)
    last: bytes | None = None
    while version != b"5":  # (5 -> 6 adds databases: no record changes)
        with env.begin(write=True) as txn:
            cursor = txn.cursor(db=inodes)
            found = cursor.first() if last is None else cursor.set_range(last)
            if found and last is not None and cursor.key() == last:
                found = cursor.next()
            for _ in range(MIGRATE_CHUNK):
                if not found:
                    break
                last = bytes(cursor.key())
                record = json.loads(bytes(cursor.value()))
                if version == b"2" and isinstance(record, dict) and record.get("mode", 0) == 0:
                    record["mode"] = -1
                raw = encode(record)
                if raw is not None:
                    cursor.put(last, raw)
                found = cursor.next()
        if not found:
            break
    with env.begin(write=True) as txn:
        txn.put(SYS_SCHEMA, SCHEMA_VERSION, db=sys_db)
