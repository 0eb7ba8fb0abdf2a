"""``aifs bench``: the standard workloads on temporary mounts, one ratio table.

- :mod:`~aifs.bench.nvme`: the NVMe-tier rows (writes, reads, mmap,
  ``torch.save``/``torch.load``, small files, a DataLoader epoch) on the
  local disk beside an aifs mount of each binding asked for, over a
  local-directory lake of its own;
- :mod:`~aifs.bench.lake`: with ``--lake s3://...``, a large object read on
  a fresh node beside boto3 and s3fs on the same server, and the daemon's
  CPU per GiB;
- :mod:`~aifs.bench.mounts`: the daemons it starts and what it measures with.

Bindings: ``kernel`` (aifs's own session on /dev/fuse, with passthrough) and
``pyfuse3``. Needs root (drops the page cache) and /dev/fuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from aifs.errors import ConfigError

if TYPE_CHECKING:
    from aifs.bench.lake import Lake

__all__ = ["add_arguments", "from_args", "main"]

#: the smallest --size: the lake rows' object must be large enough to become
#: one local copy when read whole (a large object: at least one 8 MiB block)
MIN_SIZE = 8 << 20


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """The options of ``aifs bench`` (the CLI builds its parser with these)."""
    bench.add_argument("--size", default="1G", help="the big file and state dict")
    bench.add_argument("--files", type=int, default=2000, help="small files of 16 KiB")
    bench.add_argument("--runs", type=int, default=3, help="interleaved runs (medians)")
    bench.add_argument("--binding", dest="bindings", action="append",
                       choices=["kernel", "pyfuse3"], help="default: both")
    bench.add_argument("--work-dir", help="on the disk to compare with (default /var/tmp)")
    bench.add_argument("--json", action="store_true", help="the results as JSON")
    bench.add_argument("--lake", metavar="S3_URL",
                       help="also read a large object from this lake on a fresh node, "
                       "beside boto3 and s3fs on the same server (s3://BUCKET[/PREFIX]; the "
                       "object is put under a fresh prefix and deleted after)")
    bench.add_argument("--config", "-c", help="TOML configuration file (for --lake)")
    bench.add_argument("--endpoint-url", help="for --lake")
    bench.add_argument("--region", help="for --lake")
    bench.add_argument("--profile", help="for --lake")


def from_args(args: argparse.Namespace) -> int:
    from aifs.bench.lake import Lake
    from aifs.config import parse_size
    if not args.lake:
        given = [flag for flag, value in (("--config", args.config),
                                          ("--endpoint-url", args.endpoint_url),
                                          ("--region", args.region),
                                          ("--profile", args.profile)) if value]
        if given:
            raise ConfigError(f"bench: {given[0]} is for --lake (the NVMe rows use a "
                              "local-directory lake of their own)")
    lake = Lake(args.lake, args.config, args.endpoint_url, args.region,
                args.profile) if args.lake else None
    return main(parse_size(args.size), args.files, args.runs,
                args.bindings or ["kernel", "pyfuse3"], args.work_dir, args.json, lake)


def main(size: int, files: int, runs: int, bindings: list[str], work_dir: str | None,
         as_json: bool, lake: Lake | None = None) -> int:
    from aifs.bench import lake as lake_rows
    from aifs.bench import nvme
    if os.geteuid() != 0:
        raise ConfigError("bench needs root (it drops the page cache and mounts)")
    if size < MIN_SIZE or runs < 1 or files < 1:
        raise ConfigError(f"bench: --size must be at least {MIN_SIZE >> 20}M, --runs and "
                          "--files at least 1")
    server = None
    if lake is not None:  # a lake it cannot use fails now, before anything runs
        server = lake_rows.Server(lake)
        server.check()
    with contextlib.ExitStack() as stack:
        try:
            work = Path(tempfile.mkdtemp(prefix="aifs-bench-", dir=work_dir or "/var/tmp"))
        except OSError as exc:
            raise ConfigError(f"bench: no work directory in {work_dir or '/var/tmp'}: "
                              f"{exc}") from None
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        lake_result = None
        try:
            if server is not None:  # first: it needs the lake to answer
                lake_result = lake_rows.run(server, size, runs, bindings, work,
                                            progress=not as_json)
            result = nvme.run(size, files, runs, bindings, work, progress=not as_json)
        except OSError as exc:  # a full work disk, a daemon gone: after the cleanup above
            raise ConfigError(f"bench: {exc}") from None
        if lake_result is not None:
            result["lake"] = lake_result
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(nvme.table(result))
        if "lake" in result:
            print()
            print(lake_rows.table(result["lake"]))
    return 0
