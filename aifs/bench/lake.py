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
  one local copy (for passthrough: the kernel binding's), a read again with
  the page cache dropped (the NVMe tier).

Time is the reader's; CPU is the daemon process's user + system time over
each read, and over the making of the copy (``/proc/PID/stat``), per GiB.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlparse

from tqdm import tqdm

from aifs import xattrs
from aifs.bench.mounts import (
    MiB,
    Mount,
    S3fsMount,
    daemon_cpu,
    drop_caches,
    read_with_cpu,
)
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
        out: list[str] = []
        for flag, value in (("--config", self.config), ("--endpoint-url", self.endpoint_url),
                            ("--region", self.region), ("--profile", self.profile)):
            if value:
                out += [flag, value]
        return out


class Server:
    """The lake's bucket through boto3 as a user would call it; every failure
    of boto3 is one line (a ConfigError)."""

    def __init__(self, lake: Lake) -> None:
        self.lake = lake
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
        self.where = f"s3://{self.bucket}/{self.prefix}"
        self.path_style = config.path_style
        self._config = config
        with self.errors("cannot reach the lake"):
            import boto3
            self.session = boto3.session.Session(profile_name=config.profile or None)
            self.client = self.new_client()
        # what boto3 resolved (an AWS_ENDPOINT_URL too): s3fs must reach the same server
        self.endpoint = self.client.meta.endpoint_url
        self.region = self.client.meta.region_name

    @contextlib.contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            yield
        except (BotoCoreError, ClientError, Boto3Error, ValueError) as exc:
            raise ConfigError(f"bench: {doing} {self.where}: {exc}") from None

    def new_client(self) -> Any:
        import botocore.config
        return self.session.client(
            "s3", endpoint_url=self._config.endpoint_url or None,
            region_name=self._config.region or self.session.region_name or "us-east-1",
            config=botocore.config.Config(
                max_pool_connections=IN_FLIGHT, retries={"total_max_attempts": 2},
                connect_timeout=10, read_timeout=self._config.request_timeout,
                s3={"addressing_style": "path" if self.path_style else "auto"}))

    def credentials(self) -> dict[str, str]:
        """The credentials as of now, as environment variables (for s3fs)."""
        with self.errors("no credentials for"):
            found = self.session.get_credentials()
            frozen = found.get_frozen_credentials() if found else None
        if frozen is None:
            return {}
        out = {"AWS_ACCESS_KEY_ID": frozen.access_key,
               "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
        if frozen.token:
            out["AWS_SESSION_TOKEN"] = frozen.token
        return out

    def check(self) -> None:
        """Fail with one line now, before anything runs, if the bench cannot
        put and delete its object there."""
        key = f"{self.prefix}aifs-bench-check-{uuid.uuid4().hex[:12]}"
        with self.errors("cannot reach the lake"):
            self.client.head_bucket(Bucket=self.bucket)
        with self.errors("cannot put a test object into"):
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"")
        with self.errors("cannot delete a test object from"):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def put(self, source: Path, key: str) -> None:
        from boto3.s3.transfer import TransferConfig
        with self.errors("cannot put the bench object into"):
            self.client.upload_file(str(source), self.bucket, key, Config=TransferConfig(
                multipart_chunksize=PART, max_concurrency=8))

    def delete(self, key: str) -> None:
        try:
            with self.errors(f"could not delete {key} from"):
                self.client.delete_object(Bucket=self.bucket, Key=key)
        except ConfigError as exc:
            print(f"aifs: {exc}", file=sys.stderr)

    def read(self, key: str, size: int) -> float:
        """Seconds to GET the object whole in parallel ranges, on new
        connections (as a fresh mount has)."""
        client = self.new_client()

        def get(offset: int) -> int:
            body = client.get_object(
                Bucket=self.bucket, Key=key,
                Range=f"bytes={offset}-{min(offset + PART, size) - 1}")["Body"]
            return len(body.read())
        try:
            with self.errors("boto3 could not read its object from"):
                start = time.perf_counter()
                with ThreadPoolExecutor(IN_FLIGHT) as pool:
                    got = sum(pool.map(get, range(0, size, PART)))
                took = time.perf_counter() - start
        finally:
            client.close()
        if got != size:
            raise ConfigError(f"bench: boto3 read {got} of {size} bytes")
        return took


def wait_admitted(mount: Path, timeout: float = 120) -> bool:
    """Wait until the mount has made a local copy of the object read whole."""
    deadline = time.monotonic() + timeout
    while json.loads(os.getxattr(mount, xattrs.STATS))["admitted"] < 1:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # (each look costs the daemon CPU the copy is measured by)
    return True


def write_random(path: Path, size: int) -> None:
    with open(path, "wb") as fp:
        left = size
        while left:
            chunk = min(left, 64 * MiB)
            fp.write(os.urandom(chunk))
            left -= chunk


def run(server: Server, size: int, runs: int, bindings: list[str], work: Path,
        progress: bool = True) -> dict[str, Any]:
    s3fs = shutil.which("s3fs")
    sides = ["boto3", *(["s3fs"] if s3fs else []), *bindings]
    folder = f"{server.prefix}aifs-bench-{uuid.uuid4().hex[:12]}"
    key = f"{folder}/{NAME}"
    gib = size / (1 << 30)
    seconds: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    copy_cpu: dict[str, list[float]] = {}
    again: dict[str, list[tuple[float, float]]] = {}
    source = work / NAME
    options = server.lake.mount_options() + ["--cache-size", str(max(4 * size, 256 * MiB))]
    steps = tqdm(total=runs * len(sides), desc="aifs bench: lake", unit="side",
                 disable=not progress)
    try:
        write_random(source, size)
        server.put(source, key)
        source.unlink()
        for rep in range(runs):
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                if side == "boto3":
                    drop_caches()
                    seconds.setdefault(side, []).append(server.read(key, size))
                elif side == "s3fs":
                    assert s3fs is not None
                    fs = S3fsMount(s3fs, f"{server.bucket}:/{folder}", work / "mnt-s3fs",
                                   work / "s3fs.log", work, server.endpoint, server.region,
                                   server.path_style, server.credentials())
                    try:
                        took, used = read_with_cpu(fs.path / NAME, fs.proc.pid, size)
                    finally:
                        fs.stop()
                    seconds.setdefault(side, []).append(took)
                    cpu.setdefault(side, []).append(used / gib)
                else:
                    cache = work / f"lake-cache-{side}"
                    mount = Mount(f"s3://{server.bucket}/{quote(folder)}", work / f"lake-{side}",
                                  cache, side, work / f"lake-{side}.log", options)
                    try:
                        took, used = read_with_cpu(mount.path / NAME, mount.proc.pid, size)
                        # the copy its close starts, made in the background for
                        # passthrough (so never by pyfuse3): its CPU too
                        copied = False
                        if side != "pyfuse3":
                            before = daemon_cpu(mount.proc.pid)
                            copied = wait_admitted(mount.path)
                            if copied:  # (else it measured the polls, not a copy)
                                copy_cpu.setdefault(side, []).append(
                                    (daemon_cpu(mount.proc.pid) - before) / gib)
                        if copied:  # else a read again would not be from the NVMe tier
                            again.setdefault(side, []).append(
                                read_with_cpu(mount.path / NAME, mount.proc.pid, size))
                    finally:
                        mount.stop()
                        shutil.rmtree(cache, ignore_errors=True)
                    seconds.setdefault(side, []).append(took)
                    cpu.setdefault(side, []).append(used / gib)
                steps.update()
    finally:
        steps.close()  # (before any error is printed)
        source.unlink(missing_ok=True)
        server.delete(key)
    return {
        "url": server.where, "size": size, "runs": runs,
        "seconds": {side: statistics.median(v) for side, v in seconds.items()},
        "daemon_cpu_s_per_gib_cold": {side: statistics.median(v) for side, v in cpu.items()},
        "daemon_cpu_s_per_gib_copy": {side: statistics.median(v)
                                      for side, v in copy_cpu.items()},
        "seconds_again": {side: statistics.median(s for s, _ in v) for side, v in again.items()},
        "daemon_cpu_s_per_gib_again": {side: statistics.median(c / gib for _, c in v)
                                       for side, v in again.items()},
        "runs_with_a_local_copy": {side: len(again.get(side, ())) for side in bindings},
    }


def _ratio(value: float, to: float | None, unit: str) -> str:
    return f"{value / to:.2f} x {unit}" if to else "-"


def table(result: dict[str, Any]) -> str:
    seconds = result["seconds"]
    cold = result["daemon_cpu_s_per_gib_cold"]
    copy = result["daemon_cpu_s_per_gib_copy"]
    warm = result["daemon_cpu_s_per_gib_again"]
    size = result["size"]
    sides = list(seconds)
    bindings = [side for side in sides if side not in ("boto3", "s3fs")]
    s3fs = cold.get("s3fs")
    head = [f"lake workload ({size / (1 << 30):g} GiB object in {result['url']})", *sides,
            *[f"{b} vs" for b in bindings], "target (kernel)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(workload: str, cell: Callable[[str], str], versus: Callable[[str], str],
            target: str) -> None:
        cells = [workload, *map(cell, sides), *map(versus, bindings), target]
        lines.append("| " + " | ".join(cells) + " |")

    row("fresh-node read of the whole object",
        lambda s: f"{size / seconds[s] / 1e6:.0f} MB/s",
        lambda b: _ratio(seconds["boto3"], seconds[b], "boto3 speed"),
        f"no regression ({FILED_MB_S} MB/s on Ceph when filed)")
    row("daemon CPU per GiB of that cold read",
        lambda s: f"{cold[s]:.2f} CPU-s" if s in cold else "-",
        lambda b: _ratio(cold[b], s3fs, "s3fs"), "<= s3fs")
    row("daemon CPU per GiB making the local copy after it (aifs only)",
        lambda s: f"{copy[s]:.2f} CPU-s" if s in copy else "-",
        lambda b: _ratio(cold[b] + copy[b], s3fs, "s3fs with the copy") if b in copy else "-",
        "")
    row("daemon CPU per GiB read again from the NVMe tier, page cache dropped",
        lambda s: f"{warm[s]:.3f} CPU-s" if s in warm else "-",
        lambda b: "" if b in warm else "no local copy made", "<= 0.05 CPU-s")
    return "\n".join(lines)
