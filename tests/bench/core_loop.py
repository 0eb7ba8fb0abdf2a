"""What a create, its close and its release cost aifs's core itself, without
a mount: ``core.Filesystem`` driven directly over a local-directory lake,
bursts of creates of 16 KiB files (create, write to the local copy, flush,
release), the median of each step per burst.

Beside a mount's figures (``request_times.py``) this tells the core's own
cost from the binding's and the kernel's. ``--thrash BYTES`` touches a
buffer of that size between creates, as the program and the kernel do
between a daemon's requests: what a step costs when the daemon's memory is
no longer in the CPU's caches.

    python tests/bench/core_loop.py [--files 2000] [--bursts 4]
        [--thrash 4000000] [--work-dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import trio

from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.core import Filesystem
from aifs.lake.local import LocalStore
from aifs.meta.store import ROOT_INO, MetaStore


async def bursts(work: Path, files: int, count: int, thrash: int) -> list[dict[str, float]]:
    (work / "lake").mkdir()
    config = Config(lake=f"file://{work}/lake", promote_delay=3600)
    fs = Filesystem(config, LocalStore(str(work / "lake")), MetaStore(work / "meta"),
                    BlockCache(work / "cache", config.cache_size), LocalFiles(work / "cache"))
    rows: list[dict[str, float]] = []
    data = os.urandom(16384)
    try:
        async with trio.open_nursery() as nursery:
            fs.start(nursery)
            directory = await fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
            for burst in range(count):
                steps: dict[str, list[float]] = {"create": [], "flush": [], "release": []}
                for i in range(files):
                    start = time.perf_counter()
                    fh, inode = await fs.create(directory.ino, f"b{burst}-{i}".encode(),
                                                0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
                    created = time.perf_counter()
                    os.pwrite(fs.local.fd(inode.ino), data, 0)
                    if thrash:
                        bytes(thrash)  # (not timed)
                    written = time.perf_counter()
                    await fs.flush(fh)
                    flushed = time.perf_counter()
                    fs.release(fh)
                    steps["create"].append(created - start)
                    steps["flush"].append(flushed - written)
                    steps["release"].append(time.perf_counter() - flushed)
                rows.append({k: statistics.median(v) * 1e6 for k, v in steps.items()})
                await trio.sleep(1)  # spare files are made between bursts
            nursery.cancel_scope.cancel()
    finally:
        fs.local.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--thrash", type=int, default=0)
    parser.add_argument("--work-dir", default="/var/tmp")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aifs-core-loop-", dir=args.work_dir))
    try:
        rows = trio.run(bursts, work, args.files, args.bursts, args.thrash)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| burst | create (us) | flush (us) | release (us) |")
    print("|---|---|---|---|")
    for i, row in enumerate(rows):
        print(f"| {i} | {row['create']:.1f} | {row['flush']:.1f} | {row['release']:.1f} |")


if __name__ == "__main__":
    main()
