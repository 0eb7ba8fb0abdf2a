"""The pack index: which lake keys are small files packed into pack objects.

Packed files have no object of their own. Their bytes are a range of a pack
object under ``.aifs/packs/``, and the lake says where through journal
objects under ``.aifs/journal/``: each holds a batch of records (see
``docs/packing.md``). Every node replays every journal into this index, so
all nodes agree on the packed files, whoever wrote them. Records are applied
last writer wins, per key, by their time stamp, so the order in which a node
reads journals does not matter.

LMDB databases (in the metadata store's environment): ``packed``,
``packmember``, ``pack``, ``journal``, ``outbox`` and the ``sys`` key
``packs_replayed_at``, tabled with all the others in :mod:`aifs.meta.schema`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import lmdb
import xxhash

from aifs.buffers import Body
from aifs.meta.base import Database
from aifs.meta.inode import Inode
from aifs.meta.schema import (
    DB_JOURNAL,
    DB_OUTBOX,
    DB_PACK,
    DB_PACKED,
    DB_PACKMEMBER,
    SYS_NEXT_OUTBOX,
    SYS_PACKS_PENDING,
    SYS_PACKS_REPLAYED_AT,
    compact_json,
    is_hashed,
    key_bytes,
    scan_prefix,
    stored_json,
    u64,
)
from aifs.meta.store import MetaStore
from aifs.pack.folds import (  # (the fold format; named here too for the callers)
    FOLD_SUFFIX,
    FORMAT_VERSION,
    JOURNAL_DIR,
    FoldHeader,
    encode_fold,
    read_fold,
    shard_of,
)

__all__ = ["FOLD_SUFFIX", "FORMAT_VERSION", "JOURNAL_DIR", "PACK_DIR", "FoldHeader",
           "PackIndex", "PackedEntry", "Record", "checksum", "decode_journal", "deletion",
           "encode_fold", "is_packed_at", "object_record", "pack_key", "read_fold"]

PACK_DIR = ".aifs/packs/"
JOURNAL_SUFFIX = ".json"

Record = dict[str, Any]


def checksum(data: Body) -> str:
    """The checksum packs record per entry (xxh3, 64 bits, hex)."""
    return xxhash.xxh3_64_hexdigest(data)


def pack_key(pack: str) -> str:
    return PACK_DIR + pack


@dataclass(frozen=True)
class PackedEntry:
    """Where a packed file's bytes are, and its POSIX attributes."""

    key: str
    pack: str
    offset: int
    length: int
    xxh3: str
    stamp: int  # ns wall time of the change that wrote this record
    mode: int = 0
    uid: int = -1
    gid: int = -1
    mtime_ns: int = 0
    xattrs: dict[str, str] | None = None
    origin: str = ""  # ETag of the plain object this is a packed copy of (aifs pack)
    atime_ns: int = 0  # set explicitly (0: as mtime)

    @classmethod
    def from_record(cls, record: Record) -> PackedEntry:
        return cls(record["key"], record["pack"], record["off"], record["len"],
                   record["xxh3"], record["t"], record.get("mode", 0), record.get("uid", -1),
                   record.get("gid", -1), record.get("mtime", 0), record.get("xattrs"),
                   record.get("origin", ""), record.get("atime", 0))

    def record(self) -> Record:
        out: Record = {"op": "put", "key": self.key, "pack": self.pack, "off": self.offset,
                       "len": self.length, "xxh3": self.xxh3, "t": self.stamp,
                       "mode": self.mode, "uid": self.uid, "gid": self.gid,
                       "mtime": self.mtime_ns}
        if self.xattrs:
            out["xattrs"] = self.xattrs
        if self.origin:
            out["origin"] = self.origin
        if self.atime_ns:
            out["atime"] = self.atime_ns
        return out

    def permissions(self) -> int:
        """Permission bits of ``mode`` (-1: the default). Records hold the
        full st_mode with its type bits; older ones the bits alone, 0 for
        the default."""
        if self.mode & 0o170000:
            return self.mode & 0o7777
        return self.mode or -1

    @property
    def etag(self) -> str:
        """The inode ETag of a packed file: its place and record time, which
        change with its content and with its attributes."""
        return f"pack:{self.pack}:{self.offset}:{self.stamp}"


