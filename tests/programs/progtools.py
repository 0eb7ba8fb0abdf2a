"""Helpers of tests/programs: a source tree with everything a local disk can hold,
a snapshot of a tree (every entry's type, mode, size, times, owner, link target,
content digest, user xattrs and hard-link group) and a readable diff of two."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

KiB = 1 << 10
MiB = 1 << 20

#: the fields of a snapshot record, in the order a diff names them
FIELDS = ("error", "type", "mode", "size", "mtime_ns", "uid", "gid", "target", "sha256", "xattrs",
          "nlink", "links", "rdev")

#: aifs's read-only facts (cache state, key, ETag): listed, never copied data
AIFS_XATTRS = "user.aifs."
BASE_NS = 1_600_000_000_123_456_789  # Sep 2020, with nanoseconds
DEEP_LEVELS = 14                     # 14 directories of 200-byte names: a ~3,000-byte path
#: S3 keys hold at most 1,024 bytes (aifs refuses longer names with ENAMETOOLONG,
#: see docs/SEMANTICS.md): on S3 lakes the deep path has 4 levels (~950 bytes)
DEEP_LEVELS_S3 = 4


def _data(seed: int, size: int) -> bytes:
    """``size`` bytes that differ from seed to seed (random above 64 KiB)."""
    if size > 64 * KiB:
        return os.urandom(size)
    block = hashlib.sha256(seed.to_bytes(8, "little")).digest() * 4  # 128 bytes
    return (block * (size // len(block) + 1))[:size]


def deep_relpath(levels: int = DEEP_LEVELS) -> str:
    """The deep path of the source tree (``levels`` directories of 200-byte names)."""
    parts = [f"{i:02d}-" + "d" * 197 for i in range(levels)]
    return "deep/" + "/".join(parts) + "/" + "f" * 120 + ".txt"


#: names of the source tree (relative paths) that tests refer to
BIG = "big.bin"
FIFO = "special/fifo"
CHARDEV = "special/null-like"
NAME_255 = "names/" + "a" * 255
NAME_255_UTF8 = "names/" + "é" * 127 + "x"   # 255 bytes, 128 characters


def build_source_tree(root: Path, big_size: int = 64 * MiB,
                      deep_levels: int = DEEP_LEVELS) -> None:
    """Everything a local disk holds, under ``root`` (which must not exist): files of
    0 bytes to ``big_size``, many small ones, symlinks (relative, absolute, dangling,
    to a directory, a long target), hard links, a FIFO, a character device, empty
    directories, odd modes, other owners, user xattrs, 255-byte and non-ASCII
    names and a ~3,000-byte path. Every entry gets its own mtime (with nanoseconds),
    directories last, so the tree is exact to the nanosecond."""
    root.mkdir()
    seed = 0

    def write(rel: str, size: int, mode: int = 0o644) -> Path:
        nonlocal seed
        seed += 1
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_data(seed, size))
        os.chmod(path, mode)
        return path

    # sizes around page, pack (1 MiB) and part boundaries; one big file
    for rel, size in [("empty.txt", 0), ("one.txt", 1), ("page-1.bin", 4095),
                      ("page.bin", 4096), ("page+1.bin", 4097),
                      ("sizes/64k+1.bin", 64 * KiB + 1), ("sizes/128k+1.bin", 128 * KiB + 1),
                      ("sizes/1m-1.bin", MiB - 1), ("sizes/1m.bin", MiB),
                      ("sizes/1m+1.bin", MiB + 1), ("sizes/9m+3.bin", 9 * MiB + 3),
                      (BIG, big_size)]:
        write(rel, size)
    for i in range(60):  # many small files (the packing path)
        write(f"small/f{i:03d}.dat", (i * 997) % 3000)

    # modes (the chmod is the last change of each, after any chown)
    write("modes/private.txt", 100, 0o600)
    write("modes/setuid", 2000, 0o4755)
    write("modes/setgid", 2001, 0o2755)
    write("modes/nothing", 50, 0o000)
    write("modes/exec.sh", 30, 0o755)
    write("modes/readonly", 40, 0o444)
    write("modes/sticky-dir/inside.txt", 10)
    os.chmod(root / "modes/sticky-dir", 0o1777)
    (root / "modes/setgid-dir").mkdir()
    write("modes/setgid-dir/inside.txt", 11)
    os.chmod(root / "modes/setgid-dir", 0o2755)
    (root / "modes/private-dir").mkdir()
    os.chmod(root / "modes/private-dir", 0o700)

    # other owners
    for rel, uid, gid, mode in [("owners/u1000", 1000, 1000, 0o640),
                                ("owners/u1234-g5678", 1234, 5678, 0o664),
                                ("owners/setuid-u1000", 1000, 1000, 0o4750)]:
        path = write(rel, 333)
        os.chown(path, uid, gid)
        os.chmod(path, mode)
    (root / "owners/dir-u1001").mkdir()
    write("owners/dir-u1001/inner", 20)
    os.chown(root / "owners/dir-u1001/inner", 1001, 1002)
    os.chown(root / "owners/dir-u1001", 1001, 1002)

    # hard links: three names (two directories) of one file, two of an empty one
    write("links/hard/a", 5000)
    os.link(root / "links/hard/a", root / "links/hard/b")
    (root / "links/other").mkdir(parents=True)
    os.link(root / "links/hard/a", root / "links/other/c")
    write("links/hard/empty-a", 0, 0o600)
    os.link(root / "links/hard/empty-a", root / "links/hard/empty-b")
    os.setxattr(root / "links/hard/a", "user.linked", b"shared by three names")

    # symlinks
    os.symlink("../one.txt", root / "links/rel")
    os.symlink("/etc/hostname", root / "links/abs")
    os.symlink("does/not/exist", root / "links/dangling")
    os.symlink("../modes", root / "links/to-dir")
    os.symlink("/".join(["long-target"] * 90), root / "links/long")  # ~1,100 bytes
    os.symlink("../names/héllo wörld ☃.txt", root / "links/unicode")
    os.symlink("../one.txt", root / "links/owned-1000")
    os.chown(root / "links/owned-1000", 1000, 1000, follow_symlinks=False)

    # special files
    (root / "special").mkdir()
    os.mkfifo(root / FIFO, 0o640)
    os.mknod(root / CHARDEV, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.chmod(root / CHARDEV, 0o666)

    # empty directories
    (root / "empty/nested/deeper").mkdir(parents=True)
    (root / "empty-with-xattr").mkdir()
    os.setxattr(root / "empty-with-xattr", "user.tag", b"empty dir")

    # names
    for i, rel in enumerate([NAME_255, NAME_255_UTF8, "names/日本語のファイル名.txt",
                             "names/héllo wörld ☃.txt", "names/\u00e9-nfc",
                             "names/e\u0301-nfd", "names/spaces and 'quotes' \"x\".txt",
                             "names/-leading-dash", "names/.hidden", "names/🦄 emoji"]):
        write(rel, 10 + i)
    write(deep_relpath(deep_levels), 777)

    # user xattrs
    path = write("xattrs/file", 64)
    os.setxattr(path, "user.comment", b"hello xattr")
    os.setxattr(path, "user.binary", bytes([0, 1, 2, 255, 254]))
    os.setxattr(path, "user.empty", b"")
    os.setxattr(root / "xattrs", "user.dir", b"on a directory")
    os.setxattr(root, "user.root", b"top")

    # times: every entry its own, children before their directories
    paths = sorted(_walk(root), key=lambda p: (-p.count("/"), p))
    for i, rel in enumerate(paths):
        ns = BASE_NS + i * 1_000_003_007
        os.utime(root / rel if rel != "." else root, ns=(ns, ns), follow_symlinks=False)
    os.utime(root, ns=(BASE_NS - 77, BASE_NS - 77))


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _walk(root: Path, errors: dict[str, str] | None = None) -> Iterable[str]:
    """Every relative path below ``root`` (symlinks not followed), and "."; a
    directory that cannot be listed is put in ``errors`` with its errno."""
    def failed(exc: OSError) -> None:
        if errors is not None:
            rel = os.path.relpath(exc.filename, root) if exc.filename else "?"
            errors[rel] = f"listdir: {_errname(exc)}"

    yield "."
    for dirpath, dirnames, filenames in os.walk(root, onerror=failed):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            yield name if rel == "." else f"{rel}/{name}"


_TYPES = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink",
          stat.S_IFIFO: "fifo", stat.S_IFCHR: "chardev", stat.S_IFBLK: "blockdev",
          stat.S_IFSOCK: "socket"}


def sha256_of(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        while chunk := fp.read(4 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def _user_xattrs(path: Path) -> tuple:
    """The sorted (name, value) user xattrs of ``path`` itself, without aifs's own
    read-only facts (``user.aifs.*``: its documented extension, not data); an
    error is shown in place of what it hid."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        return (("<listxattr error>", _errname(exc)),)
    out = []
    for name in names:
        if not name.startswith("user.") or name.startswith(AIFS_XATTRS):
            continue
        try:
            out.append((name, os.getxattr(path, name, follow_symlinks=False)))
        except OSError as exc:
            out.append((name, f"<getxattr error {_errname(exc)}>"))
    return tuple(sorted(out))


