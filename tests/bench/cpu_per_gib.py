"""Daemon CPU per GiB served, beside s3fs in the same run: a 1 GiB object read
whole through each mount of one bucket, the page cache dropped first.

- aifs cold: a fresh cache directory (every byte from the lake);
- aifs admission: the blocks the cold read cached become one local copy
  after it closes (in the background: the kernel copies them);
- aifs warm: the same mount again, page cache dropped (every byte from the
  NVMe tier: passthrough, so the daemon sees only the open and the close);
- s3fs cold and again (it keeps no local copy by default: both from the lake).

CPU is the daemon process's user + system time over the read (/proc/PID/stat).
Root only (drops the page cache); installs s3fs with apt-get if missing.

    python tests/bench/cpu_per_gib.py [--lake ceph|moto] [--size 1G] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import conftest  # noqa: E402
from checkpoint_bench import S3fsMount, ensure_s3fs, process_cpu  # noqa: E402
from common import drop_kernel_caches, start_server  # noqa: E402

from aifs.config import parse_size  # noqa: E402

MiB = 1 << 20


def read_with_cpu(path: Path, pid: int) -> tuple[float, float]:
    """(seconds, daemon CPU seconds) of one whole read of ``path``."""
    drop_kernel_caches()
    cpu, start = process_cpu(pid), time.perf_counter()
    with open(path, "rb", buffering=0) as fp:
        while fp.read(MiB):
            pass
    return time.perf_counter() - start, process_cpu(pid) - cpu


def admission_cpu(mount: Path, pid: int, timeout: float = 120) -> tuple[float, float]:
    """(seconds, daemon CPU seconds) until the object read whole has its local copy."""
    cpu, start = process_cpu(pid), time.perf_counter()
    while json.loads(os.getxattr(mount, "user.aifs.stats"))["admitted"] < 1:
        if time.perf_counter() - start > timeout:
            raise SystemExit("no local copy made of the object read whole")
        time.sleep(0.05)
    return time.perf_counter() - start, process_cpu(pid) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", choices=["ceph", "moto"], default="ceph")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    size = parse_size(args.size)
    gib = size / (1 << 30)
    s3fs = ensure_s3fs()
    work = Path(tempfile.mkdtemp(prefix="aifs-cpu-", dir="/var/tmp"))
    stops: list = []
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        server = start_server(args.lake, work, stops, 20)
        server.client.create_bucket(Bucket="bench")
        source = work / "object.bin"
        with open(source, "wb") as fp:
            for _ in range(size // (64 * MiB)):
                fp.write(os.urandom(64 * MiB))
        server.client.upload_file(str(source), "bench", "b/object.bin")
        source.unlink()
        lake = conftest.Lake(args.lake, "s3://bench/b", server.env,
                             ["--endpoint-url", server.endpoint], server=server,
                             bucket="bench", prefix="b/")
        for rep in range(args.reps):
            cache = work / f"cache-{rep}"
            mount = conftest.Mount(lake, work / "mnt", cache, work / "aifs.log",
                                   ["--cache-size", str(4 * size), "--log-level", "warning"])
            try:
                rows.setdefault("aifs cold", []).append(
                    read_with_cpu(mount.path / "object.bin", mount.proc.pid))
                rows.setdefault("aifs admission (blocks to a local copy)", []).append(
                    admission_cpu(mount.path, mount.proc.pid))
                rows.setdefault("aifs warm (NVMe tier)", []).append(
                    read_with_cpu(mount.path / "object.bin", mount.proc.pid))
            finally:
                mount.unmount()
            shutil.rmtree(cache)
            if s3fs:
                fs = S3fsMount(s3fs, server, "bench", work / "s3fs-mnt", work)
                try:
                    rows.setdefault("s3fs cold", []).append(
                        read_with_cpu(fs.path / "b" / "object.bin", fs.proc.pid))
                    rows.setdefault("s3fs again", []).append(
                        read_with_cpu(fs.path / "b" / "object.bin", fs.proc.pid))
                finally:
                    fs.stop()
    finally:
        for stop in reversed(stops):
            stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"| {args.size} object, {args.lake}, {args.reps} runs | seconds | daemon CPU-s per "
          "GiB (median, range) |")
    print("|---|---|---|")
    for name, values in rows.items():
        cpu = [c / gib for _, c in values]
        print(f"| {name} | {statistics.median(s for s, _ in values):.2f} | "
              f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) |")


if __name__ == "__main__":
    main()
