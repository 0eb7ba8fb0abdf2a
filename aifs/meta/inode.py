"""Inode records: what the metadata store keeps of each file, directory and link.

The ``Inode`` dataclass and its stored form (``encode``/``decode``, in the
``inode`` database of :mod:`aifs.meta.schema`), the file kinds, the
``Inode.pending`` flags, ``Listed`` (a child as a LIST reports it, the input
of :meth:`aifs.meta.store.MetaStore.apply_listing`) and ``valid_name``. Plain
values with no transaction in sight: everything that reads or writes LMDB is
in the store's modules.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import MISSING, dataclass, field, fields
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any, NamedTuple

from aifs.meta.schema import compact_json, key_bytes, stored_json

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

#: ``Inode.pending`` flags: what of the inode the lake does not have yet
DATA = 1  # the local copy (or symlink target) is newer than the lake object
META = 2  # attributes or xattrs are newer (for a directory: its marker object)
#: ``Inode.etag`` of a new inode whose key may still hold an older object
MAYBE_IN_LAKE = "?"


def valid_name(name: str) -> bool:
    """Whether a lake key component can be a POSIX file name."""
    if not name or name == "." or name == ".." or "\0" in name:
        return False
    # (63 characters are at most 252 bytes: most names need no encoding)
    return len(name) <= 63 or len(name.encode("utf-8", "surrogateescape")) <= 255


DECODED_KEPT = 16384


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
    links: list[list[Any]] = field(default_factory=list)
    link_id: str = ""  # the names' group id, in each name's object metadata
    nlink_hint: int = 0  # st_nlink the lake's metadata told, before all names were seen

    def encode_kept(self) -> bytes:
        """:meth:`encode`, and this inode (which the caller no longer changes)
        kept as the decoded form of the record: a record a listing writes is
        read back at once by the READDIRPLUS that follows."""
        raw = self.encode()
        _remember(raw, self)
        return raw

    def encode_stored(self) -> bytes:
        """:meth:`encode`, and a copy of this inode (the caller may go on
        changing it) kept as the decoded form of the record: what a write
        stores is read back within the same request or the next (a create's
        flush and release, an open after a close), and a copy costs a
        fraction of parsing the record."""
        raw = self.encode()
        _remember(raw, self._copy())
        return raw

    def _copy(self) -> Inode:
        """A copy with containers of its own (empty ones too: see :meth:`decode`)."""
        inode = Inode.__new__(Inode)
        inode.__dict__.update(self.__dict__)
        inode.xattrs = dict(self.xattrs) if self.xattrs else {}
        inode.links = [list(link) for link in self.links] if self.links else []
        return inode

    def encode(self) -> bytes:
        """The record as stored: a JSON list of the fields every inode has
        (:data:`_HEAD`; the kind as a number, an S3 ETag without its quotes:
        ``_etag_out``), then, if any, an object of the others that are not at
        their defaults (most are not, for a listed object): no field names for
        the common ones, ``decode`` gives all back."""
        values = self.__dict__
        if _rest_values(values) == _REST_DEFAULTS and self.kind in _KIND_CODES \
                and type(self.ino) is type(self.parent) is type(self.size) \
                is type(self.mtime_ns) is int and type(self.key) is type(self.etag) is str:
            # Most records (every listed object) are the head alone: formatted
            # here, with the JSON encoder's own string escaping, 6x faster than
            # encoding a list (tests/unit/test_meta.py checks both agree); a bool,
            # float or None where an int belongs goes the general way.
            return (f"[{self.ino:d},{_KIND_CODES[self.kind]},{_json_string(self.key)},"
                    f"{self.parent:d},{self.size:d},{_json_string(_etag_out(self.etag))},"
                    f"{self.mtime_ns:d}]").encode()
        record: list[object] = [values[name] for name in _HEAD]
        record[1] = _KIND_CODES.get(self.kind, self.kind)
        record[5] = _etag_out(self.etag)
        rest = {name: value for name, default in _REST if (value := values[name]) != default}
        if rest:
            record.append(rest)
        return compact_json(record).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Inode:
        """The record as an Inode of its own (callers change it freely).

        Decoded records are remembered by their bytes: the same record is read
        many times (a lookup, an open, a release), and a copy costs a fraction
        of parsing the JSON again."""
        key = bytes(raw)
        known = _DECODED.get(key)
        if known is None:
            known = cls.from_json(stored_json(key))
            _remember(key, known)
        # containers of its own, empty ones too: a caller that adds a link or
        # an xattr must not change what the same bytes decode to next time
        return known._copy()

    @classmethod
    def from_json(cls, record: list[Any] | dict[str, Any]) -> Inode:
        """An inode from its parsed record, whichever schema wrote it: an
        object (3 and older), a list with the kind as a letter and the ETag as
        is (4), or as now (the kind a number: 5)."""
        if isinstance(record, dict):
            return cls(**record)
        inode = cls(*record[:7], **(record[7] if len(record) > 7 else {}))
        if isinstance(inode.kind, int):
            inode.kind = _KINDS[inode.kind]
            inode.etag = _etag_in(inode.etag)
        else:
            inode.kind = _LETTERS.get(inode.kind, inode.kind)
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

    @property
    def name(self) -> bytes:
        """The name in its directory: the last part of its key."""
        return key_bytes(self.key.rstrip("/").rsplit("/", 1)[-1])

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


def record_is_dir(raw: bytes | memoryview) -> bool:
    """Whether a stored record (:meth:`Inode.encode`) is a directory's, unparsed."""
    head = bytes(raw[:32])
    return head[head.find(b",") + 1:].startswith(b"%d," % _KIND_CODES[DIR])


