"""The operations of the fsx-style test (see test_fsx.py): each a JSON-able list
[name, *arguments] applied the same way to a reference tree and to the mount, the
comparison of whole trees, and the seeded generator that draws the next operation
from the reference tree's state."""

from __future__ import annotations

import errno
import functools
import os
import random
import stat
from collections.abc import Callable
from pathlib import Path

import xxhash

KiB = 1 << 10
MiB = 1 << 20

MAX_SIZE = 6 * MiB  # no file grows past this (a few reach the 5 MiB multipart threshold)
NAMES = ("a", "b", "c", "d", "e", "f")  # files and directories share the names
MAX_DEPTH = 4
TARGET_FILES = 24  # creates get rarer and unlinks likelier above this many files
MAX_DIRS = 10
SLOTS = 4  # file descriptors kept open at once
TREE = "fsx"  # the tree's directory in the mount's root (and its lake prefix)
LOG_TAIL = 20

OPEN_FLAGS = {
    "r": os.O_RDONLY,
    "rw": os.O_RDWR,
    "rw-creat": os.O_RDWR | os.O_CREAT,
    "w-trunc": os.O_WRONLY | os.O_TRUNC,
    "w-append": os.O_WRONLY | os.O_APPEND,
    "rw-append-creat": os.O_RDWR | os.O_APPEND | os.O_CREAT,
    "rw-excl": os.O_RDWR | os.O_CREAT | os.O_EXCL,
    "r-trunc": os.O_RDONLY | os.O_TRUNC,
}

# Mount options per lake kind: promotion at once (uploads race the next operations)


@functools.lru_cache(maxsize=4)
def data(dseed: int, length: int) -> bytes:
    """The bytes an operation writes: random, from its own seed."""
    return random.Random(dseed).randbytes(length)


