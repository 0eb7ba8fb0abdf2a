"""Big-tree benchmark: the first walk + ``lstat`` of a tree of many files that
other tools put in a local-directory lake, through a fresh mount, beside a
walk of the same directory on the local disk (caches dropped before each);
then the daemon's memory (RSS, anonymous RSS) and LMDB bytes per file.

    python tests/bench/tree_bench.py [--files 1000000] [--dirs 1000] [--json F]

Needs root (drops the page cache) and /dev/fuse. Unmounts all it mounts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import drop_kernel_caches, finish  # noqa: E402
from metadata_bench import lmdb_bytes, walk_lstat  # noqa: E402
from support.lakes import Lake  # noqa: E402
from support.mounts import Mount  # noqa: E402


def make_tree(root: Path, files: int, dirs: int) -> None:
    """``files`` empty-ish objects (16 bytes) in ``dirs`` directories, as a
    local-directory lake holds objects (one file each)."""
    per_dir = -(-files // dirs)
    body = b"x" * 16
    made = 0
    for d in range(dirs):
        directory = root / "tree" / f"d{d:04d}"
        directory.mkdir(parents=True)
        for i in range(min(per_dir, files - made)):
            fd = os.open(directory / f"f{i:06d}", os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, body)
            os.close(fd)
        made += min(per_dir, files - made)


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            out[name] = int(value.split()[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--dirs", type=int, default=1000)
    parser.add_argument("--mount-option", action="append", default=[],
                        help="an extra option for the aifs mount (repeatable)")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aifs-tree-bench-"))
    stops: list = []
    r: dict = {"files": args.files, "dirs": args.dirs}
    try:
        lake_root = work / "lake"
        lake_root.mkdir()
        start = time.perf_counter()
        make_tree(lake_root, args.files, args.dirs)
        r["make_s"] = time.perf_counter() - start
        drop_kernel_caches()
        count, r["local_walk_s"] = walk_lstat(lake_root / "tree")
        assert count == args.files, count
        lake = Lake("local", f"file://{lake_root}", {}, [], root=lake_root)
        drop_kernel_caches()
        mount = Mount(lake, work / "mnt", work / "cache", work / "aifs.log",
                      args.mount_option)
        try:
            before = memory_kib(mount.proc.pid)
            count, r["aifs_walk_s"] = walk_lstat(mount.path / "tree")
            assert count == args.files, count
            after = memory_kib(mount.proc.pid)
            r["rss_mib_before"] = before["VmRSS"] / 1024
            r["rss_mib"] = after["VmRSS"] / 1024
            r["anon_mib"] = after["RssAnon"] / 1024
        finally:
            mount.unmount()
        r["lmdb_bytes_per_file"] = lmdb_bytes(work / "cache" / "meta") / args.files
    finally:
        finish(work, stops, r, args.json)
    n = args.files
    print(f"first walk + lstat of {n:,} files in {args.dirs:,} directories (local lake): "
          f"local disk {n / r['local_walk_s']:,.0f}/s, aifs {n / r['aifs_walk_s']:,.0f}/s "
          f"({r['local_walk_s'] / r['aifs_walk_s']:.2f}x local); daemon RSS "
          f"{r['rss_mib']:.0f} MiB (anon {r['anon_mib']:.0f} MiB; "
          f"{r['rss_mib_before']:.0f} MiB before the walk); LMDB "
          f"{r['lmdb_bytes_per_file']:.0f} bytes/file")


if __name__ == "__main__":
    main()
