"""Real programs on a real aifs mount: cp, tar, rsync, git, sqlite3, Python's
shutil, unzip, pip in a venv and fio write through the mount; what they wrote is
then compared, byte for byte and attribute for attribute, with what they were
given (the source tree on the local disk, a reference run of the same program
on the local disk) after ``aifs umount`` and a new mount on an EMPTY cache
directory, so everything compared comes back from the lake.

Each copy is also run on the local disk first: the test's expectation is what
the program itself does on ext4, not what we think it should do. A failure lists
the program's own errors, then every path that differs (missing, extra, or each
differing attribute as got/expected), as the mount showed it before the unmount
and again after the remount."""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import shutil
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from progtools import (
    DEEP_LEVELS,
    DEEP_LEVELS_S3,
    build_source_tree,
    diff_snapshots,
    outcome,
    report,
    run,
    sha256_of,
    snapshot,
    without,
    without_dir_times,
)
from support.lakes import HEAVY_LAKES

Copier = Callable[[Path, Path], object]


# -- the source tree (built once per depth: 64 MiB plus ~150 entries on the local disk) --
_sources: dict[int, tuple[Path, dict[str, dict]]] = {}


@pytest.fixture
def source(lake, tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The tree, with a 3,000-byte path for the local-directory lake and a
    ~950-byte one for S3 lakes (their keys hold 1,024 bytes)."""
    levels = DEEP_LEVELS if lake.kind == "local" else DEEP_LEVELS_S3
    if levels not in _sources:
        root = tmp_path_factory.mktemp("programs-source") / "src"
        build_source_tree(root, deep_levels=levels)
        _sources[levels] = root, snapshot(root)
    return _sources[levels]


_zips: dict[Path, Path] = {}


@pytest.fixture
def source_zip(source, tmp_path_factory) -> Path:
    """The source tree as a zip made by Info-ZIP zip (symlinks stored as links;
    zip cannot hold the FIFO and the device)."""
    src, _ = source
    if src not in _zips:
        out = tmp_path_factory.mktemp("programs-zip") / "tree.zip"
        result = run(["zip", "-q", "-r", "-y", str(out), ".", "-x", "special/*"], cwd=src)
        assert result.returncode == 0, result.stderr
        _zips[src] = out
    return _zips[src]


def remount(lake, mounter, mount, *, same_path: bool = False):
    """Unmount ``mount`` (everything reaches the lake) and mount the lake again on
    a new, empty cache directory: at a new mountpoint, or with ``same_path`` at
    the same one (for trees that hold their own absolute paths, like a venv)."""
    mount.unmount()
    if same_path:
        return mounter(lake, name=mount.path.name.removeprefix("mnt-"), cache="m2")
    return mounter(lake, name="m2")


def is_symlink(rel: str, record: dict) -> bool:
    return record["type"] == "symlink"


def check_copy(lake, mounter, tmp_path: Path, source, copy: Copier, what: str,
               blank: tuple[str, ...] = (), drop: tuple[str, ...] = (),
               symlink_times: bool = True,
               adjust: Callable[[dict[str, dict]], None] | None = None) -> None:
    """Copy the source tree with ``copy(src, dst)`` to the local disk (which must
    give the source tree, less the ``blank`` attributes the program does not
    keep, the ``drop`` paths it does not copy and, unless ``symlink_times``, the
    times of symlinks; ``adjust`` changes the expected records in place), then
    into the mount, and compare there before the unmount and after a remount on
    an empty cache."""
    src, src_snap = source

    def view(snap: dict[str, dict]) -> dict[str, dict]:
        snap = without(snap, blank, drop)
        return snap if symlink_times else without(snap, ["mtime_ns"], where=is_symlink)

    expected = view(src_snap)
    if adjust:
        adjust(expected)

    ref = tmp_path / "reference"
    result = copy(src, ref)
    problems = (outcome(result, f"{what} on the local disk")
                + diff_snapshots(view(snapshot(ref)), expected))
    assert not problems, "the test's expectation is not what the program does on the " \
        "local disk (fix the test):\n" + "\n".join(problems)
    shutil.rmtree(ref)

    mount = mounter(lake)
    dst = mount.path / "copy"
    result = copy(src, dst)
    before = view(snapshot(dst))
    mount2 = remount(lake, mounter, mount)
    after = view(snapshot(mount2.path / "copy"))
    message = report({
        f"{what} into the mount": outcome(result, what),
        "on the mount before unmount (got = aifs, expected = source)":
            diff_snapshots(before, expected),
        "after unmount and a remount on an empty cache (got = aifs, expected = source)":
            diff_snapshots(after, expected),
    })
    assert not message, f"{what} on the {lake.kind} lake:\n{message}"


# -- the copiers ----------------------------------------------------------------------
def cp_a(src: Path, dst: Path):
    return run(["cp", "-a", str(src), str(dst)])


def cp_p(src: Path, dst: Path):
    return run(["cp", "-pR", str(src), str(dst)])


def tar_pipe(src: Path, dst: Path):
    dst.mkdir()
    return run(f"tar -C {shlex.quote(str(src))} --xattrs --format=posix -cf - . "
               f"| tar -C {shlex.quote(str(dst))} --xattrs -xf -")


def rsync_ahax(src: Path, dst: Path):
    return run(["rsync", "-aHAX", f"{src}/", f"{dst}/"])


COPYTREE = """
import os, shutil, stat, sys

def copy(src, dst):  # copy2, and special files recreated (copy2 would read them)
    st = os.lstat(src)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        os.mknod(dst, st.st_mode, st.st_rdev)
        shutil.copystat(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst

shutil.copytree(sys.argv[1], sys.argv[2], symlinks=True, copy_function=copy)
"""


def py_copytree(src: Path, dst: Path):
    return run([sys.executable, "-c", COPYTREE, str(src), str(dst)])


# -- copies of the whole source tree ---------------------------------------------------
def test_cp_a(lake, mounter, tmp_path, source):
    """cp -a keeps everything: bytes, modes, owners, times, xattrs, hard links,
    symlinks, the FIFO and the device."""
    check_copy(lake, mounter, tmp_path, source, cp_a, "cp -a")


def test_cp_p(lake, mounter, tmp_path, source):
    """cp -pR keeps modes, owners and times, not xattrs or hard links."""
    check_copy(lake, mounter, tmp_path, source, cp_p, "cp -pR",
               blank=("xattrs", "nlink", "links"))


def test_tar_pipe_extract_into_the_mount(lake, mounter, tmp_path, source):
    """GNU tar c --xattrs (pax) | tar x --xattrs as root keeps everything."""
    check_copy(lake, mounter, tmp_path, source, tar_pipe, "tar c | tar x --xattrs")


def test_rsync_ahax(lake, mounter, tmp_path, source):
    """rsync -aHAX keeps everything."""
    check_copy(lake, mounter, tmp_path, source, rsync_ahax, "rsync -aHAX")


def test_python_copytree(lake, mounter, tmp_path, source):
    """shutil.copytree with copy2: bytes, modes, times and xattrs; not owners or
    hard links."""
    check_copy(lake, mounter, tmp_path, source, py_copytree, "shutil.copytree(copy2)",
               blank=("uid", "gid", "nlink", "links"))


def test_unzip(lake, mounter, tmp_path, source, source_zip):
    """unzip -X -K of a zip of the tree: bytes, modes (set-ID bits too), owners,
    times to the second and symlinks; zip has no xattrs, hard links, FIFOs or
    devices, unzip sets no symlink times and the root is unzip's -d directory."""
    def to_seconds(expected: dict[str, dict]) -> None:
        for record in expected.values():
            if record["mtime_ns"] is not None:
                record["mtime_ns"] -= record["mtime_ns"] % 1_000_000_000

    def unzip(src: Path, dst: Path):
        return run(["unzip", "-q", "-X", "-K", str(source_zip), "-d", str(dst)])

    check_copy(lake, mounter, tmp_path, source, unzip, "unzip -X -K",
               blank=("xattrs", "nlink", "links"), drop=(".", "special"),
               symlink_times=False, adjust=to_seconds)


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_copies_from_the_mount_to_the_mount(lake, mounter, tmp_path, source):
    """The programs as readers: the tree is put on the mount with cp -a, the lake
    mounted again on an empty cache, and cp -a, rsync -aHAX and tar copy it from
    the mount (read back from the lake) to the mount; after one more remount each
    copy must equal the tree they read, as the mount showed it."""
    src, _ = source
    mount = mounter(lake)
    first = cp_a(src, mount.path / "tree")
    mount2 = remount(lake, mounter, mount)
    tree = snapshot(mount2.path / "tree")
    copiers = {"cp -a": cp_a, "rsync -aHAX": rsync_ahax, "tar c | tar x --xattrs": tar_pipe}
    results = {what: copy(mount2.path / "tree", mount2.path / f"copy{i}")
               for i, (what, copy) in enumerate(copiers.items())}
    mount2.unmount()
    mount3 = mounter(lake, name="m3")
    sections = {"cp -a of the source tree into the mount (setup)": outcome(first, "cp -a")}
    for i, (what, result) in enumerate(results.items()):
        sections[f"{what} from the mount to the mount"] = outcome(result, what)
        sections[f"{what}: the copy after a remount (got) vs the tree it read (expected)"] = \
            diff_snapshots(snapshot(mount3.path / f"copy{i}"), tree)
    message = report(sections)
    assert not message, f"copies within the mount on the {lake.kind} lake:\n{message}"


# -- git -------------------------------------------------------------------------------
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "A U Thor",
           "GIT_AUTHOR_EMAIL": "author@example.com", "GIT_COMMITTER_NAME": "C O Mitter",
           "GIT_COMMITTER_EMAIL": "committer@example.com"}


def git(repo: Path, *args: str, when: int = 0, home: Path) -> str:
    env = dict(os.environ, **GIT_ENV, HOME=str(home))
    if when:
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"@{1_700_000_000 + when} +0000"
    result = run(["git", "-C", str(repo), *args], env=env)
    assert result.returncode == 0, f"git {' '.join(args)} in {repo}:\n{result.stderr[-3000:]}"
    return result.stdout


def make_repo(repo: Path, home: Path) -> None:
    """A repository with a few commits, a branch, a tag, loose and packed objects."""
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main", home=home)
    (repo / "README.md").write_text("# demo\n")
    (repo / "src").mkdir()
    (repo / "src" / "main.py").write_text("print('hello')\n" * 50)
    (repo / "bin").mkdir()
    (repo / "bin" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(repo / "bin" / "run.sh", 0o755)
    (repo / "data").mkdir()
    (repo / "data" / "blob.bin").write_bytes(os.urandom(1 << 20))
    os.symlink("README.md", repo / "link-to-readme")
    (repo / "héllo wörld.txt").write_text("non-ASCII name\n")
    git(repo, "add", "-A", home=home)
    git(repo, "commit", "-q", "-m", "first", when=1, home=home)
    for i in range(120):
        (repo / "src" / f"mod{i:03d}.py").write_text(f"VALUE = {i}\n" + "# pad\n" * i)
    (repo / "README.md").write_text("# demo\n\nsecond version\n")
    git(repo, "add", "-A", home=home)
    git(repo, "commit", "-q", "-m", "second: many modules", when=2, home=home)
    git(repo, "repack", "-q", "-a", "-d", home=home)  # what follows stays loose
    git(repo, "mv", "src/mod000.py", "src/renamed.py", home=home)
    with open(repo / "data" / "blob.bin", "r+b") as fp:
        fp.seek(500_000)
        fp.write(b"changed in the third commit")
    git(repo, "commit", "-q", "-a", "-m", "third: rename, binary change", when=3, home=home)
    git(repo, "checkout", "-q", "-b", "feature", home=home)
    (repo / "feature.txt").write_text("on a branch\n")
    git(repo, "add", "feature.txt", home=home)
    git(repo, "commit", "-q", "-m", "feature work", when=4, home=home)
    git(repo, "checkout", "-q", "main", home=home)
    git(repo, "tag", "-a", "v1", "-m", "release one", when=5, home=home)
    (repo / "src" / "main.py").write_text("print('hello, again')\n")
    git(repo, "commit", "-q", "-a", "-m", "fourth", when=6, home=home)


def clone_and_work(origin: Path, dst: Path, home: Path) -> None:
    """git clone, fsck, then a commit and a gc in the clone."""
    result = run(["git", "clone", "-q", str(origin), str(dst)],
                 env=dict(os.environ, **GIT_ENV, HOME=str(home)))
    assert result.returncode == 0, f"git clone into {dst}:\n{result.stderr[-3000:]}"
    git(dst, "fsck", "--full", "--strict", home=home)
    assert git(dst, "status", "--porcelain", home=home) == ""
    (dst / "src" / "new.py").write_text("NEW = 1\n")
    (dst / "README.md").write_text("# demo\n\nchanged in the clone\n")
    git(dst, "add", "-A", home=home)
    git(dst, "commit", "-q", "-m", "in the clone", when=7, home=home)
    git(dst, "gc", "-q", "--prune=now", home=home)
    git(dst, "fsck", "--full", "--strict", home=home)


def git_facts(repo: Path, home: Path) -> dict[str, str]:
    return {"log": git(repo, "log", "--all", "--format=%H %P %s", home=home),
            "refs": git(repo, "show-ref", "--head", home=home),
            "status": git(repo, "status", "--porcelain", "--ignored", home=home),
            "fsck": git(repo, "fsck", "--full", "--strict", home=home)}


def test_git_clone_and_fsck(lake, mounter, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    origin = tmp_path / "origin"
    make_repo(origin, home)
    ref = tmp_path / "reference"
    clone_and_work(origin, ref, home)
    worktree_fields = ("mtime_ns", "uid", "gid", "xattrs", "nlink", "links")
    expected_tree = without(snapshot(ref, exclude=[".git"]), worktree_fields, ["."])
    expected_facts = git_facts(ref, home)

    mount = mounter(lake)
    dst = mount.path / "clone"
    clone_and_work(origin, dst, home)
    before = snapshot(dst)
    mount2 = remount(lake, mounter, mount)
    dst2 = mount2.path / "clone"
    after = snapshot(dst2)   # before git touches it (status refreshes the index)
    message = report({
        "the clone (with .git) after the remount (got) vs before the unmount (expected)":
            diff_snapshots(without_dir_times(after), without_dir_times(before)),
        "the work tree after the remount (got) vs a clone on the local disk (expected)":
            diff_snapshots(without(snapshot(dst2, exclude=[".git"]), worktree_fields, ["."]),
                           expected_tree),
    })
    assert not message, f"git on the {lake.kind} lake:\n{message}"
    assert git_facts(dst2, home) == expected_facts


# -- sqlite3 -----------------------------------------------------------------------------
def sql_workload(journal_mode: str) -> str:
    """Many inserts in 40 transactions, updates, deletes, an index and a VACUUM,
    with a tiny page cache so pages spill to the file mid-transaction; the values
    are a function of the row, so two runs make the same database."""
    lines = [f"PRAGMA journal_mode={journal_mode};", "PRAGMA cache_size=20;",
             "PRAGMA wal_autocheckpoint=200;",
             "CREATE TABLE t(id INTEGER PRIMARY KEY, k TEXT UNIQUE, v BLOB, n INTEGER);"]
    for txn in range(40):
        start, end = txn * 500 + 1, txn * 500 + 500
        lines.append(
            f"BEGIN; WITH RECURSIVE c(x) AS (SELECT {start} UNION ALL SELECT x + 1 FROM c "
            f"WHERE x < {end}) INSERT INTO t(k, v, n) SELECT printf('key-%08d', x), "
            "substr(replace(hex(zeroblob(500)), '00', printf('%08x', "
            "(x * 2654435761) % 4294967296)), 1, 50 + (x * 7) % 900), x FROM c; COMMIT;")
    lines += ["UPDATE t SET n = n * 3 + 1, v = v || printf('-%d', id) WHERE id % 7 = 0;",
              "DELETE FROM t WHERE id % 11 = 0;",
              "CREATE INDEX t_n ON t(n);"]
    lines += [f"UPDATE t SET n = -n WHERE id = {i * 37};" for i in range(1, 200)]
    if journal_mode == "DELETE":
        lines.append("VACUUM;")
    lines.append("SELECT count(*), sum(n), sum(length(v)) FROM t;")
    return "\n".join(lines) + "\n"


LEAVE_WAL = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA wal_autocheckpoint=0")
for i in range(300):
    con.execute("BEGIN")
    con.execute("INSERT INTO t(k, v, n) VALUES (?, ?, ?)",
                (f"late-{i:05d}", bytes([i % 256]) * ((i * 7) % 3000), i))
    con.execute("COMMIT")
con.execute("UPDATE t SET n = -n WHERE id % 13 = 0")
os._exit(0)  # no close: the WAL and its index stay, as after a crash
"""


def sqlite_run(directory: Path) -> dict[str, str]:
    """The workload in rollback-journal and in WAL mode with the sqlite3 shell;
    then more WAL transactions from a process that exits without closing. What
    the shell printed, by database."""
    directory.mkdir(exist_ok=True)
    printed = {}
    for mode in ("DELETE", "WAL"):
        db = directory / f"{mode.lower()}.db"
        result = run(["sqlite3", "-bail", str(db)], input=sql_workload(mode))
        assert result.returncode == 0, f"sqlite3 {db}: {result.stderr[-2000:]}"
        printed[db.name] = result.stdout
    result = run([sys.executable, "-c", LEAVE_WAL, str(directory / "wal.db")])
    assert result.returncode == 0, f"leaving a WAL: {result.stderr[-2000:]}"
    return printed


def sqlite_check(db: Path) -> dict[str, str]:
    """integrity_check, and the whole content as .dump prints it."""
    integrity = run(["sqlite3", "-bail", str(db), "PRAGMA integrity_check;"])
    dump = run(["sqlite3", "-bail", str(db), ".dump"])
    return {"integrity_check": integrity.stdout.strip() + integrity.stderr.strip(),
            "dump_sha256": hashlib.sha256(dump.stdout.encode()).hexdigest(),
            "dump_lines": str(len(dump.stdout.splitlines())),
            "dump_error": dump.stderr.strip()}


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_sqlite3_journal_and_wal(lake, mounter, tmp_path):
    ref = tmp_path / "reference"
    expected_printed = sqlite_run(ref)
    assert (ref / "wal.db-wal").stat().st_size > 0, "the WAL must be left behind"
    expected_files = snapshot(ref)
    expected = {db: sqlite_check(ref / db) for db in ("delete.db", "wal.db")}
    assert expected["wal.db"]["integrity_check"] == "ok"

    mount = mounter(lake)
    dst = mount.path / "db"
    printed = sqlite_run(dst)
    assert printed == expected_printed
    before = snapshot(dst)
    mount2 = remount(lake, mounter, mount)
    dst2 = mount2.path / "db"
    after = snapshot(dst2)
    # the rollback-journal database is the same file as on the local disk; the WAL
    # files hold random salts, so they are compared with the mount's own before
    same_as_local = {k: v for k, v in without(after, ["mtime_ns"]).items()
                     if k == "delete.db"}
    message = report({
        "the databases after the remount (got) vs before the unmount (expected)":
            diff_snapshots(without_dir_times(after), without_dir_times(before)),
        "delete.db after the remount (got) vs the local disk's (expected)":
            diff_snapshots(same_as_local,
                           {"delete.db": without(expected_files, ["mtime_ns"])["delete.db"]}),
    })
    assert not message, f"sqlite3 on the {lake.kind} lake:\n{message}"
    got = {db: sqlite_check(dst2 / db) for db in ("delete.db", "wal.db")}
    assert got == expected


# -- pip install into a venv on the mount ------------------------------------------------
def make_wheel(directory: Path) -> Path:
    """A pure-Python wheel made with zipfile: a package with a data file and a
    console script."""
    name, version = "aifsdemo", "1.0"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n\n\ndef main():\n    print('hello from aifsdemo')\n",
        f"{name}/data.bin": bytes(range(256)) * 40,
        f"{name}/sub/__init__.py": "from .. import VALUE\nDOUBLE = VALUE * 2\n",
        f"{name}-{version}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: demo\n",
        f"{name}-{version}.dist-info/WHEEL":
            "Wheel-Version: 1.0\nGenerator: aifs-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        f"{name}-{version}.dist-info/entry_points.txt":
            f"[console_scripts]\naifsdemo-hello = {name}:main\n",
        f"{name}-{version}.dist-info/top_level.txt": f"{name}\n",
    }
    record = []
    for path, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        digest = hashlib.sha256(data).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(data)}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, content in files.items():
            zf.writestr(path, content)
    return wheel


USE_IT = textwrap.dedent("""
    import aifsdemo, aifsdemo.sub, importlib.resources
    assert aifsdemo.VALUE == 42 and aifsdemo.sub.DOUBLE == 84
    data = importlib.resources.files("aifsdemo").joinpath("data.bin").read_bytes()
    assert data == bytes(range(256)) * 40
    print("imported", aifsdemo.__file__)
""")


@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_pip_install_into_a_venv_on_the_mount(lake, mounter, tmp_path):
    wheel = make_wheel(tmp_path)
    mount = mounter(lake)
    venv = mount.path / "venv"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index",
              "--no-cache-dir", "--disable-pip-version-check", str(wheel)],
             [str(venv / "bin" / "python"), "-c", USE_IT],
             [str(venv / "bin" / "aifsdemo-hello")]]
    for step in steps:
        result = run(step)
        assert result.returncode == 0, f"{step[0]} {step[1:3]}: {result.stderr[-3000:]}"
    assert result.stdout == "hello from aifsdemo\n"
    before = snapshot(venv)
    # the venv names its own absolute path: mount the lake again at the same place
    mount2 = remount(lake, mounter, mount, same_path=True)
    after = snapshot(venv)
    site = next((mount2.path / "venv" / "lib").glob("python3*/site-packages"))
    record = (site / "aifsdemo-1.0.dist-info" / "RECORD").read_text().splitlines()
    bad_record = []
    for line in record:
        path, digest, size = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            got = base64.urlsafe_b64encode(
                bytes.fromhex(sha256_of(site / path))).rstrip(b"=").decode()
            if f"sha256={got}" != digest:
                bad_record.append(f"{path}: sha256={got}, RECORD says {digest}")
    message = report({
        "the venv after the remount (got) vs before the unmount (expected)":
            diff_snapshots(without_dir_times(after), without_dir_times(before)),
        "installed files that do not match the wheel's RECORD": bad_record,
    })
    assert not message, f"pip on the {lake.kind} lake:\n{message}"
    for step in steps[2:] + [[str(venv / "bin" / "python"), "-m", "pip", "list",
                              "--disable-pip-version-check"]]:
        result = run(step)
        assert result.returncode == 0, f"after the remount, {step}: {result.stderr[-3000:]}"
    assert "aifsdemo" in result.stdout
    result = run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y",
                  "--disable-pip-version-check", "aifsdemo"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (site / "aifsdemo").exists()
    mount2.unmount()


# -- fio ----------------------------------------------------------------------------------
FIO_JOBS = """
[global]
ioengine=psync
direct=0
randrepeat=1
verify=crc32c
verify_fatal=1
do_verify=1
size={size}

[rand4k]
rw=randwrite
bs=4k

[rand64k]
rw=randwrite
bs=64k

[rand-mixed-bs]
rw=randwrite
bsrange=4k-256k

[seq1m]
rw=write
bs=1m
"""

FIO_READ = """
[global]
ioengine=psync
direct=0
size={size}

[reread]
rw=randread
bs=16k
filename={files}
"""


def fio(directory: Path, job: Path, *extra: str):
    """fio, run in the job file's directory (it leaves its verify state files
    in the working directory)."""
    return run(["fio", f"--directory={directory}", "--output-format=terse", *extra,
                str(job)], timeout=300, cwd=job.parent)


def streamed_times(lake, snap: dict[str, dict]) -> dict[str, dict]:
    """On S3 lakes a file written front to back from empty past
    multipart_threshold (16 MiB) streams to the lake as it is written; its
    object gets the lake's completion time as mtime unless the time is set
    explicitly (a difference listed in docs/SEMANTICS.md)."""
    if lake.kind == "local":
        return snap
    return without(snap, ["mtime_ns"],
                   where=lambda rel, r: r["type"] == "file" and r["size"] >= 16 * (1 << 20))


def test_fio_verify(lake, mounter, tmp_path):
    """Four fio jobs write files at random offsets with crc32c verification headers
    and read them back verified; after the remount fio --verify_only checks every
    block again, and a random reader reads all of them."""
    size = "16m"
    jobs = tmp_path / "write.fio"
    jobs.write_text(FIO_JOBS.format(size=size))
    files = ":".join(f"{name}.0.0" for name in ("rand4k", "rand64k", "rand-mixed-bs", "seq1m"))
    reader = tmp_path / "read.fio"
    reader.write_text(FIO_READ.format(size=size, files=files))
    ref = tmp_path / "reference"
    ref.mkdir()
    for result in (fio(ref, jobs), fio(ref, jobs, "--verify_only"), fio(ref, reader)):
        assert result.returncode == 0, f"fio on the local disk: {result.stderr[-3000:]}"

    mount = mounter(lake)
    dst = mount.path / "fio"
    dst.mkdir()
    written = fio(dst, jobs)
    read = fio(dst, reader)
    before = snapshot(dst)
    mount2 = remount(lake, mounter, mount)
    dst2 = mount2.path / "fio"
    after = snapshot(dst2) if dst2.is_dir() else {}
    verified = fio(dst2, jobs, "--verify_only")
    reread = fio(dst2, reader)
    message = report({
        "fio write+verify on the mount": outcome(written, "fio"),
        "fio randread on the mount": outcome(read, "fio"),
        "the files after the remount (got) vs before the unmount (expected)":
            diff_snapshots(streamed_times(lake, without_dir_times(after)),
                           streamed_times(lake, without_dir_times(before))),
        "fio --verify_only after the remount": outcome(verified, "fio --verify_only"),
        "fio randread after the remount": outcome(reread, "fio"),
    })
    assert not message, f"fio on the {lake.kind} lake:\n{message}"

