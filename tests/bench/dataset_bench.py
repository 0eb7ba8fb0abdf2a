"""Dataset benchmark: a shuffled PyTorch DataLoader over many small samples,
every figure measured in one run beside its baselines.

- epoch time over the mount once the dataset is cached, against the same
  files in a local directory (page cache dropped before every epoch);
- with a cache half the dataset: epoch time and hit ratio under the dataset
  policy (a stable subset) against plain LRU (the default policy);
- ``aifs warmup`` of the whole dataset into a fresh cache, against boto3
  GETs of the same objects with the same concurrency.

    python tests/bench/dataset_bench.py --lake local|moto|ceph [--samples 20000]

Needs root (drops the page cache) and /dev/fuse. Unmounts and stops all it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_lake, drop_kernel_caches, finish  # noqa: E402
from support.mounts import Mount  # noqa: E402

MiB = 1 << 20


class Samples:
    """A map-style dataset: each item is one sample file read whole."""

    def __init__(self, root: Path, count: int) -> None:
        self.root, self.count = root, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        with open(self.root / f"s{index:06d}.jpg", "rb") as fp:
            return len(fp.read())


def epoch(root: Path, count: int, workers: int, seed: int, drop: bool = True) -> float:
    import torch
    from torch.utils.data import DataLoader
    loader = DataLoader(Samples(root, count), batch_size=64, shuffle=True,
                        num_workers=workers, generator=torch.Generator().manual_seed(seed),
                        persistent_workers=False)
    if drop:
        drop_kernel_caches(dentries_too=False)  # a training node keeps its dataset's inodes
    start = time.perf_counter()
    total = sum(int(batch.sum()) for batch in loader)
    assert total > 0
    return time.perf_counter() - start


def lake_gets(mountpoint: Path) -> int:
    return json.loads(os.getxattr(mountpoint, "user.aifs.metrics"))["lake"]["requests"][
        "GetObject"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lake", choices=["local", "moto", "ceph"], default="local")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--max-sample", type=int, default=64 << 10, help="bytes (1 KiB..)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup-only", action="store_true", help="measure warmup alone")
    parser.add_argument("--json", help="write results here too")
    args = parser.parse_args()
    rng = random.Random(3)
    sizes = [rng.randint(1 << 10, args.max_sample) for _ in range(args.samples)]
    total = sum(sizes)
    work = Path(tempfile.mkdtemp(prefix="aifs-dsbench-", dir="/var/tmp"))
    stops: list = []
    r: dict[str, object] = {"samples": args.samples, "dataset_bytes": total}
    try:
        local = work / "local" / "train"
        local.mkdir(parents=True)
        for i, size in enumerate(sizes):
            (local / f"s{i:06d}.jpg").write_bytes(os.urandom(size))
        lake, server = bench_lake(args.lake, work, stops, total, "ds")
        if lake.root is not None:
            shutil.copytree(local, lake.root / "train")
        else:
            lake.put_many({f"train/{p.name}": p.read_bytes() for p in local.iterdir()})

        base = ["--block-size", "1M", "--memory-cache", "1M", "--log-level", "warning"]
        if not args.warmup_only:
            # 1. the local directory: the physical limit
            r["local_epoch_s"] = [epoch(local, args.samples, args.workers, e)
                                  for e in range(args.epochs)]
            r["local_page_cache_epoch_s"] = epoch(local, args.samples, args.workers, 9, drop=False)

            # 2. the mount with a cache that holds everything
            mount = Mount(lake, work / "mnt", work / "cache-all", work / "aifs.log",
                          [*base, "--cache-size", str(2 * total + 64 * MiB)])
            try:
                r["aifs_full_cache_epoch_s"] = [epoch(mount.path / "train", args.samples,
                                                      args.workers, e)
                                                for e in range(args.epochs)]
                r["aifs_page_cache_epoch_s"] = epoch(mount.path / "train", args.samples,
                                                     args.workers, 9, drop=False)
            finally:
                mount.unmount()

            # 3. a cache half the dataset: dataset policy against LRU
            half = total // 2
            for policy in ("dataset", "default"):
                mount = Mount(lake, work / "mnt", work / f"cache-{policy}",
                              work / "aifs.log", [*base, "--cache-size", str(half)])
                try:
                    os.setxattr(mount.path / "train", "user.aifs.policy", policy.encode())
                    times, ratios = [], []
                    for e in range(args.epochs):
                        before = lake_gets(mount.path)
                        times.append(epoch(mount.path / "train", args.samples, args.workers, e))
                        ratios.append(1 - (lake_gets(mount.path) - before) / args.samples)
                    r[f"{policy}_half_cache_epoch_s"] = times
                    r[f"{policy}_half_cache_hit_ratio"] = ratios
                finally:
                    mount.unmount()

        # 4. warmup into a fresh cache, against boto3 GETs of the same objects
        mount = Mount(lake, work / "mnt", work / "cache-warm", work / "aifs.log",
                      [*base, "--cache-size", str(2 * total + 64 * MiB)])
        try:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "aifs", "warmup", "--quiet",
                            str(mount.path / "train")], check=True)
            r["warmup_s"] = time.perf_counter() - start
        finally:
            mount.unmount()
        if server is not None:
            keys = [f"{lake.prefix}train/s{i:06d}.jpg" for i in range(args.samples)]
            start = time.perf_counter()
            with ThreadPoolExecutor(32) as pool:
                got = sum(pool.map(lambda k: len(server.client.get_object(
                    Bucket=lake.bucket, Key=k)["Body"].read()), keys))
            assert got == total
            r["boto3_get_all_s"] = time.perf_counter() - start
    finally:
        if os.path.ismount(work / "mnt"):
            subprocess.run(["fusermount3", "-u", "-z", str(work / "mnt")], check=False)
        finish(work, stops, r, args.json)
    report(args, r)
    return 0


def report(args: argparse.Namespace, r: dict) -> None:
    if args.warmup_only:
        mb = r["dataset_bytes"] / 1e6
        line = (f"\n| aifs warmup, fresh cache, {args.samples} files | {r['warmup_s']:.2f} s | "
                f"{args.samples / r['warmup_s']:.0f} files/s | {mb / r['warmup_s']:.0f} MB/s")
        if "boto3_get_all_s" in r:
            line += f"; {r['boto3_get_all_s'] / r['warmup_s']:.2f} x boto3 GETs (32 threads)"
        print(line + " |")
        return
    def later(key: str) -> float:
        return statistics.median(r[key][1:]) if len(r[key]) > 1 else r[key][0]

    local = later("local_epoch_s")
    mb = r["dataset_bytes"] / 1e6
    print(f"\n## dataset benchmark: lake={args.lake}, {args.samples} samples of 1 KiB.."
          f"{args.max_sample >> 10} KiB ({mb:.0f} MB), {args.workers} DataLoader workers, "
          f"shuffle, file data dropped from the page cache before each epoch unless "
          f"said; epochs 2..{args.epochs} (median)\n")
    print("| measurement | epoch time | samples/s | ratio |")
    print("|---|---|---|---|")
    print(f"| local directory | {local:.2f} s | {args.samples / local:.0f} | 1.00 |")
    full = later("aifs_full_cache_epoch_s")
    print(f"| aifs, dataset cached | {full:.2f} s | {args.samples / full:.0f} | "
          f"{full / local:.2f} x local (<= 1.5) |")
    print(f"| aifs, first (cold) epoch | {r['aifs_full_cache_epoch_s'][0]:.2f} s | "
          f"{args.samples / r['aifs_full_cache_epoch_s'][0]:.0f} | |")
    pc_local, pc_aifs = r["local_page_cache_epoch_s"], r["aifs_page_cache_epoch_s"]
    print(f"| local directory, page cache kept | {pc_local:.2f} s | "
          f"{args.samples / pc_local:.0f} | 1.00 |")
    print(f"| aifs, page cache kept | {pc_aifs:.2f} s | {args.samples / pc_aifs:.0f} | "
          f"{pc_aifs / pc_local:.2f} x local |")
    for policy, name in (("dataset", "dataset policy"), ("default", "LRU")):
        t = later(f"{policy}_half_cache_epoch_s")
        ratios = r[f"{policy}_half_cache_hit_ratio"]
        print(f"| aifs, cache = dataset/2, {name} | {t:.2f} s | {args.samples / t:.0f} | "
              f"hit ratio {statistics.median(ratios[1:]):.2f} (epoch 1: {ratios[0]:.2f}) |")
    warm = r["warmup_s"]
    line = f"| aifs warmup, fresh cache | {warm:.2f} s | {args.samples / warm:.0f} | " \
           f"{mb / warm:.0f} MB/s"
    if "boto3_get_all_s" in r:
        line += f"; {r['boto3_get_all_s'] / warm:.2f} x boto3 GETs (32 threads)"
    print(line + " |")


if __name__ == "__main__":
    sys.exit(main())
