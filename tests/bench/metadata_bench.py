"""Fresh-node metadata benchmark: a dataset already in the lake, and small files
aifs wrote, seen by a node with an empty cache, every figure beside its
baseline in one run.

- walk + ``lstat`` of N foreign objects (written with boto3, as another tool
  would) through a fresh mount, against boto3 listing the same prefix and a
  walk of the same tree on the local disk (caches dropped);
- first read of every foreign object with R reader processes through a fresh
  mount, against boto3 GETs on R threads and the same GETs from aifs's lean
  signed-HTTP client on R threads (what the lake itself gives here);
- ``ls`` + ``stat`` and a read of M small files aifs wrote (``*.bin``), through
  a fresh mount; and how many PUTs writing them took.

The lake requests each aifs phase made are counted (``user.aifs.metrics``).

    python tests/bench/metadata_bench.py --lake ceph|moto [--objects 10000] [--json F]

Needs root (drops the page cache) and /dev/fuse. Unmounts and stops all it starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import aifs_sync, bench_lake, drop_kernel_caches, finish  # noqa: E402
from support.lakes import Lake  # noqa: E402
from support.mounts import Mount  # noqa: E402

READER = """
import sys
for path in sys.stdin.read().split("\\0"):
    if path:
        with open(path, "rb") as f:
            f.read()
