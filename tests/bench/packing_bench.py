"""Small-file packing benchmark: many small files created through one mount,
promoted as packs, and read back through a second mount with an empty cache.
Every figure is measured in the same run as its baselines: the same creates on
the local cache disk, and one boto3 GET per file from the same server (on a
random sample of plain objects put there with boto3; on the local lake, reads
of the files from the local disk). The same create and read loops also run
through a do-nothing pyfuse3 filesystem (``fuse_floor.py``), the floor any
pyfuse3 daemon stands on here.

    python tests/bench/packing_bench.py --lake local|moto|ceph [--files 100000]
                                        [--file-size 16K] [--sample 3000] [--threads 8]

Needs root and /dev/fuse. Unmounts and stops all it starts, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import aifs_sync, bench_lake, drop_kernel_caches, fuse_floor  # noqa: E402
from support.lakes import lake_objects  # noqa: E402
from support.mounts import Mount  # noqa: E402
from support.packed import JOURNALS, PACKS  # noqa: E402
from support.servers import S3Server  # noqa: E402

from aifs.config import parse_size  # noqa: E402

MiB = 1 << 20
POOL = os.urandom(4 * MiB)


def content(i: int, size: int) -> bytes:
    start = (i * 7919) % (len(POOL) - size)
    return POOL[start:start + size]


def name_of(i: int) -> str:
    return f"d{i // 10_000:02d}/s{i:06d}.dat"


def create_all(root: Path, count: int, size: int) -> float:
    for directory in sorted({os.path.dirname(name_of(i)) for i in range(count)}):
        (root / directory).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i in range(count):
        with open(root / name_of(i), "wb", buffering=0) as fp:
            fp.write(content(i, size))
    return time.perf_counter() - start


def read_all(root: Path, names: list[str], threads: int) -> tuple[float, int]:
    """Seconds to read every file (``threads`` readers, like DataLoader workers),
    and how many had other bytes than written."""
    def one(name: str) -> bool:
        with open(root / name, "rb", buffering=0) as fp:
            data = fp.read()
        i = int(name.rsplit("s", 1)[1].split(".")[0])
        return data == content(i, len(data)) and len(data) > 0

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        good = sum(pool.map(one, names, chunksize=64))
    return time.perf_counter() - start, len(names) - good


def metrics(mountpoint: Path) -> dict:
    return json.loads(os.getxattr(mountpoint, "user.aifs.metrics"))


def boto3_gets(server: S3Server, bucket: str, keys: list[str],
               threads: int) -> float:
    def get(key: str) -> int:
        return len(server.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, keys))
    return time.perf_counter() - start


def boto3_puts(server: S3Server, bucket: str, items: dict[str, bytes],
               threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kv: server.client.put_object(Bucket=bucket, Key=kv[0],
                                                          Body=kv[1]), items.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", choices=["local", "moto", "ceph"], default="local")
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--file-size", default="16K")
    parser.add_argument("--sample", type=int, default=3000,
                        help="files of the boto3 GET baseline (a random sample)")
    parser.add_argument("--threads", type=int, default=8,
                        help="readers at once, through the mount and with boto3")
    parser.add_argument("--sync-timeout", type=float, default=3600)
    parser.add_argument("--json", help="write results here too")
    args = parser.parse_args()
    size = parse_size(args.file_size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    work = Path(tempfile.mkdtemp(prefix="aifs-pbench-", dir="/var/tmp"))
    results: dict[str, float] = {}
    stops: list = []
    mounts: list[Mount] = []
    failed = True
    try:
        lake, server = bench_lake(args.lake, work, stops, 3 * args.files * size, "p")
        cache = str(4 * args.files * size + 1024 * MiB)
        common = ["--cache-size", cache, "--log-level", "warning"]
        names = [name_of(i) for i in range(args.files)]

        local_dir = work / "local"
        os.sync()
        results["local_creates_s"] = create_all(local_dir, args.files, size)
        order = list(names)
        random.Random(1).shuffle(order)  # an epoch's order: no help from the file order

        with fuse_floor(work / "mnt-floor") as floor:
            results["floor_creates_s"] = create_all(floor, args.files, size)
            drop_kernel_caches()
            results["floor_read_all_s"], wrong = read_all(floor, order, args.threads)
            if wrong:
                raise RuntimeError(f"{wrong} files read back from the floor filesystem "
                                   "with other bytes")

        writer = Mount(lake, work / "mnt-w", work / "cache-w", work / "w.log", common)
        mounts.append(writer)
        (writer.path / "ds").mkdir()
        aifs_sync(writer.path, args.sync_timeout)
        before = metrics(writer.path)
        os.sync()
        start = time.perf_counter()
        create_all(writer.path / "ds", args.files, size)
        closed = time.perf_counter()
        aifs_sync(writer.path, args.sync_timeout)
        in_lake = time.perf_counter()
        after = metrics(writer.path)
        results["aifs_creates_s"] = closed - start
        results["aifs_close_to_lake_s"] = in_lake - closed
        results["aifs_open_to_lake_s"] = in_lake - start
        results["put_requests"] = (after["lake"]["requests"].get("PutObject", 0)
                                   - before["lake"]["requests"].get("PutObject", 0))
        writer.unmount()
        mounts.remove(writer)
        objects = lake_objects(lake)
        results["pack_objects"] = sum(1 for k in objects if k.startswith(PACKS)
                                      and not k.endswith("/"))
        results["journal_objects"] = sum(1 for k in objects if k.startswith(JOURNALS)
                                         and not k.endswith("/"))
        results["plain_objects"] = sum(1 for k in objects if k.startswith("ds/")
                                       and not k.endswith("/"))

        reader = Mount(lake, work / "mnt-r", work / "cache-r", work / "r.log", common)
        mounts.append(reader)
        seconds, wrong = read_all(reader.path / "ds", order, args.threads)
        if wrong:
            raise RuntimeError(f"{wrong} files read back with other bytes")
        results["aifs_read_all_s"] = seconds
        results["aifs_read_gets"] = metrics(reader.path)["lake"]["requests"].get(
            "GetObject", 0)
        reader.unmount()
        mounts.remove(reader)
        fold_rows(lake, work, common, results)

        sample = random.Random(2).sample(range(args.files), min(args.sample, args.files))
        if server:
            items = {f"{lake.prefix}plain/{name_of(i)}": content(i, size) for i in sample}
            boto3_puts(server, lake.bucket, items, args.threads)
            results["baseline_gets_s"] = boto3_gets(server, lake.bucket, list(items),
                                                    args.threads)
            results["baseline"] = "boto3 GET per file"
        else:
            os.sync()
            start = time.perf_counter()
            read_all(local_dir, [name_of(i) for i in sample], args.threads)
            results["baseline_gets_s"] = time.perf_counter() - start
            results["baseline"] = "local disk read per file"
        results["baseline_files"] = len(sample)
        results.update(files=args.files, file_size=size, threads=args.threads)
        failed = False
    finally:
        for mount in mounts:
            mount.kill()
        for name in ("mnt-w", "mnt-r", "mnt-n1", "mnt-f", "mnt-n2"):
            if os.path.ismount(work / name):
                subprocess.run(["fusermount3", "-u", "-z", str(work / name)], check=False)
        if failed:
            for log in ("w.log", "r.log", "n1.log", "f.log", "n2.log"):
                if (work / log).exists():
                    print(f"--- tail of {log} ---\n" + (work / log).read_text(
                        errors="replace")[-3000:], file=sys.stderr)
        for stop in stops:
            stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def first_stat(lake, work: Path, name: str, common: list[str]) -> tuple[float, int]:
    """A node new to the lake: seconds of its first ``stat`` (the journals or
    folds it replays, and the LIST of the root) and how many it read."""
    mount = Mount(lake, work / f"mnt-{name}", work / f"cache-{name}",
                  work / f"{name}.log", common)
    try:
        start = time.perf_counter()
        os.stat(mount.path / "ds")
        seconds = time.perf_counter() - start
        stats = json.loads(os.getxattr(mount.path, "user.aifs.stats"))
        return seconds, stats["journals_read"]
    finally:
        mount.unmount()


def fold_rows(lake, work: Path, common: list[str], results: dict) -> None:
    """What a new node reads before and after ``aifs gc`` folds the journals."""
    def journal_bytes() -> int:
        return sum(size for key, size in lake_objects(lake).items()
                   if key.startswith(JOURNALS) and not key.endswith("/"))

    results["journal_bytes"] = journal_bytes()
    results["new_node_stat_s"], results["new_node_journals"] = first_stat(
        lake, work, "n1", common)
    folder = Mount(lake, work / "mnt-f", work / "cache-f", work / "f.log", common)
    try:
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "aifs", "gc", str(folder.path)],
                                capture_output=True, text=True, timeout=3600)
        results["gc_s"] = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"aifs gc failed: {result.stderr.strip()}")
    finally:
        folder.unmount()
    results["fold_bytes"] = journal_bytes()
    results["folded_node_stat_s"], results["folded_node_journals"] = first_stat(
        lake, work, "n2", common)


def report(args: argparse.Namespace, r: dict) -> None:
    n = r["files"]
    local_rate = n / r["local_creates_s"]
    create_rate = n / r["aifs_creates_s"]
    read_rate = n / r["aifs_read_all_s"]
    base_rate = r["baseline_files"] / r["baseline_gets_s"]
    print(f"| {args.lake} | local disk: create {n:,} files | {r['local_creates_s']:.1f} s | "
          f"{local_rate:,.0f} /s | 1.00 |")
    print(f"| {args.lake} | aifs: create {n:,} files | {r['aifs_creates_s']:.1f} s | "
          f"**{create_rate:,.0f} /s** | {create_rate / local_rate:.2f} x local |")
    floor_create = n / r["floor_creates_s"]
    print(f"| {args.lake} | do-nothing pyfuse3 filesystem: create {n:,} files | "
          f"{r['floor_creates_s']:.1f} s | {floor_create:,.0f} /s | aifs is "
          f"{create_rate / floor_create:.2f} x this |")
    print(f"| {args.lake} | aifs: last close until all in the lake | "
          f"{r['aifs_close_to_lake_s']:.1f} s | {r['put_requests']} PUTs "
          f"({r['pack_objects']} packs, {r['journal_objects']} journals, "
          f"{r['plain_objects']} plain objects) | |")
    print(f"| {args.lake} | aifs: read all through a second mount, empty cache "
          f"({args.threads} readers) | {r['aifs_read_all_s']:.1f} s | **{read_rate:,.0f} "
          f"files/s** ({r['aifs_read_gets']} GETs) | {read_rate / base_rate:.1f} x "
          f"{r['baseline']} |")
    floor_read = n / r["floor_read_all_s"]
    print(f"| {args.lake} | do-nothing pyfuse3 filesystem: read all, kernel caches "
          f"dropped ({args.threads} readers) | {r['floor_read_all_s']:.1f} s | "
          f"{floor_read:,.0f} files/s | aifs is {read_rate / floor_read:.2f} x this, "
          f"this is {floor_read / base_rate:.1f} x {r['baseline']} |")
    print(f"| {args.lake} | a new node's first `stat`: replays {r['new_node_journals']} "
          f"journals ({r['journal_bytes'] / MiB:.1f} MiB) | {r['new_node_stat_s']:.2f} s | | |")
    print(f"| {args.lake} | `aifs gc` on a fresh mount: folds them into one | "
          f"{r['gc_s']:.1f} s | {r['fold_bytes'] / MiB:.1f} MiB | |")
    print(f"| {args.lake} | a new node's first `stat` after the fold: replays "
          f"{r['folded_node_journals']} | {r['folded_node_stat_s']:.2f} s | | "
          f"{r['new_node_stat_s'] / r['folded_node_stat_s']:.1f} x faster |")
    print(f"| {args.lake} | {r['baseline']} ({r['baseline_files']:,} random files, "
          f"{args.threads} threads) | {r['baseline_gets_s']:.1f} s | {base_rate:,.0f} "
          f"files/s | 1.00 |")


if __name__ == "__main__":
    sys.exit(main())
