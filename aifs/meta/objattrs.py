"""POSIX attributes in object user metadata, with s3fs's names.

``mode`` (decimal st_mode including the file-type bits), ``uid``, ``gid``,
``mtime`` (seconds, with ``.NNNNNNNNN`` nanoseconds when not whole) and
``xattr`` (URL-encoded JSON of name -> base64 value). A bucket written by s3fs
keeps its modes through aifs and the other way round. A symlink is an object
whose content is the target and whose ``mode`` has S_IFLNK.
"""

from __future__ import annotations

import json
import logging
import stat
import urllib.parse

from aifs.meta.store import DIR, FILE, LINK, Inode

log = logging.getLogger(__name__)

#: S3 allows 2 KiB of user metadata; xattrs get what the other fields leave
MAX_XATTR_BYTES = 1536


def type_bits(kind: str) -> int:
    return {DIR: stat.S_IFDIR, LINK: stat.S_IFLNK}.get(kind, stat.S_IFREG)


def default_mode(kind: str) -> int:
    return {DIR: 0o755, LINK: 0o777}.get(kind, 0o644)


def st_mode(inode: Inode) -> int:
    """The full st_mode (type bits and permissions) of ``inode``."""
    return type_bits(inode.kind) | (inode.mode or default_mode(inode.kind))


def encode_xattrs(xattrs: dict[str, str]) -> str:
    return urllib.parse.quote(json.dumps(xattrs, separators=(",", ":"), sort_keys=True),
                              safe="")


def to_metadata(inode: Inode, uid: int, gid: int) -> dict[str, str]:
    """The user metadata stored with ``inode``'s object."""
    seconds, nanos = divmod(inode.mtime_ns, 1_000_000_000)
    meta = {
        "mode": str(st_mode(inode)),
        "uid": str(uid if inode.uid < 0 else inode.uid),
        "gid": str(gid if inode.gid < 0 else inode.gid),
        "mtime": f"{seconds}.{nanos:09d}" if nanos else str(seconds),
    }
    if inode.xattrs:
        meta["xattr"] = encode_xattrs(inode.xattrs)
    return meta


def apply_metadata(inode: Inode, meta: dict[str, str]) -> None:
    """Fill ``inode``'s attributes from an object's metadata (what is valid)."""
    try:
        if "mode" in meta:
            mode = int(meta["mode"])
            inode.mode = stat.S_IMODE(mode)
            if not inode.is_dir:
                inode.kind = LINK if stat.S_ISLNK(mode) else FILE
        if "uid" in meta:
            inode.uid = int(meta["uid"])
        if "gid" in meta:
            inode.gid = int(meta["gid"])
        if "mtime" in meta:
            seconds, _, frac = meta["mtime"].partition(".")
            inode.mtime_ns = int(seconds) * 1_000_000_000 + int((frac + "000000000")[:9])
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