_DECODED: dict[bytes, Inode] = {}


def _remember(raw: bytes, inode: Inode) -> None:
    """Keep ``inode`` as the decoded form of ``raw`` (listings write from a
    worker thread while the trio thread decodes: an entry another thread
    dropped first is no error)."""
    if len(_DECODED) >= DECODED_KEPT:  # the older half goes, the recent stay
        for old in list(itertools.islice(_DECODED, DECODED_KEPT // 2)):
            _DECODED.pop(old, None)
    _DECODED[raw] = inode
#: the fields every stored record holds, in this order, without their names
_HEAD = ("ino", "kind", "key", "parent", "size", "etag", "mtime_ns")
_HEAD_SET = frozenset(_HEAD)
_KIND_CODES = {FILE: 0, DIR: 1, LINK: 2, FIFO: 3, CHR: 4, BLK: 5, SOCK: 6}
_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
#: schema 4's kind codes
_LETTERS = {"f": FILE, "d": DIR, "l": LINK, "p": FIFO, "c": CHR, "b": BLK, "s": SOCK}


def _etag_out(etag: str) -> str:
    """An ETag as a record stores it: S3's ``"<hex>"`` without its quotes
    (four bytes of JSON escapes fewer); any other with a ``=`` in front."""
    if len(etag) > 2 and etag[0] == etag[-1] == '"' and '"' not in etag[1:-1] \
            and etag[1] != "=":
        return etag[1:-1]
    return "=" + etag if etag else ""


def _etag_in(stored: str) -> str:
    if not stored:
        return ""
    return stored[1:] if stored[0] == "=" else f'"{stored}"'


#: fields left out of a stored record when they hold these values
_INODE_DEFAULTS: dict[str, object] = {
    f.name: f.default_factory() if f.default_factory is not MISSING else f.default
    for f in fields(Inode) if f.default is not MISSING or f.default_factory is not MISSING}
#: (name, default) of the fields a record holds by name, in field order
_REST = tuple((name, default) for name, default in _INODE_DEFAULTS.items()
              if name not in _HEAD_SET)
_rest_values = operator.itemgetter(*(name for name, _ in _REST))
_REST_DEFAULTS = tuple(default for _, default in _REST)


class Listed(NamedTuple):
    """One child of a directory as a LIST reported it (a named tuple: one is
    made per listed object, 0.3 us where a frozen dataclass took 0.8)."""

    name: str
    kind: str
    key: str
    size: int = 0
    etag: str = ""
    mtime: float = 0.0
    #: further inode fields a packed file's listing knows (pack, owner, mode ...)
    fields: dict[str, object] | None = None
