"""Crash tests of the write path: a writer process creates and closes files, the
daemon is SIGKILLed at a chosen moment, a new mount on the same cache directory
promotes what was left, and ``aifs sync`` returns once it is in the lake. Checked
directly in the lake: every file closed before the kill has exactly its bytes; a
background poller sees no object of a closed file that is not complete; no
multipart upload is left behind."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash
from support.lakes import lake_keys, lake_upload_parts, lake_uploads
from support.mounts import file_digest, wait_for
from support.packed import lake_digest, lake_size

MiB = 1 << 20

# The writer: copies each source file into the mount (one open, writes, close) and
# prints "closed NAME" after each close; then renames; then, if asked, writes a
# stream into one more file without ever closing it, printing "writing" once the
# first 4 MiB are in, and "written" when the whole stream is.
WRITER = r"""
import json, os, sys, time
plan = json.loads(sys.argv[1])
root = plan["root"]
try:
    for name, src in plan["files"]:
        dst = os.path.join(root, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(src, "rb") as s, open(dst, "wb") as d:
            while chunk := s.read(4 << 20):
                d.write(chunk)
        print("closed", name, flush=True)
    for old, new in plan.get("renames", []):
        os.rename(os.path.join(root, old), os.path.join(root, new))
        print("renamed", new, flush=True)
    if plan.get("partial"):
        name, src = plan["partial"]
        with open(src, "rb") as s:
            stream = s.read()
        fd = os.open(os.path.join(root, name), os.O_WRONLY | os.O_CREAT, 0o644)
        for offset in range(0, len(stream), 256 << 10):
            os.write(fd, stream[offset:offset + (256 << 10)])
            if offset == 4 << 20:
                print("writing", flush=True)
        print("written", flush=True)
    print("done", flush=True)
except OSError as exc:
    print("error", exc, flush=True)
    sys.exit(0)
time.sleep(3600)
"""


class Writer:
    def __init__(self, root: Path, files: dict[str, Path], log: Path,
                 renames: tuple[tuple[str, str], ...] = (), partial: tuple[str, Path] | None = None
                 ) -> None:
        plan = {"root": str(root), "files": [[n, str(p)] for n, p in files.items()],
                "renames": list(renames),
                "partial": [partial[0], str(partial[1])] if partial else None}
        self.stderr = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(plan)],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.seen: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())

    def _drain(self) -> None:
        while True:
            try:
                self.seen.append(self._lines.get_nowait())
            except queue.Empty:
                return

    def expect(self, line: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"writer did not say {line!r} in {timeout}s: {self.seen}")
            try:
                self.seen.append(self._lines.get(timeout=0.2))
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._drain()
                    if line not in self.seen:
                        raise AssertionError(
                            f"writer exited without {line!r}: {self.seen}") from None
            if any(s.startswith("error") for s in self.seen):
                raise AssertionError(f"writer failed: {self.seen}")

    def closed(self) -> set[str]:
        self._drain()
        return {s.split(" ", 1)[1] for s in self.seen if s.startswith("closed ")}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._drain()
        self.stderr.close()


class SizePoller:
    """Polls the lake for some keys during the whole test; records every size seen."""

    def __init__(self, lake, keys: list[str]) -> None:
        self.lake = lake
        self.seen: dict[str, set[int]] = {key: set() for key in keys}
        self.errors: list[str] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key in self.seen:
                try:
                    size = lake_size(self.lake, key)
                except Exception as exc:  # reported by check()
                    self.errors.append(f"{key}: {exc!r}")
                    continue
                if size is not None:
                    self.seen[key].add(size)
            self.rounds += 1
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self, sizes: dict[str, int]) -> None:
        assert self.rounds > 10, "the poller hardly ran"
        assert not self.errors[:5], self.errors[:5]
        partial = {key: sorted(seen) for key, seen in self.seen.items()
                   if seen - {sizes[key]}}
        assert not partial, f"incomplete objects were visible in the lake: {partial}"


class Source:
    def __init__(self, path: Path, size: int, digest: str) -> None:
        self.path, self.size, self.digest = path, size, digest


def make_sources(directory: Path, sizes: dict[str, int]) -> dict[str, Source]:
    directory.mkdir(exist_ok=True)
    out = {}
    for name, size in sizes.items():
        path = directory / name.replace("/", "__")
        hasher = xxhash.xxh3_128()
        with open(path, "wb") as fp:
            left = size
            while left:
                chunk = os.urandom(min(left, 16 * MiB))
                fp.write(chunk)
                hasher.update(chunk)
                left -= len(chunk)
        out[name] = Source(path, size, hasher.hexdigest())
    return out


def sync(aifs_cli, path: Path) -> None:
    result = aifs_cli("sync", str(path), timeout=600)
    assert result.returncode == 0, f"aifs sync {path} failed: {result.stderr[-2000:]}"


def kill_daemon(mount) -> None:
    mount.proc.kill()
    mount.kill()  # reap it and clear the dead mount


def assert_all_in_lake(lake, mountpoint: Path, sources: dict[str, Source]) -> None:
    for name, source in sources.items():
        assert lake_size(lake, name) == source.size, f"{name} in the lake"
        assert lake_digest(lake, name) == source.digest, f"{name}: other bytes in the lake"
        assert file_digest(mountpoint / name) == source.digest, f"{name} through the mount"


def assert_no_uploads_left(lake) -> None:
    assert lake_uploads(lake) == [], "unfinished multipart uploads left in the lake"


def kill_with_a_file_open(lake, mounter, aifs_cli, tmp_path: Path, mount_args: tuple[str, ...],
                          moment: str, then=None, what: str = "") -> None:
    """Close some files, leave a 64 MiB one open, SIGKILL the daemon once the writer
    says ``moment`` (and ``then()`` holds), recover, check the lake: the closed files
    exact; the open one, never closed nor fsynced, not published (no object ever
    partial) and what was written of it, a prefix, in the recovery directory that
    ``aifs status`` names."""
    sources = make_sources(tmp_path / "src", {
        "small.txt": 100, "empty": 0, "one-mib.bin": MiB + 7, "dir/multi.bin": 20 * MiB + 3})
    stream = make_sources(tmp_path / "src", {"partial.bin": 64 * MiB})["partial.bin"]
    poller = SizePoller(lake, [*sources, "partial.bin"])
    writer = None
    try:
        mount = mounter(lake, "--promote-delay", "0.2", *mount_args, name="first")
        writer = Writer(mount.path, {n: s.path for n, s in sources.items()},
                        tmp_path / "writer.log", partial=("partial.bin", stream.path))
        for name in sources:
            writer.expect(f"closed {name}")
        writer.expect(moment)
        if then is not None:
            wait_for(then, 60, what, interval=0.01)
        kill_daemon(mount)
        writer.stop()
        again = mounter(lake, "--promote-delay", "0.2", name="second", cache="first")
        sync(aifs_cli, again.path)
        assert_all_in_lake(lake, again.path, sources)
        # the file open at the kill is not published: not in the mount, not in the lake
        assert not (again.path / "partial.bin").exists()
        assert "partial.bin" not in lake_keys(lake)
        # what was written of it is in the recovery directory: a prefix, never garbage
        recovered = list((again.cache_dir / "recovered").glob("*/partial.bin"))
        assert len(recovered) == 1, recovered
        content = recovered[0].read_bytes()
        assert content == stream.path.read_bytes()[:len(content)], \
            f"partial.bin ({len(content)} bytes) is not a prefix of what was written"
        status = aifs_cli("status", str(again.path))
        assert status.returncode == 0, status.stderr
        assert "1 files written but never closed" in status.stdout, status.stdout
        assert str(again.cache_dir / "recovered") in status.stdout
        assert_no_uploads_left(lake)
    finally:
        poller.stop()
        if writer:
            writer.stop()
    poller.check({n: s.size for n, s in sources.items()} | {"partial.bin": -1})


def test_kill_while_a_file_is_being_written(lake, mounter, aifs_cli, tmp_path):
    kill_with_a_file_open(lake, mounter, aifs_cli, tmp_path, (), "writing")


def test_kill_while_a_large_file_is_streamed(lake, mounter, aifs_cli, tmp_path):
    """The open file is being uploaded while written (streaming): killed once the
    lake holds some of its parts. The next mount aborts that upload and promotes
    what the local copy holds; the key never shows a partial object."""
    kill_with_a_file_open(lake, mounter, aifs_cli, tmp_path,
                          ("--part-size", "5M", "--multipart-threshold", "5M",
                           "--stream-large-files", "true"), "written",
                          # dir/multi.bin streamed too: once it is complete, the
                          # parts left are the open file's
                          lambda: (lake_size(lake, "dir/multi.bin") == 20 * MiB + 3
                                   and lake_upload_parts(lake) > 0),
                          "parts of the open file in the lake")


def test_kill_after_close_before_upload(lake, mounter, aifs_cli, tmp_path):
    sources = make_sources(tmp_path / "src", {
        "small.txt": 100, "empty": 0, "one-mib.bin": MiB + 7, "dir/multi.bin": 20 * MiB + 3,
        "deep/er/x.bin": 4097, "before-rename": 333})
    poller = SizePoller(lake, list(sources) + ["renamed"])
    writer = None
    try:
        mount = mounter(lake, "--promote-delay", "3600", name="first")
        writer = Writer(mount.path, {n: s.path for n, s in sources.items()},
                        tmp_path / "writer.log", renames=(("before-rename", "renamed"),))
        writer.expect("done")
        assert (mount.path / "renamed").read_bytes() == sources["before-rename"].path.read_bytes()
        uploaded = set(lake_keys(lake)) & (set(sources) | {"renamed"})
        assert not uploaded, f"promoted despite --promote-delay 3600: {uploaded}"
        kill_daemon(mount)
        writer.stop()
        again = mounter(lake, "--promote-delay", "0.2", name="second", cache="first")
        sync(aifs_cli, again.path)
        sources["renamed"] = sources.pop("before-rename")
        assert_all_in_lake(lake, again.path, sources)
        assert lake_size(lake, "before-rename") is None
        assert not (again.path / "before-rename").exists()
        assert_no_uploads_left(lake)
    finally:
        poller.stop()
        if writer:
            writer.stop()
    poller.check({n: s.size for n, s in sources.items()} | {"before-rename": 333})


def kill_during_multipart(lake, mounter, aifs_cli, tmp_path: Path, size: int,
                          moment, what: str) -> None:
    """Write small files and one of ``size`` bytes (5 MiB parts, one in flight, promoted
    at once), SIGKILL the daemon when ``moment()`` is true, recover, check the lake."""
    sources = make_sources(tmp_path / "src", {"small.txt": 100, "one-mib.bin": MiB + 7,
                                              "big.bin": size})
    poller = SizePoller(lake, list(sources))
    writer = None
    try:
        # promoted after close by the promoter, not streamed while written
        mount = mounter(lake, "--part-size", "5M", "--parts-in-flight", "1",
                        "--promote-delay", "0", "--stream-large-files", "false",
                        name="first")
        writer = Writer(mount.path, {n: s.path for n, s in sources.items()},
                        tmp_path / "writer.log")
        writer.expect("closed big.bin", timeout=300)
        wait_for(moment, 120, what, interval=0.001 if lake.kind == "local" else 0.01)
        kill_daemon(mount)
        writer.stop()
        again = mounter(lake, "--promote-delay", "0.2", name="second", cache="first")
        sync(aifs_cli, again.path)
        assert_all_in_lake(lake, again.path, sources)
        assert_no_uploads_left(lake)
    finally:
        poller.stop()
        if writer:
            writer.stop()
    poller.check({n: s.size for n, s in sources.items()})


@pytest.mark.slow
def test_kill_during_a_multipart_upload(lake, mounter, aifs_cli, tmp_path):
    """300 MiB in 60 parts: killed once some parts are in the lake, before the end."""
    kill_during_multipart(lake, mounter, aifs_cli, tmp_path, 300 * MiB,
                          lambda: lake_upload_parts(lake) > 0,
                          "an unfinished multipart upload with parts in the lake")


def test_kill_as_a_multipart_upload_starts(lake, mounter, aifs_cli, tmp_path):
    """Killed as soon as the lake shows the upload (often before its first part)."""
    kill_during_multipart(lake, mounter, aifs_cli, tmp_path, 30 * MiB,
                          lambda: lake_uploads(lake),
                          "an unfinished multipart upload in the lake")


def test_an_upload_created_but_not_recorded_is_aborted(lake, mounter):
    """A kill between the lake creating a multipart upload and the daemon recording
    its id leaves only the intent in LMDB: the next mount finds the upload by key."""
    import trio

    from aifs.lake.local import LocalStore
    from aifs.meta.store import MetaStore

    mount = mounter(lake, name="first")
    (mount.path / "big.bin").write_bytes(b"small for now")
    ino = (mount.path / "big.bin").stat().st_ino
    mount.unmount()
    if lake.server:
        lake.server.client.create_multipart_upload(Bucket=lake.bucket,
                                                   Key=lake.prefix + "big.bin")
    else:
        assert lake.root is not None
        trio.run(LocalStore(str(lake.root)).create_multipart, "big.bin", {})
    meta = MetaStore(mount.cache_dir / "meta")
    meta.record_upload(ino, "big.bin", "", time.time())
    meta.close()
    assert len(lake_uploads(lake)) == 1

    mounter(lake, name="second", cache="first")
    wait_for(lambda: not lake_uploads(lake), 20, "the unrecorded upload aborted")


def test_a_clean_local_copy_cut_short_by_a_power_loss_is_read_from_the_lake(
        lake, mounter, aifs_cli, tmp_path):
    """A file promoted and kept as clean cached data whose local copy the disk
    had not all of when the node lost power (cut short here by hand): the next
    mount reads the file's bytes from the lake, not the short copy."""
    data = os.urandom(3 * MiB + 11)
    mount = mounter(lake, "--promote-delay", "0", name="first")
    (mount.path / "w.bin").write_bytes(data)
    sync(aifs_cli, mount.path)
    ino = (mount.path / "w.bin").stat().st_ino
    mount.unmount()
    copy = mount.cache_dir / "files" / str(ino)
    assert copy.stat().st_size == len(data)
    os.truncate(copy, MiB)
    again = mounter(lake, name="second", cache="first")
    assert (again.path / "w.bin").read_bytes() == data
