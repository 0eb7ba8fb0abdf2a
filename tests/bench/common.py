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

from support.lakes import Lake
from support.mounts import wait_for
from support.servers import S3Server, ceph_process, moto_process

from aifs.config import Config
from aifs.daemon import tune_mount


def start_server(kind: str, work: Path, stops: list, store_gb: int) -> S3Server:
    """Start a moto or Ceph RGW server; its stop goes into ``stops``."""
    stack = contextlib.ExitStack()
    stops.append(stack.close)
    if kind == "moto":
        return stack.enter_context(moto_process())
    return stack.enter_context(ceph_process(work / "ceph", max(20, store_gb)))


def aifs_sync(path: Path, timeout: float) -> None:
    """``aifs sync PATH`` as a user runs it; fails loudly if it fails or hangs."""
    result = subprocess.run([sys.executable, "-m", "aifs", "sync", "--quiet", str(path)],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"aifs sync {path} exited with {result.returncode}: "
                           f"{result.stderr.strip()}")


def boto3_multipart(server: S3Server, bucket: str, key: str, source: Path,
                    threshold: int, part: int, parallel: int) -> float:
    from boto3.s3.transfer import TransferConfig
    config = TransferConfig(multipart_threshold=threshold, multipart_chunksize=part,
                            max_concurrency=parallel, use_threads=True,
                            preferred_transfer_client="classic")
    start = time.perf_counter()
    server.client.upload_file(str(source), bucket, key, Config=config)
    return time.perf_counter() - start


def bench_lake(kind: str, work: Path, stops: list, need_bytes: int,
               prefix: str) -> tuple[Lake, S3Server | None]:
    """A lake for a benchmark run: a local directory under ``work``, or a bucket
    on a moto or Ceph server sized for ``need_bytes`` (deleted objects are freed
    later by radosgw's GC)."""
    if kind == "local":
        root = work / "lake"
        root.mkdir()
        return Lake("local", f"file://{root}", {}, [], root=root), None
    server = start_server(kind, work, stops, math.ceil(need_bytes * 1.5 / 1e9) + 4)
    lake = Lake(kind, f"s3://bench/{prefix}", server.env,
                ["--endpoint-url", server.endpoint], server=server,
                bucket="bench", prefix=prefix + "/")
    server.client.create_bucket(Bucket=lake.bucket)
    return lake, server


class FuseDaemon:
    """A FUSE daemon other than aifs (those go through ``Mount``) run in
    the foreground: started and waited for until it serves ``mountpoint``;
    :meth:`stop` unmounts it and reaps the process, lazily if it will not go."""

    def __init__(self, command: list[str], mountpoint: Path, log: Path | None,
                 what: str) -> None:
        self.path = mountpoint
        mountpoint.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") if log else contextlib.nullcontext() as out:
            self.proc = subprocess.Popen(command, stdout=out,
                                         stderr=subprocess.STDOUT if out else None)
        try:
            wait_for(lambda: os.path.ismount(mountpoint) or self.proc.poll() is not None,
                     30, f"{what} to mount")
        except AssertionError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log else ""
            raise RuntimeError(f"{what} exited with {self.proc.returncode}: {tail}")

    def stop(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", str(self.path)], check=False,
                           capture_output=True)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                           capture_output=True)


@contextlib.contextmanager
def fuse_floor(mountpoint: Path, discard: bool = False, store: Path | None = None):
    """The do-nothing pyfuse3 filesystem of ``fuse_floor.py`` mounted at
    ``mountpoint`` for the block (``discard``: it keeps no written bytes;
    ``store``: it keeps them in files there, one ``pwrite`` per request);
    unmounted (and its process gone) after it. It runs with the readahead
    window and request queue aifs sets for its own mounts."""
    command = [sys.executable, str(Path(__file__).with_name("fuse_floor.py")), str(mountpoint)]
    if discard:
        command.append("--discard")
    if store is not None:
        store.mkdir(parents=True, exist_ok=True)
        command += ["--store", str(store)]
    daemon = FuseDaemon(command, mountpoint, None, "the do-nothing filesystem")
    try:
        tune_mount(os.stat(mountpoint).st_dev, Config())  # the kernel settings an aifs mount gets
        yield mountpoint
    finally:
        daemon.stop()


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