def snapshot(root: Path, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """{relative path: record} for ``root`` and everything below it, by lstat:
    error (the errno lstat, listing or reading gave, else None), type, mode
    (octal), size (None for directories: it is the filesystem's own), mtime_ns,
    uid, gid, symlink target, sha256 of a file's bytes, sorted user xattrs,
    nlink (not for directories), the hard-link group (the sorted paths that
    share an inode, when more than one) and a device's (major, minor).
    A path in ``exclude`` is left out with everything below it."""
    excluded = tuple(exclude)
    out: dict[str, dict] = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    errors: dict[str, str] = {}
    for rel in _walk(root, errors):
        if any(rel == e or rel.startswith(e + "/") for e in excluded):
            continue
        path = root if rel == "." else root / rel
        try:
            st = os.lstat(path)
        except OSError as exc:
            out[rel] = dict.fromkeys(FIELDS, None) | {"error": f"lstat: {_errname(exc)}"}
            continue
        kind = _TYPES.get(stat.S_IFMT(st.st_mode), oct(stat.S_IFMT(st.st_mode)))
        xattrs = _user_xattrs(path)
        record = {
            "error": None, "type": kind, "mode": oct(stat.S_IMODE(st.st_mode)),
            "size": None if kind == "dir" else st.st_size, "mtime_ns": st.st_mtime_ns,
            "uid": st.st_uid, "gid": st.st_gid,
            "target": os.readlink(path) if kind == "symlink" else None,
            "sha256": None, "xattrs": xattrs,
            "nlink": None if kind == "dir" else st.st_nlink, "links": None,
            "rdev": (os.major(st.st_rdev), os.minor(st.st_rdev))
            if kind in ("chardev", "blockdev") else None,
        }
        if kind == "file":
            try:
                record["sha256"] = sha256_of(path)
            except OSError as exc:
                record["error"] = f"read: {_errname(exc)}"
        if kind != "dir":
            inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
        out[rel] = record
    for group in inodes.values():
        if len(group) > 1:
            for rel in group:
                out[rel]["links"] = tuple(sorted(group))
    for rel, error in errors.items():
        if rel in out:
            out[rel]["error"] = error
    return out


def without_dir_times(snap: dict[str, dict]) -> dict[str, dict]:
    """``snap`` without the mtimes of directories: the time a directory gets
    from changes of its entries is node-local in aifs (a difference listed in
    docs/SEMANTICS.md); times programs set with utime are kept."""
    return without(snap, ["mtime_ns"], where=lambda rel, record: record["type"] == "dir")


def without(snap: dict[str, dict], fields: Iterable[str] = (), paths: Iterable[str] = (),
            where: Callable[[str, dict], bool] | None = None) -> dict[str, dict]:
    """A copy of ``snap`` with ``fields`` blanked (None) in every record (or, with
    ``where``, in the records for which ``where(rel, record)`` is true) and the
    ``paths`` (and everything below them) left out."""
    fields = tuple(fields)
    dropped = tuple(paths)
    out = {}
    for rel, record in snap.items():
        if any(rel == p or rel.startswith(p + "/") for p in dropped):
            continue
        record = dict(record)
        if where is None or where(rel, record):
            for field in fields:
                record[field] = None
        out[rel] = record
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 90 else text[:60] + "..." + text[-20:]


def _short_path(rel: str) -> str:
    return rel if len(rel) <= 100 else rel[:50] + f"...({len(rel)} bytes)..." + rel[-40:]


def diff_snapshots(got: dict[str, dict], expected: dict[str, dict],
                   limit: int = 40) -> list[str]:
    """Readable lines, one per differing path: what is missing, what is extra,
    and for the rest each differing field as got/expected. Empty when equal."""
    lines = []
    for rel in sorted(expected.keys() - got.keys()):
        lines.append(f"MISSING {_short_path(rel)} ({expected[rel]['type']})")
    for rel in sorted(got.keys() - expected.keys()):
        lines.append(f"EXTRA   {_short_path(rel)} ({got[rel]['type']})")
    for rel in sorted(got.keys() & expected.keys()):
        a, b = got[rel], expected[rel]
        fields = [f"{f}: got {_short(a.get(f))} expected {_short(b.get(f))}"
                  for f in FIELDS if a.get(f) != b.get(f)]
        if fields:
            lines.append(f"DIFFER  {_short_path(rel)}: " + "; ".join(fields))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def run(cmd: list[str] | str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """Run a program (a list, or a bash -o pipefail line), capture its output."""
    if isinstance(cmd, str):
        cmd = ["bash", "-o", "pipefail", "-c", cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          errors="replace", **kwargs)


def outcome(result: subprocess.CompletedProcess, what: str) -> list[str]:
    """[] when the program succeeded, else a line with its status and output."""
    if result.returncode == 0:
        return []
    tail = (result.stdout[-1500:] + "\n" + result.stderr[-2500:]).strip()
    return [f"{what} exited with {result.returncode}:\n{tail}"]


def report(sections: dict[str, list[str]]) -> str:
    """Join the non-empty sections (title: lines) into one failure message."""
    return "\n".join(f"--- {title} ---\n" + "\n".join(lines)
                     for title, lines in sections.items() if lines)
