"""POSIX attributes in object user metadata, with s3fs's names.

``mode`` (decimal st_mode including the file-type bits), ``uid``, ``gid``,
``mtime`` (seconds, with ``.NNNNNNNNN`` nanoseconds when not whole) and
``xattr`` (URL-encoded JSON of name -> base64 value), ``atime`` (as ``mtime``,
only once set) and ``rdev`` (decimal, of devices). A FIFO, socket or device
is an empty object whose ``mode`` carries its type bits, as s3fs writes them.
A bucket written by s3fs keeps its modes through aifs and the other way round.
A symlink is an object whose content is the target and whose ``mode`` has
S_IFLNK. Each name of a hard-linked file is an object with the same bytes
(other tools see ordinary files) and ``aifs-link`` (the group id) and
``aifs-nlink`` in its metadata, so a fresh node joins the names again.
"""

from __future__ import annotations

import json
import logging
import stat
import urllib.parse
from collections.abc import Mapping

from aifs.meta.inode import BLK, CHR, DIR, FIFO, FILE, LINK, SOCK, SPECIAL, Inode

log = logging.getLogger(__name__)

#: S3 allows 2 KiB of user metadata; xattrs get what the other fields leave
MAX_XATTR_BYTES = 1536
#: a hard-linked file: each name is an object of its own with the same bytes;
#: these say which names are one file (the group id) and how many it has
LINK_META = "aifs-link"
NLINK_META = "aifs-nlink"


_TYPE_BITS = {DIR: stat.S_IFDIR, LINK: stat.S_IFLNK, FIFO: stat.S_IFIFO, CHR: stat.S_IFCHR,
              BLK: stat.S_IFBLK, SOCK: stat.S_IFSOCK}
_KINDS = {bits: kind for kind, bits in _TYPE_BITS.items() if kind != DIR}


def type_bits(kind: str) -> int:
    return _TYPE_BITS.get(kind, stat.S_IFREG)


def kind_of(mode: int) -> str | None:
    """The kind a full st_mode names (None: no type bits); never DIR (a
    directory is a prefix, not decided by an object's metadata)."""
    if not stat.S_IFMT(mode):
        return None
    return _KINDS.get(stat.S_IFMT(mode), FILE)


def default_mode(kind: str) -> int:
    return {DIR: 0o755, LINK: 0o777}.get(kind, 0o644)


def st_mode(inode: Inode) -> int:
    """The full st_mode (type bits and permissions) of ``inode``."""
    return type_bits(inode.kind) | (inode.mode if inode.mode >= 0 else default_mode(inode.kind))


def _time(value: str) -> int:
    seconds, _, frac = value.partition(".")
    return int(seconds) * 1_000_000_000 + int((frac + "000000000")[:9])


def _time_text(ns: int) -> str:
    seconds, nanos = divmod(ns, 1_000_000_000)
    return f"{seconds}.{nanos:09d}" if nanos else str(seconds)


def encode_xattrs(xattrs: dict[str, str]) -> str:
    return urllib.parse.quote(json.dumps(xattrs, separators=(",", ":"), sort_keys=True),
                              safe="")


def to_metadata(inode: Inode, uid: int, gid: int) -> dict[str, str]:
    """The user metadata stored with ``inode``'s object."""
    meta = {
        "mode": str(st_mode(inode)),
        "uid": str(uid if inode.uid < 0 else inode.uid),
        "gid": str(gid if inode.gid < 0 else inode.gid),
        "mtime": _time_text(inode.mtime_ns),
    }
    if inode.atime_ns:
        meta["atime"] = _time_text(inode.atime_ns)
    if inode.kind in (CHR, BLK):
        meta["rdev"] = str(inode.rdev)
    if inode.link_id:
        meta[LINK_META] = inode.link_id
        meta[NLINK_META] = str(inode.nlink)
    if inode.xattrs:
        meta["xattr"] = encode_xattrs(inode.xattrs)
    return meta


def apply_metadata(inode: Inode, meta: Mapping[str, str]) -> None:
    """Fill ``inode``'s attributes from an object's metadata (what is valid)."""
    try:
        if "mode" in meta:
            mode = int(meta["mode"])
            inode.mode = stat.S_IMODE(mode)
            kind = kind_of(mode)
            if not inode.is_dir and kind is not None:
                inode.kind = kind
        if "uid" in meta:
            inode.uid = int(meta["uid"])
        if "gid" in meta:
            inode.gid = int(meta["gid"])
        if "mtime" in meta:
            inode.mtime_ns = _time(meta["mtime"])
        if "atime" in meta:
            inode.atime_ns = _time(meta["atime"])
        if "rdev" in meta and inode.kind in SPECIAL:
            inode.rdev = int(meta["rdev"])
        if meta.get(LINK_META) and not inode.is_dir:
            inode.link_id = meta[LINK_META]
            inode.nlink_hint = int(meta.get(NLINK_META, "0"))
    except ValueError:
        log.warning("%s: unreadable POSIX metadata %r; using defaults", inode.key, meta)
    if "xattr" in meta:
        try:
            decoded = json.loads(urllib.parse.unquote(meta["xattr"]))
            if isinstance(decoded, dict):
                inode.xattrs = {str(k): str(v) for k, v in decoded.items()}
        except ValueError:
            log.warning("%s: unreadable xattr metadata; ignored", inode.key)
    inode.attrs_known = True