def digest(content: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(content)


def first_difference(a: bytes, b: bytes) -> str:
    """Where two byte strings part, for a report."""
    if a == b:
        return "equal"
    for i in range(0, min(len(a), len(b)), 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            j = next(k for k in range(i, i + 4096) if a[k:k + 1] != b[k:k + 1])
            end = j
            while end < min(len(a), len(b)) and a[end] != b[end]:
                end += 1
            return (f"first difference at byte {j} (run of {end - j} bytes; expected "
                    f"{a[j:j + 16].hex()}, got {b[j:j + 16].hex()}"
                    f"{', got zeros' if not any(b[j:end]) else ''}); sizes expected "
                    f"{len(a)}, got {len(b)}")
    return f"same first {min(len(a), len(b))} bytes; sizes expected {len(a)}, got {len(b)}"


# -- one side: a tree root and the file descriptors open on it ------------------------
class Side:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.fds: dict[int, int] = {}

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else str(self.root)

    def fd(self, slot: int) -> int:
        """The fd of a slot (EBADF for a slot not open: an edited replay may ask)."""
        if slot not in self.fds:
            raise OSError(errno.EBADF, "slot not open")
        return self.fds[slot]

    def close_all(self) -> None:
        for slot in sorted(self.fds):
            os.close(self.fds.pop(slot))


def _with_fd(side: Side, rel: str, flags: int, fn: Callable[[int], object]) -> object:
    fd = os.open(side.p(rel), flags, 0o644)
    try:
        return fn(fd)
    finally:
        os.close(fd)


def _kind(st: os.stat_result) -> tuple:
    """What a stat tells that both filesystems must agree on: the type, and the
    size of a regular file."""
    if stat.S_ISREG(st.st_mode):
        return ("file", st.st_size)
    return ("dir",) if stat.S_ISDIR(st.st_mode) else (stat.S_IFMT(st.st_mode),)


# Each operation is a JSON-able list: [name, *arguments]; the same list is applied to
# both sides. ``dseed`` and ``length`` stand for ``data(dseed, length)``.
def op_pwrite(side: Side, path: str, offset: int, length: int, dseed: int) -> object:
    return _with_fd(side, path, os.O_WRONLY, lambda fd: os.pwrite(fd, data(dseed, length), offset))


def op_append(side: Side, path: str, length: int, dseed: int) -> object:
    def go(fd: int) -> object:
        os.write(fd, data(dseed, length))
        return os.fstat(fd).st_size
    return _with_fd(side, path, os.O_WRONLY | os.O_APPEND, go)


def op_create(side: Side, path: str, length: int, dseed: int) -> object:
    return _with_fd(side, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                    lambda fd: os.write(fd, data(dseed, length)))


def op_read(side: Side, path: str, offset: int, length: int) -> object:
    return _with_fd(side, path, os.O_RDONLY, lambda fd: os.pread(fd, length, offset))


def op_truncate(side: Side, path: str, size: int) -> object:
    return os.truncate(side.p(path), size)


def op_unlink(side: Side, path: str) -> object:
    return os.unlink(side.p(path))


def op_rename(side: Side, src: str, dst: str) -> object:
    return os.rename(side.p(src), side.p(dst))


def op_mkdir(side: Side, path: str) -> object:
    return os.mkdir(side.p(path))


def op_rmdir(side: Side, path: str) -> object:
    return os.rmdir(side.p(path))


def op_stat(side: Side, path: str) -> object:
    return _kind(os.stat(side.p(path)))


def op_listdir(side: Side, path: str) -> object:
    return sorted(os.listdir(side.p(path)))


def op_fsync(side: Side, path: str) -> object:
    return _with_fd(side, path, os.O_RDWR, os.fsync)


def op_open(side: Side, slot: int, path: str, flags: str) -> object:
    if slot in side.fds:  # never drawn, but an edited replay may
        os.close(side.fds.pop(slot))
    side.fds[slot] = os.open(side.p(path), OPEN_FLAGS[flags], 0o644)
    return None


def op_close(side: Side, slot: int) -> object:
    fd = side.fd(slot)
    del side.fds[slot]
    return os.close(fd)


def op_fd_pwrite(side: Side, slot: int, offset: int, length: int, dseed: int) -> object:
    fd = side.fd(slot)
    written = os.pwrite(fd, data(dseed, length), offset)
    return written, os.lseek(fd, 0, os.SEEK_CUR)


def op_fd_write(side: Side, slot: int, length: int, dseed: int) -> object:
    fd = side.fd(slot)
    written = os.write(fd, data(dseed, length))
    return written, os.lseek(fd, 0, os.SEEK_CUR)


def op_fd_pread(side: Side, slot: int, offset: int, length: int) -> object:
    return os.pread(side.fd(slot), length, offset)


def op_fd_read(side: Side, slot: int, length: int) -> object:
    fd = side.fd(slot)
    got = os.read(fd, length)
    return got, os.lseek(fd, 0, os.SEEK_CUR)


def op_fd_seek(side: Side, slot: int, offset: int, whence: int) -> object:
    return os.lseek(side.fd(slot), offset, whence)


def op_fd_ftruncate(side: Side, slot: int, size: int) -> object:
    return os.ftruncate(side.fd(slot), size)


def op_fd_fstat(side: Side, slot: int) -> object:
    return _kind(os.fstat(side.fd(slot)))


def op_fd_fsync(side: Side, slot: int) -> object:
    return os.fsync(side.fd(slot))


OPS_TABLE: dict[str, Callable[..., object]] = {
    name[3:]: fn for name, fn in globals().items() if name.startswith("op_")}
#: operations the harness runs itself (not on one side)
REMOUNT, FRESH = "remount", "fresh-remount"


def outcome(fn: Callable[[], object]) -> tuple[str, object]:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno, str(exc.errno)))


def show(result: tuple[str, object]) -> str:
    """An outcome, short: bytes as their length and digest."""
    kind, value = result

    def one(v: object) -> str:
        if isinstance(v, bytes):
            return f"<{len(v)} bytes {digest(v)}>"
        if isinstance(v, tuple):
            return "(" + ", ".join(one(x) for x in v) + ")"
        return repr(v)
    return f"{kind} {one(value)}"


def explain(expected: tuple[str, object], got: tuple[str, object]) -> str:
    parts = [f"expected {show(expected)}", f"got {show(got)}"]
    ev, gv = expected[1], got[1]
    if isinstance(ev, tuple) and isinstance(gv, tuple):
        ev = next((x for x in ev if isinstance(x, bytes)), ev)
        gv = next((x for x in gv if isinstance(x, bytes)), gv)
    if isinstance(ev, bytes) and isinstance(gv, bytes):
        parts.append(first_difference(ev, gv))
    return "; ".join(parts)


