"""Read-path benchmark: a 1 GiB file cold from the lake, from the NVMe cache after
a remount, and warm; `stat` of 100,000 files. Every figure is measured in the
same run as its baselines (local disk, page cache, boto3 range GETs).

    python tests/bench/read_bench.py --lake local|moto|ceph [--size 1G] [--files 100000]
        [--name model.safetensors]

Needs root (drops the page cache) and /dev/fuse. Unmounts and stops all it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import drop_kernel_caches  # noqa: E402
from support.lakes import Lake  # noqa: E402
from support.mounts import Mount  # noqa: E402
from support.servers import S3Server, ceph_process, moto_process  # noqa: E402

from aifs.config import parse_size  # noqa: E402

MiB = 1 << 20
CHUNK = 1 * MiB


def timed_read(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fp:
        while fp.read(CHUNK):
            pass
    return time.perf_counter() - start


def boto3_parallel(server: S3Server, bucket: str, key: str, size: int,
                   part: int, parallel: int) -> float:
    def get(offset: int) -> int:
        resp = server.client.get_object(Bucket=bucket, Key=key,
                                        Range=f"bytes={offset}-{min(offset + part, size) - 1}")
        return len(resp["Body"].read())
    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        total = sum(pool.map(get, range(0, size, part)))
    assert total == size
    return time.perf_counter() - start


def boto3_single_stream(server: S3Server, bucket: str, key: str) -> float:
    start = time.perf_counter()
    body = server.client.get_object(Bucket=bucket, Key=key)["Body"]
    while body.read(CHUNK):
        pass
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lake", choices=["local", "moto", "ceph"], default="local")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--name", default="big.bin", help="the file's name (its policy: "
                        "*.bin and *.safetensors are weights)")
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--block-size", default="8M")
    parser.add_argument("--readahead-max", default="128M")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    parser.add_argument("--json", help="write results here too")
    args = parser.parse_args()
    size = parse_size(args.size)
    block = parse_size(args.block_size)
    parallel = max(1, parse_size(args.readahead_max) // block)
    work = Path(tempfile.mkdtemp(prefix="aifs-bench-", dir="/var/tmp"))
    results: dict[str, float] = {}
    server_proc: list = []
    try:
        data_file = work / "local.bin"
        with open(data_file, "wb") as fp:
            for _ in range(size // (64 * MiB)):
                fp.write(os.urandom(64 * MiB))
            fp.write(os.urandom(size % (64 * MiB)))
        server = None
        if args.lake == "local":
            root = work / "lake"
            (root / "many").mkdir(parents=True)
            shutil.copyfile(data_file, root / args.name)
            lake = Lake("local", f"file://{root}", {}, [], root=root)
        else:
            server = start_server(args.lake, work, server_proc)
            bucket = "bench"
            server.client.create_bucket(Bucket=bucket)
            lake = Lake(args.lake, f"s3://{bucket}/b", server.env,
                        ["--endpoint-url", server.endpoint], server=server,
                        bucket=bucket, prefix="b/")
            with open(data_file, "rb") as fp:
                server.client.upload_fileobj(fp, bucket, f"b/{args.name}")
        mount_args = ["--block-size", args.block_size, "--readahead-max", args.readahead_max,
                      "--cache-size", str(4 * size), "--log-level", "warning"]

        # Repetitions interleave every measurement with its baselines (the disk
        # here is noisy); the report gives medians.
        runs: dict[str, list[float]] = {}
        for rep in range(args.reps):
            drop_kernel_caches()
            runs.setdefault("local_disk_s", []).append(timed_read(data_file))
            runs.setdefault("page_cache_s", []).append(timed_read(data_file))
            if server:
                drop_kernel_caches()
                runs.setdefault("boto3_parallel_s", []).append(boto3_parallel(
                    server, lake.bucket, f"b/{args.name}", size, block, parallel))
                runs.setdefault("boto3_stream_s", []).append(
                    boto3_single_stream(server, lake.bucket, f"b/{args.name}"))
            cache = work / f"cache-{rep}"
            mount = Mount(lake, work / "mnt", cache, work / "aifs.log", mount_args)
            try:
                drop_kernel_caches()
                runs.setdefault("aifs_cold_s", []).append(timed_read(mount.path / args.name))
            finally:
                mount.unmount()
            mount = Mount(lake, work / "mnt", cache, work / "aifs.log", mount_args)
            try:
                drop_kernel_caches()
                runs.setdefault("aifs_nvme_s", []).append(timed_read(mount.path / args.name))
                runs.setdefault("aifs_warm_s", []).append(timed_read(mount.path / args.name))
            finally:
                mount.unmount()
            shutil.rmtree(cache)
        for name, values in runs.items():
            results[name] = statistics.median(values)

        if args.lake == "local" and args.files:
            results.update(stat_bench(lake, work, args.files, mount_args))
    finally:
        for mount_dir in (work / "mnt", work / "mnt-stat"):
            if os.path.ismount(mount_dir):
                subprocess.run(["fusermount3", "-u", "-z", str(mount_dir)], check=False)
        for stop in server_proc:
            stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, size, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def stat_bench(lake: Lake, work: Path, count: int,
               mount_args: list[str]) -> dict[str, float]:
    assert lake.root is not None
    many = lake.root / "many"
    for i in range(count):
        (many / f"f{i:06d}").write_bytes(b"")
    mount = Mount(lake, work / "mnt-stat", work / "cache-stat", work / "stat.log",
                  mount_args)
    try:
        names = [mount.path / "many" / f"f{i:06d}" for i in range(count)]
        start = time.perf_counter()
        for path in names:
            os.stat(path)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        for path in names:
            os.stat(path)
        warm = time.perf_counter() - start
        local_names = [many / f"f{i:06d}" for i in range(count)]
        start = time.perf_counter()
        for path in local_names:
            os.stat(path)
        local = time.perf_counter() - start
    finally:
        mount.unmount()
    return {"stat_count": count, "stat_cold_s": cold, "stat_warm_s": warm,
            "stat_local_s": local}


def start_server(kind: str, work: Path, stops: list) -> S3Server:
    """Start a moto or Ceph RGW server; its stop goes into ``stops``."""
    stack = contextlib.ExitStack()
    stops.append(stack.close)
    if kind == "moto":
        return stack.enter_context(moto_process())
    return stack.enter_context(ceph_process(work / "ceph", 20))


def report(args: argparse.Namespace, size: int, r: dict[str, float]) -> None:
    mb = size / 1e6

    def rate(key: str) -> str:
        return f"{mb / r[key]:8.0f} MB/s"
    print(f"\n## read benchmark: lake={args.lake} {args.name} size={args.size} "
          f"block={args.block_size} "
          f"readahead-max={args.readahead_max}, median of {args.reps} interleaved runs\n")
    print("| measurement | throughput | ratio |")
    print("|---|---|---|")
    print(f"| local disk, page cache dropped | {rate('local_disk_s')} | 1.00 |")
    print(f"| local file, page cache | {rate('page_cache_s')} | 1.00 |")
    if "boto3_parallel_s" in r:
        print(f"| boto3 parallel range GETs | {rate('boto3_parallel_s')} | 1.00 |")
        print(f"| boto3 one streaming GET | {rate('boto3_stream_s')} | "
              f"{r['boto3_parallel_s'] / r['boto3_stream_s']:.2f} x parallel |")
        cold_vs = f"{r['boto3_parallel_s'] / r['aifs_cold_s']:.2f} x boto3 parallel (>= 0.8)"
    else:
        cold_vs = f"{r['local_disk_s'] / r['aifs_cold_s']:.2f} x local disk"
    print(f"| aifs cold, from the lake | {rate('aifs_cold_s')} | {cold_vs} |")
    print(f"| aifs NVMe cache after remount | {rate('aifs_nvme_s')} | "
          f"{r['local_disk_s'] / r['aifs_nvme_s']:.2f} x local disk (>= 0.7) |")
    print(f"| aifs warm re-read | {rate('aifs_warm_s')} | "
          f"{r['page_cache_s'] / r['aifs_warm_s']:.2f} x page cache (>= 0.3) |")
    if "stat_warm_s" in r:
        n = r["stat_count"]
        print(f"| stat {n:.0f} files, first pass | {n / r['stat_cold_s']:8.0f} /s | |")
        print(f"| stat {n:.0f} files, warm | {n / r['stat_warm_s']:8.0f} /s | "
              f"{r['stat_local_s'] / r['stat_warm_s']:.2f} x local stat (>= 20,000/s) |")
        print(f"| stat {n:.0f} local files | {n / r['stat_local_s']:8.0f} /s | 1.00 |")


if __name__ == "__main__":
    sys.exit(main())
