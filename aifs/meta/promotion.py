"""Promotion bookkeeping: what this node still owes the lake, and what it did about it.

``PromotionMixin`` keeps the records the promoter (``aifs.promote``) works
from and settles: the ``pending`` index and its order (``pending_*``,
``renew_order``, ``settle``), kept versions of commit markers (``marker``),
tombstones of keys to delete from the lake (``tomb``), multipart uploads in
progress (``upload``) and files written and not closed (``unclosed``, see
``core.Filesystem.recover``; ``unpublish``). The databases are tabled in
:mod:`aifs.meta.schema`. A mixin over :class:`aifs.meta.base.StoreBase` (see
there why mixins): each method is one transaction of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from aifs.meta.batches import BatchesMixin
from aifs.meta.inode import Inode
from aifs.meta.schema import SYS_NEXT_SEQ, U64, is_hashed, key_bytes, scan_prefix, u64


def _tomb_key(raw_key: bytes, value: bytes) -> str:
    """The lake key of a tombstone record (whole, also where stored hashed)."""
    raw = bytes(value[16:]) if is_hashed(bytes(raw_key)) else bytes(raw_key)
    return raw.decode("utf-8", "surrogateescape")


class PromotionMixin(BatchesMixin):
    # -- pending state and its order -----------------------------------------------
    def pending_inodes(self) -> list[Inode]:
        """Every inode with local state not yet in the lake."""
        with self.env.begin() as txn:
            out = []
            for key in txn.cursor(db=self.pendings).iternext(keys=True, values=False):
                raw = txn.get(key, db=self.inodes)
                if raw:
                    out.append(Inode.decode(raw))
        return out

    def pending_set(self) -> set[int]:
        """The inodes with local state not yet in the lake (no record decoded)."""
        with self.env.begin() as txn:
            return {U64.unpack(k)[0]
                    for k in txn.cursor(db=self.pendings).iternext(keys=True, values=False)}

    def pending_order(self) -> dict[int, int]:
        """ino -> sequence number of when it became pending (lower: earlier)."""
        with self.env.begin() as txn:
            return {U64.unpack(k)[0]: U64.unpack(v)[0] if len(v) == 8 else 0
                    for k, v in txn.cursor(db=self.pendings)}

    def renew_order(self, ino: int, content: bytes | None = None) -> int | None:
        """Count a pending inode as changed now (a commit marker closed or
        renamed); keep ``content`` as that version of the marker. Returns its
        new sequence number (None if it is not pending)."""
        with self._write() as txn:
            if txn.get(u64(ino), db=self.pendings) is None:
                return None
            seq = self._counter(txn, SYS_NEXT_SEQ, 1)
            txn.put(u64(ino), u64(seq), db=self.pendings)
            if content is not None:
                txn.put(u64(ino) + u64(seq), content, db=self.markers)
        return seq

    # -- kept versions of commit markers -------------------------------------------
    def marker_versions(self, ino: int) -> list[tuple[int, bytes]]:
        """(sequence number, content) of the kept versions of a marker, oldest first."""
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.markers)
            out = []
            if cursor.set_range(u64(ino)):
                for key, value in cursor:
                    if key[:8] != u64(ino):
                        break
                    out.append((U64.unpack(key[8:])[0], bytes(value)))
        return out

    def drop_marker_versions(self, ino: int, up_to: int | None = None) -> None:
        """Forget kept versions of a marker (those up to sequence ``up_to``; all)."""
        with self._write() as txn:
            self._drop_markers(txn, ino, up_to)

    # -- tombstones: keys to delete from the lake ----------------------------------
    def tombstones(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {_tomb_key(k, v): U64.unpack(v[:8])[0] for k, v in txn.cursor(db=self.tombs)}

    def tombstone_marks(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The stored values of some tombstones, to drop them later only if no
        one tombstoned the key again meanwhile (see :meth:`drop_tombstones`)."""
        with self.env.begin() as txn:
            return {key: bytes(txn.get(key_bytes(key), db=self.tombs) or b"") for key in keys}

    def drop_tombstones(self, marks: dict[str, bytes]) -> None:
        """Drop tombstones whose value is still the one in ``marks``: a key
        tombstoned again while its delete ran (an upload that landed after
        the delete) keeps its new tombstone."""
        with self._write() as txn:
            for key, mark in marks.items():
                if txn.get(key_bytes(key), db=self.tombs) == mark:
                    txn.delete(key_bytes(key), db=self.tombs)

    def tombstoned(self, key: str) -> bool:
        with self.env.begin() as txn:
            return txn.get(key_bytes(key), db=self.tombs) is not None

    def tombstones_of(self, keys: list[str]) -> dict[str, int]:
        """Those of ``keys`` that are tombstoned, with their inodes."""
        with self.env.begin() as txn:
            values = {key: txn.get(key_bytes(key), db=self.tombs) for key in keys}
        return {key: U64.unpack(value[:8])[0] for key, value in values.items()
                if value is not None}

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
                        out[full] = U64.unpack(value[:8])[0]
        return out

    def add_tombstone(self, key: str, ino: int = 0) -> None:
        with self._write() as txn:
            self._tomb(txn, key, ino)

    def drop_tombstone(self, key: str) -> None:
        with self._write() as txn:
            txn.delete(key_bytes(key), db=self.tombs)

    # -- multipart uploads in progress ---------------------------------------------
    def uploads_in_progress(self) -> list[tuple[int, str, str, float]]:
        """(ino, key, upload id or "" if not known, wall time it started)."""
        with self.env.begin() as txn:
            out = []
            for k, v in txn.cursor(db=self.uploads):
                record = json.loads(v)
                out.append((U64.unpack(k[:8])[0], record["key"], record["upload_id"],
                            record.get("started", 0.0)))
        return out

    def record_upload(self, ino: int, key: str, upload_id: str | None,
                      started: float = 0.0, spilled: bool = False) -> None:
        """Record a multipart upload: ``upload_id`` "" before it is created (a
        crash then leaves an upload we must find by key), None once it ended.
        ``spilled``: bytes of the file left its local copy for the upload's
        parts (flush.stream), so the copy must never be published."""
        with self._write() as txn:
            txn.delete(u64(ino), db=self.uploads)  # the one-per-inode form of schema 2
            if upload_id is None:
                txn.delete(u64(ino) + key_bytes(key), db=self.uploads)
            else:
                record: dict[str, object] = {"key": key, "upload_id": upload_id,
                                             "started": started}
                if spilled:
                    record["spilled"] = True
                txn.put(u64(ino) + key_bytes(key), json.dumps(record).encode(),
                        db=self.uploads)

    def spilled_uploads(self) -> set[int]:
        """The inodes whose local copy gave bytes to an upload that is still
        recorded (unfinished): a crash left holes in those copies."""
        with self.env.begin() as txn:
            return {U64.unpack(k[:8])[0] for k, v in txn.cursor(db=self.uploads)
                    if json.loads(v).get("spilled")}

    # -- a promotion done ----------------------------------------------------------
    def settle(self, ino: int, expect_key: str, done: int, **changes: object) -> Inode | None:
        """After a promotion: clear ``done`` flags and apply ``changes`` if the
        inode still has key ``expect_key`` (else nothing; it moved meanwhile)."""
        with self._write() as txn:
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

    # -- files written and not closed (see core.Filesystem.recover) ----------------
    def mark_unclosed(self, ino: int) -> None:
        with self._write() as txn:
            txn.put(u64(ino), b"", db=self.unclosed_db)

    def clear_unclosed(self, ino: int) -> None:
        with self._write() as txn:
            txn.delete(u64(ino), db=self.unclosed_db)

    def unclosed(self) -> list[int]:
        with self.env.begin() as txn:
            return [U64.unpack(k)[0] for k, _ in txn.cursor(db=self.unclosed_db)]

    def unpublish(self, ino: int, mounted: bool = False) -> Inode | None:
        """Forget a file whose writes must not reach the lake: it was open for
        writing at a crash, or (``mounted``) a write of it failed. Its entry
        goes, without a tombstone, and its directory's listing is made stale,
        so the next lookup lists it again and finds the lake's last version
        under the name, as a new inode, or nothing. At mount its records go;
        while mounted the inode stays as an orphan until the kernel forgets it
        (as after an unlink)."""
        with self._write() as txn:
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
                # (a value that is no time: listed long ago, where it was listed)
                parent.listed_at = 1.0 if parent.listed_at else 0.0
                txn.put(u64(parent.ino), parent.encode(), db=self.inodes)
            if mounted:
                inode = Inode.decode(txn.get(u64(ino), db=self.inodes) or raw)
                inode.pending = 0
                self._put(txn, inode)
            else:
                self._delete_tree(txn, ino)  # (its upload records stay: aborted at start)
        return inode