# -- the whole tree ---------------------------------------------------------------------
def scan(root: Path) -> tuple[dict[str, int], list[str]]:
    """The reference tree: files and their sizes, directories (sorted)."""
    files: dict[str, int] = {}
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel + "/"
        dirnames.sort()
        dirs.extend(prefix + d for d in dirnames)
        for name in sorted(filenames):
            files[prefix + name] = os.lstat(os.path.join(dirpath, name)).st_size
    return files, sorted(dirs)


def snapshot(root: Path) -> dict[str, tuple]:
    """path -> ("dir",) or ("file", size, digest), and the type of anything else."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel + "/"
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as fp:
                    content = fp.read()
                out[prefix + name] = ("file", len(content), digest(content), st.st_size)
            else:
                out[prefix + name] = _kind(st)
    return out


def tree_differences(ref: Path, got: Path) -> list[str]:
    expected, found = snapshot(ref), snapshot(got)
    out = []
    for path in sorted(expected.keys() | found.keys()):
        e, g = expected.get(path), found.get(path)
        if e == g:
            continue
        if e is None:
            out.append(f"{path}: extra on aifs {g}")
        elif g is None:
            out.append(f"{path}: missing on aifs (expected {e})")
        elif e[0] == g[0] == "file":
            detail = first_difference(Path(ref, path).read_bytes(), Path(got, path).read_bytes())
            out.append(f"{path}: st_size expected {e[3]} got {g[3]}; {detail}")
        else:
            out.append(f"{path}: expected {e}, got {g}")
    return out


# -- the generator ------------------------------------------------------------------------
class Generator:
    """Draws the next operation from the seed and the reference tree's state."""

    def __init__(self, seed: int, remount_every: int, fresh_every: int) -> None:
        self.rng = random.Random(seed)
        self.remount_every = remount_every
        self.fresh_every = fresh_every

    def offset(self, size: int) -> int:
        r, rng = self.rng.random(), self.rng
        if r < 0.45:
            return rng.randint(0, size + 4 * KiB)  # in the file or just past its end
        if r < 0.75:
            return rng.randint(0, 64 * KiB)
        if r < 0.95:
            return rng.randint(0, MiB)
        return rng.randint(0, MAX_SIZE - 1)  # far past the end: a hole

    def length(self, offset: int = 0) -> int:
        r, rng = self.rng.random(), self.rng
        if r < 0.55:
            n = rng.randint(1, 4 * KiB)
        elif r < 0.88:
            n = rng.randint(1, 64 * KiB)
        elif r < 0.98:
            n = rng.randint(1, 256 * KiB)
        else:
            n = rng.randint(1, MiB)
        return max(0, min(n, MAX_SIZE - offset))

    def size(self, current: int) -> int:
        r, rng = self.rng.random(), self.rng
        if r < 0.35:
            return rng.randint(0, current)
        if r < 0.65:
            return rng.randint(current, current + 64 * KiB)
        if r < 0.9:
            return rng.randint(0, 64 * KiB)
        return rng.randint(0, MAX_SIZE)

    def any_path(self) -> str:
        depth = self.rng.choice((1, 1, 2, 2, 3))
        return "/".join(self.rng.choice(NAMES) for _ in range(depth))

    def new_path(self, dirs: list[str]) -> str:
        """A name in an existing directory (now and then under a random path,
        which may not exist or be a file)."""
        rng = self.rng
        parent = rng.choice(["", *dirs]) if rng.random() < 0.85 else self.any_path()
        if parent.count("/") >= MAX_DEPTH - 1:
            parent = ""
        return (parent + "/" if parent else "") + rng.choice(NAMES)

    def a_file(self, files: dict[str, int], dirs: list[str]) -> str:
        r = self.rng.random()
        if files and r < 0.85:
            return self.rng.choice(list(files))
        if dirs and r < 0.9:
            return self.rng.choice(dirs)
        return self.any_path()

    def a_dir(self, dirs: list[str]) -> str:
        if dirs and self.rng.random() < 0.85:
            return self.rng.choice(dirs)
        return self.any_path()

    def next(self, files: dict[str, int], dirs: list[str],
             slots: dict[int, tuple[str, bool]]) -> list:
        rng = self.rng
        if rng.random() < 1 / self.remount_every:
            return [REMOUNT]
        if rng.random() < 1 / self.fresh_every:
            return [FRESH]
        many = len(files) >= TARGET_FILES
        weights = {
            "pwrite": 10, "read": 9, "append": 4, "truncate": 5,
            "create": 1 if many else 7, "unlink": 7 if many else 2,
            "rename": 5, "mkdir": 0.5 if len(dirs) >= MAX_DIRS else 2.5,
            "rmdir": 2, "stat": 3, "listdir": 1.5, "fsync": 1,
        }
        if len(slots) < SLOTS:
            weights["open"] = 4
        if slots:
            weights.update({"fd_pwrite": 12, "fd_write": 4, "fd_pread": 7, "fd_read": 3,
                            "fd_seek": 2, "fd_ftruncate": 3, "fd_fstat": 3, "fd_fsync": 1,
                            "close": 3})
        name = rng.choices(list(weights), list(weights.values()))[0]
        dseed = rng.getrandbits(48)
        if name.startswith("fd_") or name == "close":
            slot = rng.choice(sorted(slots))
            path, is_dir = slots[slot]
            size = files.get(path, 0)
            if name == "fd_pwrite":
                offset = self.offset(size)
                return [name, slot, offset, self.length(offset), dseed]
            if name == "fd_write":
                return [name, slot, self.length(size), dseed]
            if name == "fd_pread":
                return [name, slot, self.offset(size), self.length()]
            if name == "fd_read":
                return [name, slot, self.length()]
            if name == "fd_seek":
                whence = rng.choice((os.SEEK_SET, os.SEEK_SET, os.SEEK_CUR, os.SEEK_END))
                if is_dir and whence == os.SEEK_END:  # EINVAL on ext4 and tmpfs, the
                    whence = os.SEEK_CUR              # size on FUSE (the kernel's doing)
                offset = self.offset(size) if whence == os.SEEK_SET else rng.randint(-100, 100)
                return [name, slot, offset, whence]
            if name == "fd_ftruncate":
                return [name, slot, self.size(size)]
            return [name, slot]
        if name == "open":
            slot = min(set(range(SLOTS)) - set(slots))
            flags = rng.choice(list(OPEN_FLAGS))
            path = self.new_path(dirs) if rng.random() < 0.2 else self.a_file(files, dirs)
            return [name, slot, path, flags]
        if name in ("pwrite", "read"):
            path = self.a_file(files, dirs)
            offset = self.offset(files.get(path, 0))
            if name == "pwrite":
                return [name, path, offset, self.length(offset), dseed]
            return [name, path, offset, self.length()]
        if name == "append":
            path = self.a_file(files, dirs)
            return [name, path, self.length(files.get(path, 0)), dseed]
        if name == "truncate":
            path = self.a_file(files, dirs)
            return [name, path, self.size(files.get(path, 0))]
        if name == "create":
            path = self.new_path(dirs) if rng.random() < 0.8 else self.a_file(files, dirs)
            return [name, path, self.length() if rng.random() < 0.9 else 0, dseed]
        if name == "unlink" or name == "fsync":
            return [name, self.a_file(files, dirs)]
        if name in ("stat", "listdir"):
            return [name, rng.choice(["", *files, *dirs]) if rng.random() < 0.9
                    else self.any_path()]
        if name == "mkdir":
            return [name, self.new_path(dirs)]
        if name == "rmdir":
            return [name, self.a_dir(dirs)]
        assert name == "rename"
        r = rng.random()
        src = (self.a_file(files, dirs) if r < 0.6 else self.a_dir(dirs) if r < 0.9
               else self.any_path())
        r = rng.random()
        dst = (self.new_path(dirs) if r < 0.5 else self.a_file(files, dirs) if r < 0.8
               else self.a_dir(dirs))
        return [name, src, dst]
