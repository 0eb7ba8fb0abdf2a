"""Write-path benchmark: a 2 GiB file written through the mount (until close()
returns, and until it is in the lake), and 10,000 small files created and
promoted. Every figure is measured in the same run as its baselines (the same
writes to a local file on the cache disk; a boto3 multipart upload, or on the
local lake a copy into the lake directory). The 2 GiB write also goes through
two do-nothing pyfuse3 filesystems (``fuse_floor.py``: bytes discarded, and one
``pwrite`` per request into a local file), the floors of any pyfuse3 daemon and
of any write-back one, and through a second aifs mount that does not stream
(``--stream-large-files false``: the upload starts at close); the order of the
five writes turns from run to run.

    python tests/bench/write_bench.py --lake local|moto|ceph [--size 2G] [--files 10000]
                                      [--file-size 64K] [--runs 5]

Needs root and /dev/fuse. Unmounts and stops all it starts, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import aifs_sync, bench_lake, boto3_multipart, fuse_floor  # noqa: E402
from support.lakes import (  # noqa: E402
    Lake,
    delete_prefix,
    lake_keys,
)
from support.mounts import Mount  # noqa: E402
from support.packed import lake_digest, lake_size  # noqa: E402
from support.servers import S3Server  # noqa: E402

from aifs.config import parse_size  # noqa: E402

MiB = 1 << 20
CHUNK = 1 * MiB                  # every write() is 1 MiB (the last one of a file may be less)
POOL_SPAN = 64 * MiB             # chunks start anywhere in the first 64 MiB of the pool
POOL = os.urandom(POOL_SPAN + CHUNK)   # the random bytes, generated once and reused
POOL_VIEW = memoryview(POOL)


def chunks(seed: int, size: int):
    """The 1 MiB writes of a file of ``size`` bytes; ``seed`` makes files differ."""
    for k, offset in enumerate(range(0, size, CHUNK)):
        start = (seed * 4096 + k * CHUNK) % POOL_SPAN
        yield POOL_VIEW[start:start + min(CHUNK, size - offset)]


def digest(seed: int, size: int) -> str:
    import xxhash
    hasher = xxhash.xxh3_128()
    for chunk in chunks(seed, size):
        hasher.update(chunk)
    return hasher.hexdigest()


def write_file(path: Path, seed: int, size: int) -> None:
    with open(path, "wb", buffering=0) as fp:
        for chunk in chunks(seed, size):
            fp.write(chunk)


def timed_write(path: Path, seed: int, size: int) -> float:
    """Seconds from open() until close() returns (no fsync)."""
    start = time.perf_counter()
    write_file(path, seed, size)
    return time.perf_counter() - start


def timed_creates(directory: Path, count: int, size: int) -> float:
    start = time.perf_counter()
    for i in range(count):
        write_file(directory / f"f{i:06d}", i, size)
    return time.perf_counter() - start


def cli_startup() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aifs", "--version"], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def boto3_puts(server: S3Server, bucket: str, prefix: str, directory: Path,
               count: int, threads: int) -> float:
    def put(i: int) -> None:
        name = f"f{i:06d}"
        server.client.put_object(Bucket=bucket, Key=prefix + name,
                                 Body=(directory / name).read_bytes())
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(count)))
    return time.perf_counter() - start


def check_big(lake: Lake, key: str, size: int, expected: str) -> None:
    found = lake_size(lake, key)
    if found != size:
        raise RuntimeError(f"lake object {key}: size {found}, expected {size}")
    if lake_digest(lake, key) != expected:
        raise RuntimeError(f"lake object {key}: wrong bytes")


def check_many(lake: Lake, under: str, count: int, size: int) -> None:
    keys = [k for k in lake_keys(lake) if k.startswith(under) and k != under]
    if len(keys) != count:
        raise RuntimeError(f"{len(keys)} objects under {under} in the lake, expected {count}")
    for i in sorted({0, count // 3, count // 2, count - 1}):
        if lake.get(f"{under}f{i:06d}") != b"".join(chunks(i, size)):
            raise RuntimeError(f"lake object {under}f{i:06d}: wrong bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", choices=["local", "moto", "ceph"], default="local")
    parser.add_argument("--size", default="2G", help="the big file")
    parser.add_argument("--files", type=int, default=10_000, help="small files (0: skip)")
    parser.add_argument("--file-size", default="64K")
    parser.add_argument("--multipart-threshold", default="16M")
    parser.add_argument("--part-size", default="8M")
    parser.add_argument("--parts-in-flight", type=int, default=8)
    parser.add_argument("--promote-workers", type=int, default=4)
    parser.add_argument("--promote-delay", default="2", help="seconds (aifs sync skips it)")
    parser.add_argument("--runs", type=int, default=5,
                        help="interleaved runs (medians reported; 5 turn the order once)")
    parser.add_argument("--sync-timeout", type=float, default=1800,
                        help="seconds one `aifs sync` may take before the run fails")
    parser.add_argument("--json", help="write results here too")
    args = parser.parse_args()
    size = parse_size(args.size)
    file_size = parse_size(args.file_size)
    threshold = parse_size(args.multipart_threshold)
    part = parse_size(args.part_size)
    # SIGTERM unwinds through the finally blocks like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    work = Path(tempfile.mkdtemp(prefix="aifs-wbench-", dir="/var/tmp"))
    results: dict[str, float] = {}
    stops: list = []
    mounts: list[Mount] = []
    failed = True
    try:
        # Each run leaves its objects until the next run starts: size the store for all.
        need = args.runs * (2 * size + 2 * args.files * max(file_size, 4096))
        lake, server = bench_lake(args.lake, work, stops, need, "w")
        cache_size = 2 * (size + args.files * max(file_size, 4096)) + 1024 * MiB
        mount_args = ["--cache-size", str(cache_size), "--log-level", "warning",
                      "--multipart-threshold", args.multipart_threshold,
                      "--part-size", args.part_size,
                      "--parts-in-flight", str(args.parts_in_flight),
                      "--promote-workers", str(args.promote_workers),
                      "--promote-delay", args.promote_delay]
        expected = digest(0, size)
        runs: dict[str, list[float]] = {}

        def record(name: str, value: float) -> None:
            runs.setdefault(name, []).append(value)

        # The floors: what any pyfuse3 daemon reaches for the same writes, mounted
        # beside aifs for the whole run (see fuse_floor.py).
        floors = contextlib.ExitStack()
        stops.insert(0, floors.close)
        discard = floors.enter_context(fuse_floor(work / "floor-discard", discard=True))
        store_dir = work / "floor-store"
        store = floors.enter_context(fuse_floor(work / "floor-keep", store=store_dir))

        record("aifs_cli_startup_s", cli_startup())
        for rep in range(args.runs):
            print(f"run {rep + 1}/{args.runs}", file=sys.stderr, flush=True)
            local_big = work / f"local-{rep}.bin"
            mount = Mount(lake, work / "mnt", work / f"cache-{rep}",
                          work / "aifs.log", mount_args)
            mounts.append(mount)
            plain = Mount(lake, work / "mnt-plain", work / f"cache-plain-{rep}",
                          work / "aifs-plain.log",
                          [*mount_args, "--stream-large-files", "false"])
            mounts.append(plain)
            big = f"big-{rep}.bin"
            # The five writes of the same bytes, in an order that turns from run to
            # run: whichever goes first meets the emptiest page cache.
            writes: list[tuple[str, Path]] = [("local", local_big), ("aifs", mount.path / big),
                                              ("aifs_plain", plain.path / f"plain-{big}"),
                                              ("floor_discard", discard / big),
                                              ("floor_store", store / big)]
            shift = rep % len(writes)
            for name, path in writes[shift:] + writes[:shift]:
                os.sync()
                if not name.startswith("aifs"):
                    record(f"{name}_write_s", timed_write(path, 0, size))
                    continue
                start = time.perf_counter()
                write_file(path, 0, size)
                closed = time.perf_counter()
                aifs_sync(path, args.sync_timeout)
                in_lake = time.perf_counter()
                record(f"{name}_write_s", closed - start)
                record(f"{name}_close_to_lake_s", in_lake - closed)
                record(f"{name}_open_to_lake_s", in_lake - start)
                check_big(lake, path.name, size, expected)
            plain.unmount()
            mounts.remove(plain)
            shutil.rmtree(work / f"cache-plain-{rep}")
            for kept in store_dir.iterdir():
                kept.unlink()
            local_s = runs["local_write_s"][-1]
            for name in ("aifs", "aifs_plain", "floor_discard", "floor_store"):
                record(f"{name}_x_local", local_s / runs[f"{name}_write_s"][-1])

            os.sync()
            if server:
                record("baseline_upload_s", boto3_multipart(
                    server, lake.bucket, f"boto3/big-{rep}.bin", local_big, threshold, part,
                    args.parts_in_flight))
            else:
                assert lake.root is not None
                start = time.perf_counter()
                shutil.copyfile(local_big, lake.root / f"copy-{rep}.bin")
                record("baseline_upload_s", time.perf_counter() - start)
            local_big.unlink()

            if args.files:
                local_dir = work / f"local-many-{rep}"
                local_dir.mkdir()
                os.sync()
                record("local_creates_s", timed_creates(local_dir, args.files, file_size))
                many = mount.path / f"many-{rep}"
                many.mkdir()
                aifs_sync(many, args.sync_timeout)   # the directory marker is not timed
                os.sync()
                start = time.perf_counter()
                timed_creates(many, args.files, file_size)
                closed = time.perf_counter()
                aifs_sync(many, args.sync_timeout)
                in_lake = time.perf_counter()
                record("aifs_creates_s", closed - start)
                record("aifs_files_close_to_lake_s", in_lake - closed)
                record("aifs_files_open_to_lake_s", in_lake - start)
                if server:
                    record("baseline_puts_s", boto3_puts(
                        server, lake.bucket, f"boto3/many-{rep}/", local_dir, args.files,
                        args.promote_workers))
                shutil.rmtree(local_dir)
            mount.unmount()
            mounts.remove(mount)
            if args.files:
                check_many(lake, f"many-{rep}/", args.files, file_size)
            shutil.rmtree(work / f"cache-{rep}")
            # Free the disk (or the Ceph store) for the next run.
            for key in (big, f"plain-{big}", f"copy-{rep}.bin", f"many-{rep}"):
                delete_prefix(lake, (lake.prefix if server else "") + key)
            if server:
                delete_prefix(lake, f"boto3/big-{rep}.bin")
                delete_prefix(lake, f"boto3/many-{rep}/")
        for name, values in runs.items():
            results[name] = statistics.median(values)
            if name.endswith("_x_local"):
                results[name.replace("_x_local", "_x_local_range")] = [min(values), max(values)]
        results.update(size=size, files=args.files, file_size=file_size, runs=args.runs)
        failed = False
    finally:
        for mount in mounts:     # only after a failure: stop the daemon hard, no flush
            mount.kill()
        for point in ("mnt", "mnt-plain"):
            if os.path.ismount(work / point):
                subprocess.run(["fusermount3", "-u", "-z", str(work / point)], check=False)
        for log_name in ("aifs.log", "aifs-plain.log"):
            if failed and (work / log_name).exists():
                print(f"--- tail of {log_name} ---\n" + (work / log_name).read_text(
                    errors="replace")[-4000:], file=sys.stderr)
        for stop in stops:
            stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def report(args: argparse.Namespace, r: dict[str, float]) -> None:
    mb = r["size"] / 1e6
    s3 = args.lake != "local"
    base = (f"boto3 multipart upload ({args.part_size} parts x {args.parts_in_flight} threads)"
            if s3 else "shutil.copyfile into the lake directory")

    def rate(key: str) -> str:
        return f"{mb / r[key]:8.0f} MB/s"

    print(f"\n## write benchmark: lake={args.lake} size={args.size} "
          f"part-size={args.part_size} parts-in-flight={args.parts_in_flight} "
          f"promote-delay={args.promote_delay}, "
          f"median of {args.runs} interleaved runs\n")
    print("| measurement | time | throughput | ratio |")
    print("|---|---|---|---|")
    print(f"| local file, 1 MiB writes until close() | {r['local_write_s']:.2f} s | "
          f"{rate('local_write_s')} | 1.00 |")
    print(f"| aifs, 1 MiB writes until close() | {r['aifs_write_s']:.2f} s | "
          f"{rate('aifs_write_s')} | {r['local_write_s'] / r['aifs_write_s']:.2f} x local "
          "(>= 0.8) |")
    for key, what in (("aifs_plain", "aifs, not streaming (--stream-large-files false)"),
                      ("floor_discard", "do-nothing pyfuse3, bytes discarded"),
                      ("floor_store", "do-nothing pyfuse3, one pwrite per request into a file")):
        low, high = r[f"{key}_x_local_range"]
        print(f"| {what}, until close() | {r[f'{key}_write_s']:.2f} s | "
              f"{rate(f'{key}_write_s')} | {r[f'{key}_x_local']:.2f} x local "
              f"(runs: {low:.2f}-{high:.2f}) |")
    low, high = r["aifs_x_local_range"]
    print(f"| aifs, ratio to local per run | | | median {r['aifs_x_local']:.2f}, "
          f"runs {low:.2f}-{high:.2f} |")
    print(f"| {base} | {r['baseline_upload_s']:.2f} s | {rate('baseline_upload_s')} | 1.00 |")
    print(f"| aifs close() until in the lake (aifs sync) | {r['aifs_close_to_lake_s']:.2f} s | "
          f"{rate('aifs_close_to_lake_s')} | "
          f"{r['aifs_close_to_lake_s'] / r['baseline_upload_s']:.2f} x baseline time |")
    print(f"| aifs open() until in the lake (aifs sync) | {r['aifs_open_to_lake_s']:.2f} s | "
          f"{rate('aifs_open_to_lake_s')} | "
          f"{r['aifs_open_to_lake_s'] / r['baseline_upload_s']:.2f} x baseline time (<= 1.2) |")
    for moment in ("close", "open"):
        key = f"aifs_plain_{moment}_to_lake_s"
        print(f"| aifs not streaming, {moment}() until in the lake | {r[key]:.2f} s | "
              f"{rate(key)} | {r[key] / r['baseline_upload_s']:.2f} x baseline time |")
    if r.get("files"):
        n = r["files"]
        what = f"{n:.0f} files of {args.file_size}"
        print(f"| local: create {what} | {r['local_creates_s']:.2f} s | "
              f"{n / r['local_creates_s']:8.0f} /s | 1.00 |")
        print(f"| aifs: create {what} | {r['aifs_creates_s']:.2f} s | "
              f"{n / r['aifs_creates_s']:8.0f} /s | "
              f"{r['local_creates_s'] / r['aifs_creates_s']:.2f} x local |")
        print(f"| aifs: last close() until all in the lake | "
              f"{r['aifs_files_close_to_lake_s']:.2f} s | | |")
        print(f"| aifs: first open() until all in the lake | "
              f"{r['aifs_files_open_to_lake_s']:.2f} s | "
              f"{n / r['aifs_files_open_to_lake_s']:8.0f} files/s promoted | |")
        if "baseline_puts_s" in r:
            print(f"| boto3 put_object of the local files ({args.promote_workers} threads) | "
                  f"{r['baseline_puts_s']:.2f} s | {n / r['baseline_puts_s']:8.0f} /s | "
                  f"aifs open-to-lake {r['aifs_files_open_to_lake_s'] / r['baseline_puts_s']:.2f}"
                  " x this time |")
    print(f"\n(`aifs sync` times include the CLI's start, {r['aifs_cli_startup_s']:.2f} s)\n")


if __name__ == "__main__":
    sys.exit(main())
