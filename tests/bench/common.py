"""What the benchmarks share: starting an S3 server, the boto3 baseline."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import conftest


def start_server(kind: str, work: Path, stops: list, store_gb: int) -> conftest.S3Server:
    """Start a moto or Ceph RGW server; its stop goes into ``stops``."""
    stack = contextlib.ExitStack()
    stops.append(stack.close)
    if kind == "moto":
        return stack.enter_context(conftest.moto_process())
    return stack.enter_context(conftest.ceph_process(work / "ceph", max(20, store_gb)))


def aifs_sync(path: Path, timeout: float) -> None:
    """``aifs sync PATH`` as a user runs it; fails loudly if it fails or hangs."""
    result = subprocess.run([sys.executable, "-m", "aifs", "sync", "--quiet", str(path)],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"aifs sync {path} exited with {result.returncode}: "
                           f"{result.stderr.strip()}")


def boto3_multipart(server: conftest.S3Server, bucket: str, key: str, source: Path,
                    threshold: int, part: int, parallel: int) -> float:
    from boto3.s3.transfer import TransferConfig
    config = TransferConfig(multipart_threshold=threshold, multipart_chunksize=part,
                            max_concurrency=parallel, use_threads=True,
                            preferred_transfer_client="classic")
    start = time.perf_counter()
    server.client.upload_file(str(source), bucket, key, Config=config)
    return time.perf_counter() - start


def bench_lake(kind: str, work: Path, stops: list, need_bytes: int,
               prefix: str) -> tuple[conftest.Lake, conftest.S3Server | None]:
    """A lake for a benchmark run: a local directory under ``work``, or a bucket
    on a moto or Ceph server sized for ``need_bytes`` (deleted objects are freed
    later by radosgw's GC)."""
    if kind == "local":
        root = work / "lake"
        root.mkdir()
        return conftest.Lake("local", f"file://{root}", {}, [], root=root), None
    server = start_server(kind, work, stops, math.ceil(need_bytes * 1.5 / 1e9) + 4)
    lake = conftest.Lake(kind, f"s3://bench/{prefix}", server.env,
                         ["--endpoint-url", server.endpoint], server=server,
                         bucket="bench", prefix=prefix + "/")
    server.client.create_bucket(Bucket=lake.bucket)
    return lake, server


@contextlib.contextmanager
def fuse_floor(mountpoint: Path):
    """The do-nothing pyfuse3 filesystem of ``fuse_floor.py`` mounted at
    ``mountpoint`` for the block; unmounted (and its process gone) after it."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuse_floor.py")),
                                str(mountpoint)])
    try:
        conftest.wait_for(lambda: os.path.ismount(mountpoint) or process.poll() is not None,
                          30, "the floor filesystem to mount")
        if process.poll() is not None:
            raise RuntimeError(f"fuse_floor.py exited with {process.returncode}")
        yield mountpoint
    finally:
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def drop_kernel_caches(dentries_too: bool = True) -> None:
    """Write back, then forget cached file data (root only), and with
    ``dentries_too`` dentries and inodes as well: reads through a mount that
    stays mounted then reach its daemon as a fresh mount's would."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n" if dentries_too else "1\n")


def finish(work: Path, stops: list, results: dict, json_path: str | None) -> None:
    """Stop the servers a run started, remove its work directory, keep its
    results as JSON if asked."""
    for stop in stops:
        stop()
    shutil.rmtree(work, ignore_errors=True)
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
