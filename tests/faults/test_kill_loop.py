"""SIGKILL loop: a training-like writer saves shards and moves a ``latest``
marker by rename while the daemon is killed at random moments, 40 times (a CI
run; ``AIFS_KILLS=100`` for a longer one), each time mounted again on the same
cache directory.

What must hold at the end, after one more mount and ``aifs sync``: every file
whose close() returned is in the mount and in the lake, byte for byte; no file
is published partial (one that was still being written when the daemon died is
not published at all); ``latest`` names a step whose shard is complete in the
lake.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import time

import pytest
from support.lakes import lake_tree

KILLS = int(os.environ.get("AIFS_KILLS", "40"))

WRITER = r"""
import hashlib, os, sys
# Everything relative to a descriptor of the mount's root: once the daemon dies
# and the mount is detached, the path would lead to the directory under it.
root = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
first = int(sys.argv[2])
print("ready", flush=True)
def content(step):
    seed = hashlib.sha256(str(step).encode()).digest()
    return seed * (((step * 7919) % 3000 + 1) * 1000 // 32)
try:
    try:
        os.mkdir("ckpt", dir_fd=root)
    except FileExistsError:
        pass
    ckpt = os.open("ckpt", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)
    step = first
    while True:
        name = f"step{step}.bin"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=ckpt)
        data = content(step)
        for start in range(0, len(data), 256 << 10):
            os.write(fd, data[start:start + (256 << 10)])
        os.close(fd)
        print("closed", "ckpt/" + name, flush=True)
        fd = os.open(".latest.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=ckpt)
        os.write(fd, str(step).encode())
        os.close(fd)
        os.rename(".latest.tmp", "latest", src_dir_fd=ckpt, dst_dir_fd=ckpt)
        print("marker", step, flush=True)
        step += 1
except OSError:
    pass
"""


def content(step: int) -> bytes:
    seed = hashlib.sha256(str(step).encode()).digest()
    return seed * (((step * 7919) % 3000 + 1) * 1000 // 32)


@pytest.mark.slow
@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_repeated_kills_lose_no_closed_file_and_publish_no_unclosed_one(
        lake, mounter, aifs_cli, tmp_path):
    rng = random.Random(5)
    closed: set[str] = set()
    markers: list[int] = []
    args = ("--promote-delay", "0.1")
    for kill in range(KILLS):
        mount = mounter(lake, *args, name=f"m{kill}", cache="c")
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mount.path),
                                   str(kill * 1000)], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready"  # it holds the mount's root
        time.sleep(rng.uniform(0.0, 0.8))
        mount.proc.kill()  # the daemon dies first: the writer is cut off mid-write
        mount.kill()
        try:
            out, _ = writer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stack = open(f"/proc/{writer.pid}/stack").read()
            writer.kill()
            raise AssertionError(f"kill {kill}: the writer hangs after the daemon died, "
                                 f"in the kernel at:\n{stack}") from None
        for line in out.splitlines():
            what, _, arg = line.partition(" ")
            if what == "closed":
                closed.add(arg)
            elif what == "marker":
                markers.append(int(arg))
    final = mounter(lake, *args, name="final", cache="c")
    result = aifs_cli("sync", str(final.path), "--quiet", timeout=600)
    assert result.returncode == 0, result.stderr
    assert len(closed) > KILLS // 4, f"the writer hardly closed anything: {len(closed)}"
    for name in closed:
        step = int(name.removeprefix("ckpt/step").removesuffix(".bin"))
        assert (final.path / name).read_bytes() == content(step), name
    files, _ = lake_tree(lake)
    shards = {name for name in files if name.startswith("ckpt/step")}
    assert closed <= shards, f"closed files missing in the lake: {sorted(closed - shards)[:5]}"
    # A file whose close reached the daemon, the kill cutting off only the reply
    # (close() then failed in the writer), may be published: whole. Nothing else is.
    for name in shards:
        step = int(name.removeprefix("ckpt/step").removesuffix(".bin"))
        assert files[name] == content(step), f"{name}: published but not whole"
    cut = len(shards - closed)
    assert cut <= KILLS // 10, f"{cut} files published whose close() never returned"
    if "ckpt/latest" in files:
        latest = int(files["ckpt/latest"])
        assert f"ckpt/step{latest}.bin" in shards
    print(f"{KILLS} kills: {len(closed)} files closed, {len(markers)} markers moved, "
          f"all in the lake; {cut} more published whole (the kill cut their close's "
          "reply), none partial")