"""


def requests(mount: Mount) -> dict[str, int]:
    return json.loads(os.getxattr(mount.path, "user.aifs.metrics"))["lake"]["requests"]


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n - before.get(op, 0)}


@contextlib.contextmanager
def fresh_mount(lake: Lake, work: Path, name: str, options: list[str],
                r: dict) -> Iterator[Mount]:
    """A mount with an empty cache of its own; the lake requests made inside
    the block go to ``r[name + "_requests"]``."""
    mount = Mount(lake, work / "mnt", work / f"cache-{name}", work / "aifs.log",
                  options)
    try:
        before = requests(mount)
        yield mount
        r[f"{name}_requests"] = delta(requests(mount), before)
    finally:
        mount.unmount()


def walk_lstat(root: Path) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    for directory, _, files in os.walk(root):
        for name in files:
            os.lstat(os.path.join(directory, name))
            count += 1
    return count, time.perf_counter() - start


def stat_median_us(paths: list[Path]) -> float:
    """Median microseconds of an ``lstat`` of each path."""
    took = []
    for path in paths:
        start = time.perf_counter()
        os.lstat(path)
        took.append(time.perf_counter() - start)
    return sorted(took)[len(took) // 2] * 1e6


def lmdb_bytes(path: Path) -> int:
    """Bytes of the pages an LMDB environment uses (its file holds a reserve too)."""
    import lmdb
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    try:
        return env.info()["last_pgno"] * env.stat()["psize"]
    finally:
        env.close()


def read_all(paths: list[Path], readers: int) -> float:
    """Seconds for ``readers`` processes to read ``paths`` (dealt round-robin)."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE)
             for _ in range(readers)]
    for i, proc in enumerate(procs):
        assert proc.stdin is not None
        proc.stdin.write("\0".join(str(p) for p in paths[i::readers]).encode())
        proc.stdin.close()
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError("a reader failed")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", choices=("moto", "ceph"), default="ceph")
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--prefixes", type=int, default=10)
    parser.add_argument("--size", type=int, default=16 << 10)
    parser.add_argument("--own", type=int, default=1_000, help="small files aifs writes")
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--mount-option", action="append", default=[],
                        help="an extra option for every aifs mount (e.g. --object-attrs=false)")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aifs-metabench-"))
    stops: list = []
    r: dict = {"objects": args.objects, "prefixes": args.prefixes, "size": args.size,
               "own": args.own, "readers": args.readers, "lake": args.lake,
               "mount_options": args.mount_option}
    base = ["--log-level", "warning", *args.mount_option]
    try:
        lake, server = bench_lake(args.lake, work, stops,
                                  (args.objects + args.own) * args.size * 2, "meta")
        assert server is not None
        client, bucket = server.client, lake.bucket
        rng = random.Random(1)
        body = rng.randbytes(args.size)
        names = [f"foreign/p{i % args.prefixes}/o{i:06d}.bin" for i in range(args.objects)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: client.put_object(Bucket=bucket, Key=lake.prefix + n,
                                                      Body=body), names))
        local = work / "local"
        for name in names:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(body)

        # 1. walk + lstat: local disk, boto3 LIST, fresh aifs mount
        drop_kernel_caches()
        count, r["local_walk_s"] = walk_lstat(local / "foreign")
        assert count == args.objects
        start = time.perf_counter()
        listed = sum(len(page.get("Contents", [])) for page in
                     client.get_paginator("list_objects_v2").paginate(
                         Bucket=bucket, Prefix=lake.prefix + "foreign/"))
        r["boto3_list_s"] = time.perf_counter() - start
        assert listed == args.objects
        with fresh_mount(lake, work, "aifs_walk", base, r) as mount:
            count, r["aifs_walk_s"] = walk_lstat(mount.path / "foreign")
            assert count == args.objects, count
        r["lmdb_bytes_per_file"] = lmdb_bytes(work / "cache-aifs_walk" / "meta") / args.objects
        # a stat of known files once the TTL passed (the kernel's caches and the listing)
        with fresh_mount(lake, work, "aifs_ttl", [*base, "--metadata-ttl", "1"], r) as mount:
            paths = [mount.path / n for n in names if n.startswith("foreign/p0/")]
            stat_median_us(paths)
            time.sleep(1.2)
            r["stat_after_ttl_us"] = stat_median_us(paths)

        # 2. first read of every object: boto3 threads, fresh aifs mount, processes
        order = list(names)
        random.Random(2).shuffle(order)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.readers) as pool:
            list(pool.map(lambda n: client.get_object(Bucket=bucket, Key=lake.prefix + n)
                          ["Body"].read(), order))
        r["boto3_read_s"] = time.perf_counter() - start
        # the lake's own ceiling here: the same GETs from the lean signed-HTTP
        # client aifs uses (no botocore, no FUSE), as many threads
        from aifs.lake.s3http import SignedHTTP
        http = SignedHTTP(server.endpoint, bucket, client.meta.region_name,
                          client._request_signer._credentials, 64, 30.0)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.readers) as pool:
            list(pool.map(lambda n: http.get_range(lake.prefix + n, n, 0, args.size, None),
                          order))
        r["lean_read_s"] = time.perf_counter() - start
        http.close()
        with fresh_mount(lake, work, "aifs_read", base, r) as mount:
            r["aifs_read_s"] = read_all([mount.path / n for n in order], args.readers)

        # 3. small files aifs wrote: PUTs to write them, fresh ls + stat, fresh read
        own = [f"own/f{i:05d}.bin" for i in range(args.own)]
        with fresh_mount(lake, work, "own_write", base, r) as mount:
            (mount.path / "own").mkdir()
            for name in own:
                (mount.path / name).write_bytes(body)
            aifs_sync(mount.path, 600)
        with fresh_mount(lake, work, "own_ls_stat", base, r) as mount:
            start = time.perf_counter()
            for name in os.listdir(mount.path / "own"):
                os.lstat(mount.path / "own" / name)
            r["own_ls_stat_s"] = time.perf_counter() - start
        with fresh_mount(lake, work, "own_read", base, r) as mount:
            r["own_read_s"] = read_all([mount.path / n for n in own], 1)
    finally:
        finish(work, stops, r, args.json)
    n, m = args.objects, args.own
    print(f"walk + lstat of {n} foreign objects: local {n / r['local_walk_s']:,.0f}/s, "
          f"boto3 LIST {n / r['boto3_list_s']:,.0f}/s, aifs {n / r['aifs_walk_s']:,.0f}/s "
          f"({r['boto3_list_s'] / r['aifs_walk_s']:.2f}x boto3 LIST; "
          f"requests {r['aifs_walk_requests']}); stat past the TTL: median "
          f"{r['stat_after_ttl_us']:.0f} us; LMDB {r['lmdb_bytes_per_file']:.0f} bytes per file")
    print(f"first read of {n} foreign objects, {args.readers} readers: boto3 "
          f"{n / r['boto3_read_s']:,.0f}/s, lean HTTP GETs {n / r['lean_read_s']:,.0f}/s "
          f"({r['boto3_read_s'] / r['lean_read_s']:.2f}x boto3), "
          f"aifs {n / r['aifs_read_s']:,.0f}/s "
          f"({r['boto3_read_s'] / r['aifs_read_s']:.2f}x boto3; "
          f"requests {r['aifs_read_requests']})")
    print(f"{m} small files aifs wrote: requests to write {r['own_write_requests']}; fresh "
          f"ls + stat {m / r['own_ls_stat_s']:,.0f}/s (requests {r['own_ls_stat_requests']}); "
          f"fresh read {m / r['own_read_s']:,.0f}/s (requests {r['own_read_requests']})")


if __name__ == "__main__":
    main()
