"""The lake rows of ``aifs bench --lake`` with one more side: aifs from another
checkout (an older commit, for "no regression" side by side), mounted with
that tree's own code and options.

    git worktree add /tmp/old-aifs COMMIT
    python tests/bench/lake_rows_against.py --tree /tmp/old-aifs \\
        --lake s3://bench/data --endpoint-url http://127.0.0.1:7481 [--size 1G] [--runs 5]
        [--binding kernel --binding pyfuse3] [--tree-binding pyfuse3]

The other tree's side is named "other"; it gets ``--fuse-binding`` only if
``--tree-binding`` is given (trees from before the kernel binding lack the
option). Its "read again" row is left empty: older trees may make no local
copy. Root only; the object is deleted after, as by ``aifs bench``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aifs.bench import lake as rows
from aifs.bench.mounts import Daemon
from aifs.config import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="the other checkout's root")
    parser.add_argument("--tree-binding", help="--fuse-binding for the other tree's mount")
    parser.add_argument("--lake", required=True)
    parser.add_argument("--endpoint-url")
    parser.add_argument("--size", default="1G")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--binding", dest="bindings", action="append",
                        choices=["kernel", "pyfuse3"],
                        help="this tree's bindings (default: kernel)")
    parser.add_argument("--work-dir", default="/var/tmp")
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    this_mount, this_wait = rows.Mount, rows.wait_admitted

    def mount(lake: str, path: Path, cache: Path, binding: str, log: Path,
              options: list[str]) -> Daemon:
        if binding != "other":
            return this_mount(lake, path, cache, binding, log, options)
        command = [sys.executable, "-m", "aifs", "mount", lake, str(path), "--foreground",
                   "--cache-dir", str(cache), "--log-level", "warning", *options]
        if args.tree_binding:
            command += ["--fuse-binding", args.tree_binding]
        # run in the tree: ``python -m`` puts the working directory first on
        # the path, before PYTHONPATH
        return Daemon(command, path, log, "the other tree's mount",
                      [sys.executable, "-m", "aifs", "umount", str(path)],
                      env=dict(os.environ, PYTHONPATH=tree), cwd=tree)

    def wait(path: Path, timeout: float = 120) -> bool:
        return False if path.name == "lake-other" else this_wait(path, timeout)

    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    imported = subprocess.run(
        [sys.executable, "-c", "import aifs; print(aifs.__file__)"], cwd=tree,
        env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True).stdout.strip()
    if not imported.startswith(tree + os.sep):
        raise SystemExit(f"the other side would import {imported}, not {tree}'s aifs")
    print(f"other: {imported}", file=sys.stderr)
    rows.Mount, rows.wait_admitted = mount, wait  # type: ignore[assignment]
    lake = rows.Lake(args.lake, endpoint_url=args.endpoint_url)
    server = rows.Server(lake)
    server.check()
    work = Path(tempfile.mkdtemp(prefix="aifs-against-", dir=args.work_dir))
    try:
        result = rows.run(server, parse_size(args.size), args.runs,
                          [*(args.bindings or ["kernel"]), "other"], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(rows.table(result))


if __name__ == "__main__":
    main()
