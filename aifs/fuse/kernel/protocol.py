"""The FUSE wire protocol, 7.45 (``include/uapi/linux/fuse.h``): opcodes,
flags and the structs aifs reads and writes, packed with :mod:`struct`.

Little-endian, as the kernel writes it on every machine aifs runs on. Only
what the daemon uses is here; the names follow fuse.h, so a reader can hold
this next to the header. Facts measured on these machines:
``docs/kernel-binding.md``.
"""

from __future__ import annotations

import struct

KERNEL_VERSION = 7
KERNEL_MINOR = 45  # what this code speaks; an older kernel gets its own minor back
ROOT_ID = 1

# -- opcodes --------------------------------------------------------------------------
LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE = 8, 9, 10, 11, 12, 13, 14, 15, 16
STATFS, RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR = 17, 18, 20, 21, 22, 23, 24
FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 25, 26, 27, 28, 29, 30
GETLK, SETLK, SETLKW, ACCESS, CREATE, INTERRUPT, BMAP, DESTROY = 31, 32, 33, 34, 35, 36, 37, 38
IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE, READDIRPLUS = 39, 40, 41, 42, 43, 44
RENAME2, LSEEK, COPY_FILE_RANGE, SYNCFS, TMPFILE, STATX = 45, 46, 47, 50, 51, 52

NAMES = {value: name for name, value in globals().items()
         if name.isupper() and isinstance(value, int) and 0 < value < 64
         and name not in ("KERNEL_VERSION", "KERNEL_MINOR", "ROOT_ID")}

# -- INIT flags (flags | flags2 << 32) ------------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
HANDLE_KILLPRIV_V2 = 1 << 28
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37
OVER_IO_URING = 1 << 41

# -- open reply flags -----------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

OPEN_KILL_SUIDGID = 1 << 0  # fuse_open_in.open_flags
FSYNC_FDATASYNC = 1 << 0

# -- setattr valid bits ---------------------------------------------------------------
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_KILL_SUIDGID = 1 << 7, 1 << 8, 1 << 11

# -- device ioctls --------------------------------------------------------------------
DEV_IOC_CLONE = 0x8004E500
DEV_IOC_BACKING_OPEN = 0x4010E501
DEV_IOC_BACKING_CLOSE = 0x4004E502

# -- structs --------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags (flags2 follows)
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # 88 bytes
ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid (nsec x2)
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags dummy fh
INTERRUPT_IN = struct.Struct("<Q")  # unique of the request interrupted
# notices to the kernel (unique 0, the code in the header's error field)
NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY = 2, 3
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino off len (0, 0: attributes, all pages)
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags, then the name, NUL
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")  # flags open_flags
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")
FSYNC_IN = struct.Struct("<QII")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # 80 bytes
SETXATTR_IN = struct.Struct("<II")  # size flags (without SETXATTR_EXT)
GETXATTR_IN = struct.Struct("<II")  # size padding
GETXATTR_OUT = struct.Struct("<II")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type
#: a ``fuse_direntplus`` up to the name: ENTRY_HEAD, ATTR, DIRENT_HEAD in one
DIRENTPLUS_HEAD = struct.Struct(
    "<" + "".join(part.format[1:] for part in (ENTRY_HEAD, ATTR, DIRENT_HEAD)))
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding


def split_time(seconds: float) -> tuple[int, int]:
    """A timeout as the (seconds, nanoseconds) pair the kernel takes."""
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def cstring(data: bytes | memoryview, start: int = 0) -> tuple[bytes, int]:
    """The NUL-terminated string at ``start`` and the offset just past its NUL."""
    raw = bytes(data[start:]) if isinstance(data, memoryview) else data[start:]
    end = raw.index(b"\0")
    return raw[:end], start + end + 1


def dirent(ino: int, cookie: int, name: bytes, kind: int) -> bytes:
    """One ``fuse_dirent``, padded to 8 bytes. ``kind`` is the DT_* type."""
    return padded(DIRENT_HEAD.pack(ino, cookie, len(name), kind) + name)


def padded(record: bytes) -> bytes:
    """A directory record padded to 8 bytes, as the kernel reads them."""
    return record + b"\0" * (-len(record) % 8)