def object_record(key: str, etag: str, metadata: dict[str, str],
                  stamp: int | None = None) -> Record:
    """The record of a plain object aifs put: its ETag and the POSIX metadata
    it carries (as its user metadata), so a node listing it knows its
    attributes without a HEAD (see ``PackIndex.objects``)."""
    return {"op": "obj", "key": key, "etag": etag, "meta": metadata,
            "t": stamp if stamp is not None else time.time_ns()}


def deletion(key: str, stamp: int | None = None) -> Record:
    return {"op": "del", "key": key, "t": stamp if stamp is not None else time.time_ns()}


def decode_journal(raw: bytes) -> list[Record]:
    """The records of a journal object; ValueError if it cannot be read."""
    try:
        records = json.loads(raw)["records"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(records, list):
        raise ValueError("records is not a list")
    return records


def _member(pack: str, offset: int) -> bytes:
    return pack.encode() + b"\0" + u64(offset)


def _unread(pending: dict[str, dict[str, list[int]]], directory: str) -> bool:
    """Whether a pending sharded fold's shard of ``directory`` is unread."""
    return any(shard_of(directory, len(state["sizes"])) not in state["done"]
               for state in pending.values())


def is_packed_at(inode: Inode, entry: PackedEntry) -> bool:
    """Whether ``entry`` is the packed copy ``inode`` knows as its own."""
    return bool(inode.pack) and inode.pack == entry.pack and inode.pack_offset == entry.offset


class PackIndex:
    def __init__(self, meta: MetaStore) -> None:
        self.env = meta.env
        self.entries = self.env.open_db(DB_PACKED)
        self.members = self.env.open_db(DB_PACKMEMBER)
        self.packs = self.env.open_db(DB_PACK)
        self.journals = self.env.open_db(DB_JOURNAL)
        self.outbox = self.env.open_db(DB_OUTBOX)
        self.sys = meta.sys
        self._sizes: dict[str, int] = {}  # pack id -> size, see pack_size

    # -- reads ----------------------------------------------------------------
    def entry(self, key: str) -> PackedEntry | None:
        if not key:
            return None  # the root: never packed (and LMDB has no empty keys)
        with self.env.begin() as txn:
            raw = txn.get(key_bytes(key), db=self.entries)
        if raw is None:
            return None
        record = json.loads(raw)
        return PackedEntry.from_record(record) if record["op"] == "put" else None

    def children(self, prefix: str) -> Iterator[tuple[str, PackedEntry | None]]:
        """Packed children of the directory ``prefix``: (name, entry) for a
        file, (name, None) for a directory that holds packed files."""
        raw_prefix = scan_prefix(prefix)
        whole = key_bytes(prefix) == raw_prefix
        out: list[tuple[str, PackedEntry | None]] = []
        pending: dict[str, dict[str, list[int]]] | None = None  # (read once, if needed)
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.entries)
            found = cursor.set_range(raw_prefix)
            while found:
                key, value = cursor.item()
                if not key.startswith(raw_prefix):
                    break
                if not whole or is_hashed(bytes(key)):  # a long key: its record says it all
                    self._long_child(prefix, stored_json(value), out)
                    found = cursor.next()
                    continue
                rest = bytes(key[len(raw_prefix):])
                slash = rest.find(b"/")
                if slash >= 0:  # below a subdirectory: one entry, then skip past it
                    sub = rest[:slash]
                    if pending is None:
                        pending = self._pending(txn)
                    if self._any_live(txn, raw_prefix + sub + b"/", pending):
                        out.append((sub.decode("utf-8", "surrogateescape"), None))
                    found = cursor.set_range(raw_prefix + sub + b"0")  # "0" follows "/"
                    continue
                record = stored_json(value)
                if record["op"] == "put":
                    out.append((rest.decode("utf-8", "surrogateescape"),
                                PackedEntry.from_record(record)))
                found = cursor.next()
        yield from out

    def objects(self, prefix: str) -> dict[str, Record]:
        """The records of plain objects aifs put directly in the directory
        ``prefix`` (name -> record; a subdirectory's marker as ``name/``),
        newer than any packed copy or deletion of the same key."""
        raw_prefix = scan_prefix(prefix)
        whole = key_bytes(prefix) == raw_prefix
        out: dict[str, Record] = {}
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.entries)
            found = cursor.set_range(raw_prefix)
            while found:
                key, value = cursor.item()
                if not key.startswith(raw_prefix):
                    break
                rest = bytes(key[len(raw_prefix):])
                slash = rest.find(b"/")
                if b'"op":"obj"' in value and (slash < 0 or slash == len(rest) - 1
                                                or not whole or is_hashed(bytes(key))):
                    record = stored_json(value)
                    name = record["key"][len(prefix):]
                    if record["key"].startswith(prefix) and "/" not in name.rstrip("/"):
                        out[name] = record  # a file, or a directory's marker ("name/")
                if whole and slash >= 0 and not is_hashed(bytes(key)):
                    found = cursor.set_range(raw_prefix + rest[:slash] + b"0")  # skip below
                    continue
                found = cursor.next()
        return out

    def objects_below(self, prefix: str) -> list[Record]:
        """The records of plain objects aifs put anywhere below ``prefix``
        (newer than any packed copy or deletion of the same key)."""
        raw_prefix = scan_prefix(prefix)
        out: list[Record] = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.entries)
            for key, value in cursor.iternext() if cursor.set_range(raw_prefix) else ():
                if not key.startswith(raw_prefix):
                    break
                if b'"op":"obj"' in value and (record := stored_json(value))["key"] \
                        .startswith(prefix):
                    out.append(record)
        return out

    @staticmethod
    def _long_child(prefix: str, record: Record,
                    out: list[tuple[str, PackedEntry | None]]) -> None:
        if not record["key"].startswith(prefix) or record["op"] != "put":
            return
        name, slash, _ = record["key"][len(prefix):].partition("/")
        if slash:
            if (name, None) not in out:
                out.append((name, None))
        else:
            out.append((name, PackedEntry.from_record(record)))

    def _any_live(self, txn: lmdb.Transaction[bytes], prefix: bytes,
                  pending: dict[str, dict[str, list[int]]]) -> bool:
        cursor = txn.cursor(db=self.entries)
        found = cursor.set_range(prefix)
        while found and cursor.key().startswith(prefix):
            value = cursor.value()
            if b'"op":"put"' in value:
                return True
            if b'"op":"dir"' in value and _unread(pending, stored_json(value)["key"]):
                return True  # a sharded fold says it holds packed files, not read yet
            found = cursor.next()
        return False

    def under(self, prefix: str) -> list[PackedEntry]:
        """Every live packed file below ``prefix``."""
        raw_prefix = scan_prefix(prefix)
        out = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.entries)
            found = cursor.set_range(raw_prefix)
            while found and cursor.key().startswith(raw_prefix):
                record = json.loads(cursor.value())
                if record["op"] == "put" and record["key"].startswith(prefix):
                    out.append(PackedEntry.from_record(record))
                found = cursor.next()
        return out

    def members_of(self, pack: str) -> list[PackedEntry]:
        """The live entries of a pack, in offset order."""
        prefix = pack.encode() + b"\0"
        out = []
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.members)
            found = cursor.set_range(prefix)
            while found and cursor.key().startswith(prefix):
                raw = txn.get(cursor.value(), db=self.entries)
                if raw:
                    record = json.loads(raw)
                    if record["op"] == "put" and record["pack"] == pack:
                        out.append(PackedEntry.from_record(record))
                found = cursor.next()
        return out

    def pack_info(self, pack: str) -> dict[str, Any] | None:
        with self.env.begin() as txn:
            raw = txn.get(pack.encode(), db=self.packs)
        return json.loads(raw) if raw else None

    def pack_size(self, pack: str) -> int | None:
        """The size of a pack object (None: unknown). Packs never change once
        put, so a size once read is remembered: every read of a packed file
        asks for it."""
        size = self._sizes.get(pack)
        if size is None:
            size = (self.pack_info(pack) or {}).get("size") or None
            if size is not None:
                if len(self._sizes) >= 65_536:
                    self._sizes.clear()
                self._sizes[pack] = size
        return size

    def all_packs(self) -> dict[str, dict[str, Any]]:
        with self.env.begin() as txn:
            return {bytes(k).decode(): json.loads(v) for k, v in txn.cursor(db=self.packs)}

    def snapshot(self, keep_deletions_after: int) -> Iterator[bytes]:
        """Records (raw JSON) that rebuild this index on a node that has none:
        a ``pack`` per pack with live files, the ``put`` of every live file,
        and the ``del`` records stamped after ``keep_deletions_after`` (ns),
        which must still beat older records of the same keys arriving late."""
        with self.env.begin() as txn:
            for raw_pack, raw in txn.cursor(db=self.packs):
                info = json.loads(raw)
                if info.get("live", 0) > 0 and info.get("size"):
                    yield compact_json({"op": "pack", "pack": bytes(raw_pack).decode(),
                                        "size": info["size"], "t": info.get("t", 0)}).encode()
            for _, raw in txn.cursor(db=self.entries):
                if b'"op":"put"' in raw or b'"op":"obj"' in raw \
                        or json.loads(raw)["t"] > keep_deletions_after:
                    yield bytes(raw)

    def seen(self, names: Iterable[str], readable_only: bool = False) -> set[str]:
        """Which of these journals were replayed here (and could be read)."""
        with self.env.begin() as txn:
            values = {name: txn.get(name.encode(), db=self.journals) for name in names}
        return {name for name, value in values.items()
                if value is not None and not (readable_only and value)}

    def outbox_records(self, limit: int = 100_000, after: int = 0
                       ) -> tuple[list[Record], int]:
        """Records waiting to be published (those numbered above ``after``),
        and the sequence number of the last."""
        out, last = [], after
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.outbox)
            found = cursor.set_range(u64(after + 1))
            while found:
                out.append(json.loads(cursor.value()))
                last = int.from_bytes(cursor.key(), "big")
                if len(out) >= limit:
                    break
                found = cursor.next()
        return out, last

    def outbox_size(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self.outbox)["entries"])

    # -- writes ---------------------------------------------------------------
    def apply(self, records: Iterable[Record], journal: str | None = None,
              covered: Iterable[str] = (), raws: Iterable[bytes] | None = None,
              shards: list[int] | None = None) -> None:
        """Apply journal records (and mark ``journal``, and the journals a fold
        ``covered``, replayed), in one transaction. ``raws``: the records'
        compact JSON, stored as it is instead of encoded again. ``shards``:
        ``journal`` is a sharded fold with shards of these sizes, none read
        yet (see :meth:`pending`); a fold it covers that was still pending is
        not any more (this one holds all it held)."""
        with self.env.begin(write=True) as txn:
            packs = _PackInfos(txn, self.packs)
            if raws is None:
                for record in records:
                    self._apply(txn, record, packs)
            else:
                for record, raw in zip(records, raws, strict=True):
                    self._apply(txn, record, packs, raw)
            packs.write()
            names = ([journal] if journal is not None else []) + list(covered)
            for name in names:
                txn.put(name.encode(), b"", db=self.journals)
            pending = self._pending(txn)
            if shards is not None or pending.keys() & set(names):
                for name in names:
                    pending.pop(name, None)
                if shards is not None and journal is not None:
                    pending[journal] = {"sizes": shards, "done": []}
                self._set_pending(txn, pending)

    def apply_shard(self, records: list[Record], raws: list[bytes], fold: str,
                    shard: int) -> bool:
        """Apply the records of shard ``shard`` of a pending fold and note it
        read; False (nothing applied) if the fold is not pending any more or
        the shard was read: fetched before a replay from scratch, or before a
        newer fold took the place of its own, its records may bring back what
        was deleted since (the newer fold's shards are read instead)."""
        with self.env.begin(write=True) as txn:
            pending = self._pending(txn)
            state = pending.get(fold)
            if state is None or shard in state["done"]:
                return False
            packs = _PackInfos(txn, self.packs)
            for record, raw in zip(records, raws, strict=True):
                self._apply(txn, record, packs, raw)
            packs.write()
            state["done"].append(shard)
            if len(state["done"]) >= len(state["sizes"]):
                del pending[fold]
            self._set_pending(txn, pending)
            return True

    def pending(self) -> dict[str, dict[str, list[int]]]:
        """The sharded folds whose shards are not all read here: fold name ->
        {"sizes": size of each shard object, "done": the shards read}."""
        with self.env.begin() as txn:
            return self._pending(txn)

    def _pending(self, txn: lmdb.Transaction[bytes]) -> dict[str, dict[str, list[int]]]:
        raw = txn.get(SYS_PACKS_PENDING, db=self.sys)
        return json.loads(raw) if raw else {}

    def _set_pending(self, txn: lmdb.Transaction[bytes],
                     pending: dict[str, dict[str, list[int]]]) -> None:
        if pending:
            txn.put(SYS_PACKS_PENDING, compact_json(pending).encode(), db=self.sys)
        else:
            txn.delete(SYS_PACKS_PENDING, db=self.sys)

    def replayed_at(self) -> int:
        """Wall time (ns) of the listing of the last complete replay (0: never):
        every journal in the lake before then was read here."""
        with self.env.begin() as txn:
            raw = txn.get(SYS_PACKS_REPLAYED_AT, db=self.sys)
        return int.from_bytes(raw, "big") if raw else 0

    def set_replayed_at(self, ns: int) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(SYS_PACKS_REPLAYED_AT, u64(ns), db=self.sys)

    def record_count(self) -> int:
        """Records held (live files, plain objects' records, deletions)."""
        with self.env.begin() as txn:
            return int(txn.stat(self.entries)["entries"])

    def is_empty(self) -> bool:
        with self.env.begin() as txn:
            return int(txn.stat(self.entries)["entries"]) == 0

    def reset(self) -> None:
        """Forget everything replayed (for a replay from scratch); the local
        changes in the outbox, not published yet, are applied again."""
        with self.env.begin(write=True) as txn:
            for db in (self.entries, self.members, self.packs, self.journals):
                txn.drop(db, delete=False)
            txn.delete(SYS_PACKS_REPLAYED_AT, db=self.sys)
            txn.delete(SYS_PACKS_PENDING, db=self.sys)
            packs = _PackInfos(txn, self.packs)
            for _, raw in txn.cursor(db=self.outbox):
                self._apply(txn, json.loads(raw), packs)
            packs.write()

    def unreadable(self, journal: str) -> None:
        """A journal that could not be read: not asked for again, never folded."""
        with self.env.begin(write=True) as txn:
            txn.put(journal.encode(), b"!", db=self.journals)

    def queue(self, records: list[Record]) -> None:
        """Apply local changes now and keep them for the next journal."""
        with self.env.begin(write=True) as txn:
            packs = _PackInfos(txn, self.packs)
            for record in records:
                self._apply(txn, record, packs)
                raw = txn.get(SYS_NEXT_OUTBOX, db=self.sys)
                seq = int.from_bytes(raw, "big") if raw else 1
                txn.put(SYS_NEXT_OUTBOX, u64(seq + 1), db=self.sys)
                txn.put(u64(seq), compact_json(record).encode(),
                        db=self.outbox)
            packs.write()

    def drop_outbox(self, up_to: int, after: int = 0) -> None:
        """Forget the published records numbered ``after`` + 1 to ``up_to``."""
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor(db=self.outbox)
            while cursor.set_range(u64(after + 1)) \
                    and int.from_bytes(cursor.key(), "big") <= up_to:
                cursor.delete()

    def forget_pack(self, pack: str) -> None:
        """A collected pack: drop its record (its entries are all dead)."""
        with self.env.begin(write=True) as txn:
            txn.delete(pack.encode(), db=self.packs)

    def _apply(self, txn: lmdb.Transaction[bytes], record: Record, packs: _PackInfos,
               raw_record: bytes | None = None) -> None:
        op = record.get("op")
        if op == "pack":
            info = packs.get(record["pack"])
            info["size"], info["t"] = record["size"], record["t"]
            return
        key = key_bytes(record["key"])
        raw = txn.get(key, db=self.entries)
        current = stored_json(raw) if raw else None
        if op == "move":  # compaction: only if the entry is still where it was
            if current is None or current["op"] != "put" or \
                    [current["pack"], current["off"]] != record["from"]:
                return
            # mv counts moves: a fold made before this move, read after it,
            # carries the same put (same t) at the old place and must lose.
            new = dict(current, pack=record["pack"], off=record["off"],
                       mv=current.get("mv", 0) + 1)
        elif op == "dir":  # (a sharded fold's: see encode_sharded_fold) below all else
            if current is None:
                txn.put(key, raw_record if raw_record is not None
                        else compact_json(record).encode(), db=self.entries)
            return
        elif op in ("put", "del", "obj"):
            if current is not None and current["t"] > record["t"]:
                return  # an older change than the one we know
            if current is not None and current["t"] == record["t"] and op == "put" \
                    and current["op"] == "put" and current.get("mv", 0) > record.get("mv", 0):
                return  # the same change, from before a move we know
            new = record
        else:
            return  # a record of a later format: ignored
        if current is not None and current["op"] == "put":
            txn.delete(_member(current["pack"], current["off"]), db=self.members)
            packs.add_live(current["pack"], -current["len"])
        if new is not record or raw_record is None or \
                f'"op":"{op}"'.encode() not in raw_record:  # (compact: the listing scans for it)
            raw_record = compact_json(new).encode()
        txn.put(key, raw_record, db=self.entries)
        if new["op"] == "put":
            txn.put(_member(new["pack"], new["off"]), key, db=self.members)
            packs.add_live(new["pack"], new["len"])


class _PackInfos:
    """The pack records one transaction reads and changes, written once at its
    end: a journal changes the live bytes of one pack thousands of times."""

    def __init__(self, txn: lmdb.Transaction[bytes], db: Database) -> None:
        self.txn, self.db = txn, db
        self.infos: dict[str, dict[str, Any]] = {}
        self.live_changed: set[str] = set()

    def get(self, pack: str) -> dict[str, Any]:
        info = self.infos.get(pack)
        if info is None:
            raw = self.txn.get(pack.encode(), db=self.db)
            info = json.loads(raw) if raw else {"size": 0, "live": 0, "t": 0, "dead_since": 0}
            self.infos[pack] = info
        return info

    def add_live(self, pack: str, delta: int) -> None:
        self.get(pack)["live"] += delta
        self.live_changed.add(pack)

    def write(self) -> None:
        for pack, info in self.infos.items():
            if pack in self.live_changed:
                info["live"] = max(0, info["live"])
                if info["live"] == 0 and info.get("size"):
                    info["dead_since"] = info.get("dead_since") or time.time()
                else:
                    info["dead_since"] = 0
            self.txn.put(pack.encode(), compact_json(info).encode(),
                         db=self.db)
