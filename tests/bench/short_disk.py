"""A file larger than the free cache disk: written through the mount until it
is in the lake, beside a boto3 multipart upload of the same bytes from a
local file, in the same run (the order turns from run to run).

The cache directory is a tmpfs of ``--free`` bytes plus the metadata store's
reserve, so the mount starts with about ``--free`` bytes free; the file
streams to the lake as it is written and the parts the lake has leave the
disk (``flush/stream.py``, spilling). Reported: seconds from open() until
``aifs sync`` returns, the boto3 upload's seconds, and their ratio (raw /
aifs: 1.0 is lake speed).

    python tests/bench/short_disk.py --lake moto|ceph [--size 1G] [--free 256M] [--runs 3]

Needs root and /dev/fuse. Unmounts and stops all it starts, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import aifs_sync, bench_lake, boto3_multipart  # noqa: E402
from support.mounts import Mount  # noqa: E402
from support.packed import lake_digest, lake_size  # noqa: E402
from write_bench import digest, write_file  # noqa: E402

from aifs.config import parse_size  # noqa: E402

META_RESERVE = 64 << 20  # the metadata store's share of the cache disk (meta.base)
MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", choices=["moto", "ceph"], default="ceph")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--free", default="256M", help="free cache disk at the start")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--log-level", default="warning", help="the mount's")
    parser.add_argument("--json", help="write results here too")
    parser.add_argument("--mount-arg", action="append", default=[],
                        help="an option for aifs mount (repeat), e.g. --mount-arg=--part-size=16M")
    args = parser.parse_args()
    size, free = parse_size(args.size), parse_size(args.free)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="aifs-shortdisk-", dir="/var/tmp"))
    stops: list = []
    runs: dict[str, list[float]] = {}
    disk = work / "disk"
    try:
        lake, server = bench_lake(args.lake, work, stops, args.runs * 2 * size, "s")
        assert server is not None
        source = work / "source.bin"
        write_file(source, 0, size)
        expected = digest(0, size)
        for rep in range(args.runs):
            print(f"run {rep + 1}/{args.runs}", file=sys.stderr, flush=True)
            order = ["aifs", "boto3"] if rep % 2 == 0 else ["boto3", "aifs"]
            for name in order:
                if name == "boto3":
                    runs.setdefault("boto3_s", []).append(boto3_multipart(
                        server, lake.bucket, f"{lake.prefix}raw-{rep}.bin", source,
                        16 * MiB, 8 * MiB, 8))
                    continue
                disk.mkdir(exist_ok=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={free + META_RESERVE}",
                                "tmpfs", str(disk)], check=True)
                mount = Mount(lake, work / "mnt", disk / "cache", work / "aifs.log",
                              ["--log-level", args.log_level, *args.mount_arg])
                try:
                    st = os.statvfs(disk)
                    runs.setdefault("free_at_start_mib", []).append(
                        st.f_bavail * st.f_frsize / MiB)
                    start = time.perf_counter()
                    write_file(mount.path / f"big-{rep}.bin", 0, size)
                    runs.setdefault("aifs_closed_s", []).append(time.perf_counter() - start)
                    aifs_sync(mount.path, 1800)
                    runs.setdefault("aifs_s", []).append(time.perf_counter() - start)
                finally:
                    mount.unmount()
                    subprocess.run(["umount", "-l", str(disk)], check=False)
                key = f"big-{rep}.bin"
                if lake_size(lake, key) != size or lake_digest(lake, key) != expected:
                    raise RuntimeError(f"{key}: the lake's object is not what was written")
        medians = {name: statistics.median(values) for name, values in runs.items()}
        medians["aifs_vs_boto3"] = medians["boto3_s"] / medians["aifs_s"]
        result = {"size": size, "free": free, "lake": args.lake, "runs": runs,
                  "medians": medians}
        print(json.dumps(result, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return 0
    except BaseException:
        log = work / "aifs.log"
        if log.exists():
            shutil.copy(log, "/tmp/short-disk-aifs.log")
            print("the mount's log: /tmp/short-disk-aifs.log", file=sys.stderr)
        raise
    finally:
        for stop in stops:
            stop()
        if os.path.ismount(disk):
            subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
