"""The lake rows of ``aifs bench --lake s3://BUCKET/PREFIX``: one large object
that another tool wrote (boto3 puts it under a fresh prefix, and deletes it
after), read whole on a fresh node beside boto3 and s3fs on the same server.

Each run, in an order that rotates run by run so no side gets a quieter
machine:

- **boto3**: parallel range GETs of 8 MiB, 16 in flight (what an aifs cold
  read keeps in flight with the default block size and readahead), into
  memory;
- **s3fs**, where installed: a fresh mount and one whole read (s3fs keeps no
  local copy by default, so every byte comes from the lake);
- **each binding**: a fresh mount on an empty cache (a fresh node), one whole
  read (cold, from the lake); then, once the read's close has made the object
  one local copy, a read again with the page cache dropped (the NVMe tier).

Time is the reader's; CPU is the daemon process's user + system time over
each read (``/proc/PID/stat``), per GiB.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tqdm import tqdm

from aifs import xattrs
from aifs.bench.mounts import MiB, Mount, S3fsMount, drop_caches, read_with_cpu
from aifs.config import load_config
from aifs.errors import ConfigError

NAME = "object.bin"  # a large object of the regular class: read whole, it becomes a copy
PART = 8 * MiB
IN_FLIGHT = 16
#: the fresh-node read's figure when the issue was filed (Ceph RGW, this machine kind)
FILED_MB_S = 533


@dataclass
class Lake:
    """Where ``--lake`` points, and how to reach it (as ``aifs mount`` takes it)."""

    url: str
    config: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None

    def mount_options(self) -> list[str]:
        out = []
        for flag, value in (("--config", self.config), ("--endpoint-url", self.endpoint_url),
                            ("--region", self.region), ("--profile", self.profile)):
            if value:
                out += [flag, value]
        return out


class Server:
    """The lake's bucket through boto3 as a user would call it."""

    def __init__(self, lake: Lake) -> None:
        import boto3
        import botocore.config

        config = load_config(lake.config, {"lake": lake.url, "endpoint_url": lake.endpoint_url,
                                           "region": lake.region, "profile": lake.profile})
        parsed = urlparse(config.resolved_lake())
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError("bench --lake takes an s3://BUCKET[/PREFIX] lake: its rows "
                              "compare with boto3 and s3fs on the same server (the NVMe rows "
                              "use a local-directory lake of their own)")
        self.bucket = parsed.netloc
        prefix = unquote(parsed.path).strip("/")
        self.prefix = prefix + "/" if prefix else ""
        self.endpoint = config.endpoint_url
        self.path_style = config.path_style
        session = boto3.session.Session(profile_name=config.profile or None)
        self.client = session.client(
            "s3", endpoint_url=config.endpoint_url or None,
            region_name=config.region or session.region_name or "us-east-1",
            config=botocore.config.Config(
                max_pool_connections=IN_FLIGHT, retries={"total_max_attempts": 2},
                connect_timeout=10, read_timeout=config.request_timeout,
                s3={"addressing_style": "path" if config.path_style else "auto"}))
        found = session.get_credentials()
        frozen = found.get_frozen_credentials() if found else None
        self.credentials = {"AWS_ACCESS_KEY_ID": frozen.access_key,
                            "AWS_SECRET_ACCESS_KEY": frozen.secret_key} if frozen else {}
        if frozen and frozen.token:
            self.credentials["AWS_SESSION_TOKEN"] = frozen.token

    def check(self) -> None:
        """Fail with one line now, before anything runs, if the bucket cannot be reached."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(f"bench: cannot reach the lake s3://{self.bucket}/"
                              f"{self.prefix}: {exc}") from None

    def put(self, source: Path, key: str) -> None:
        from boto3.exceptions import S3UploadFailedError
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            self.client.upload_file(str(source), self.bucket, key, Config=TransferConfig(
                multipart_chunksize=PART, max_concurrency=8))
        except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
            raise ConfigError(f"bench: cannot put the bench object into "
                              f"s3://{self.bucket}/{key}: {exc}") from None

    def delete(self, key: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            print(f"aifs: bench: could not delete s3://{self.bucket}/{key}: {exc}",
                  file=sys.stderr)

    def read(self, key: str, size: int) -> float:
        """Seconds to GET the object whole in parallel ranges."""
        def get(offset: int) -> int:
            body = self.client.get_object(
                Bucket=self.bucket, Key=key,
                Range=f"bytes={offset}-{min(offset + PART, size) - 1}")["Body"]
            return len(body.read())
        start = time.perf_counter()
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            got = sum(pool.map(get, range(0, size, PART)))
        if got != size:
            raise ConfigError(f"bench: boto3 read {got} of {size} bytes")
        return time.perf_counter() - start


def wait_admitted(mount: Path, timeout: float = 120) -> bool:
    """Wait until the mount has made a local copy of the object read whole."""
    deadline = time.monotonic() + timeout
    while json.loads(os.getxattr(mount, xattrs.STATS))["admitted"] < 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as fp:
        left = size
        while left:
            chunk = min(left, 64 * MiB)
            fp.write(os.urandom(chunk))
            left -= chunk


def run(lake: Lake, server: Server, size: int, runs: int, bindings: list[str], work: Path,
        progress: bool = True) -> dict[str, Any]:
    s3fs = shutil.which("s3fs")
    sides = ["boto3", *(["s3fs"] if s3fs else []), *bindings]
    folder = f"{server.prefix}aifs-bench-{uuid.uuid4().hex[:12]}"
    key = f"{folder}/{NAME}"
    gib = size / (1 << 30)
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    again: dict[str, list[tuple[float, float]]] = {}
    copies: dict[str, int] = {}
    source = work / NAME
    options = lake.mount_options() + ["--cache-size", str(max(4 * size, 256 * MiB))]
    try:
        write_random(source, size)
        server.put(source, key)
        source.unlink()
        steps = tqdm(total=runs * len(sides), desc="aifs bench: lake", unit="side",
                     disable=not progress)
        for rep in range(runs):
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                if side == "boto3":
                    drop_caches()
                    seconds.setdefault(side, []).append(server.read(key, size))
                elif side == "s3fs":
                    assert s3fs is not None
                    fs = S3fsMount(s3fs, server.bucket, work / "mnt-s3fs", work / "s3fs.log",
                                   server.endpoint, server.path_style, server.credentials)
                    try:
                        took, used = read_with_cpu(fs.path / key, fs.proc.pid)
                    finally:
                        fs.stop()
                    seconds.setdefault(side, []).append(took)
                    cpu.setdefault(side, []).append(used / gib)
                else:
                    cache = work / f"lake-cache-{side}"
                    mount = Mount(f"s3://{server.bucket}/{folder}", work / f"lake-{side}",
                                  cache, side, work / f"lake-{side}.log", options)
                    try:
                        took, used = read_with_cpu(mount.path / NAME, mount.proc.pid)
                        copies[side] = copies.get(side, 0) + wait_admitted(mount.path)
                        again.setdefault(side, []).append(
                            read_with_cpu(mount.path / NAME, mount.proc.pid))
                    finally:
                        mount.stop()
                        shutil.rmtree(cache, ignore_errors=True)
                    seconds.setdefault(side, []).append(took)
                    cpu.setdefault(side, []).append(used / gib)
                steps.update()
        steps.close()
    finally:
        source.unlink(missing_ok=True)
        server.delete(key)
    return {
        "url": f"s3://{server.bucket}/{server.prefix}", "size": size, "runs": runs,
        "seconds": {side: statistics.median(v) for side, v in seconds.items()},
        "daemon_cpu_s_per_gib_cold": {side: statistics.median(v) for side, v in cpu.items()},
        "seconds_again": {side: statistics.median(s for s, _ in v) for side, v in again.items()},
        "daemon_cpu_s_per_gib_again": {side: statistics.median(c / gib for _, c in v)
                                       for side, v in again.items()},
        "runs_with_a_local_copy": copies,
    }


def table(result: dict[str, Any]) -> str:
    seconds = result["seconds"]
    cold = result["daemon_cpu_s_per_gib_cold"]
    warm = result["daemon_cpu_s_per_gib_again"]
    size = result["size"]
    bindings = list(warm)
    sides = list(seconds)
    head = [f"lake workload ({size / (1 << 30):g} GiB object in {result['url']})", *sides,
            *[f"{b} vs" for b in bindings], "target (kernel)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(cells: list[str]) -> None:
        lines.append("| " + " | ".join(cells) + " |")

    row(["fresh-node read of the whole object",
         *[f"{size / seconds[s] / 1e6:.0f} MB/s" for s in sides],
         *[f"{seconds['boto3'] / seconds[b]:.2f} x boto3 speed" for b in bindings],
         f"no regression ({FILED_MB_S} MB/s on Ceph when filed)"])
    row(["daemon CPU per GiB of that cold read",
         *[f"{cold[s]:.2f} CPU-s" if s in cold else "-" for s in sides],
         *[f"{cold[b] / cold['s3fs']:.2f} x s3fs" if "s3fs" in cold else "-"
           for b in bindings],
         "<= s3fs"])
    row(["daemon CPU per GiB read again from the NVMe tier, page cache dropped",
         *[f"{warm[s]:.3f} CPU-s" if s in warm else "-" for s in sides],
         *["" for _ in bindings], "<= 0.05 CPU-s"])
    return "\n".join(lines)
