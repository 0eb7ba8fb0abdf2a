"""A new node reads one directory of a lake that holds many packed files
elsewhere: the whole index in one fold (as before) against a fold split by
directory (``fold_shard_records``), same lake contents, local-directory lake.

    python tests/bench/fold_bench.py [--files 1000000] [--dirs 1000] [--json F]

The lake is made without a mount: one pack per directory (16-byte files),
their records applied to a writer's pack index and folded with the same code
``aifs gc`` uses. Each variant is then mounted fresh (empty cache) and times,
from the mount being up: list + ``lstat`` one directory, read all its files.
Needs /dev/fuse. Unmounts all it mounts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import drop_kernel_caches, finish  # noqa: E402
from support.lakes import Lake  # noqa: E402
from support.mounts import Mount  # noqa: E402

from aifs.meta.store import MetaStore  # noqa: E402
from aifs.pack.folds import (  # noqa: E402
    FOLD_SUFFIX,
    JOURNAL_DIR,
    encode_fold,
    encode_sharded_fold,
    shard_key,
)
from aifs.pack.index import PackedEntry, PackIndex, checksum, object_record  # noqa: E402

BODY = 16  # bytes per file


def make_index(work: Path, files: int, dirs: int) -> PackIndex:
    """A writer's pack index: one pack per directory, and the directories'
    markers (aifs puts one for each directory it makes)."""
    index = PackIndex(MetaStore(work / "writer"))
    per_dir = -(-files // dirs)
    stamp = time.time_ns()
    index.apply([object_record("tree/", '"m"', {"mode": "16877"}, stamp)])
    for d in range(dirs):
        pack = f"{d:020d}-bench-{d}"
        count = min(per_dir, files - d * per_dir)
        data = b"x" * BODY  # (the pack holds the same bytes: make_lake)
        records: list[dict] = [{"op": "pack", "pack": pack, "size": BODY * count, "t": stamp}]
        records += [PackedEntry(f"tree/d{d:04d}/f{i:06d}", pack, BODY * i, BODY,
                                checksum(data), stamp, mode=0o100644,
                                mtime_ns=stamp).record() for i in range(count)]
        records.append(object_record(f"tree/d{d:04d}/", '"m"', {"mode": "16877"}, stamp))
        index.apply(records)
    return index


def make_lake(root: Path, index: PackIndex, files: int, dirs: int, shards: int) -> int:
    """The lake: packs, directories, and the fold (``shards`` > 1: sharded);
    returns the bytes of the fold's objects."""
    per_dir = -(-files // dirs)
    packs = root / ".aifs" / "packs"
    packs.mkdir(parents=True)
    (root / ".aifs" / "journal").mkdir()
    for d in range(dirs):
        (root / "tree" / f"d{d:04d}").mkdir(parents=True)
        entries = index.members_of(f"{d:020d}-bench-{d}")
        data = b"".join(b"x" * BODY for _ in range(min(per_dir, files - d * per_dir)))
        assert len(entries) * BODY == len(data)
        (packs / f"{d:020d}-bench-{d}").write_bytes(data)
    name = f"{JOURNAL_DIR}{time.time_ns():020d}-bench-0{FOLD_SUFFIX}"
    covers = [f"{JOURNAL_DIR}{0:020d}-bench-0.json"]  # (the journals it replaced)
    if shards == 1:
        head, parts = encode_fold("bench", covers, index.snapshot(0), 0), []
    else:
        head, parts = encode_sharded_fold("bench", covers, index.snapshot(0), 0, shards)
    for shard, part in enumerate(parts):
        path = root / shard_key(name, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(part)
    (root / name).write_bytes(head)
    return len(head) + sum(map(len, parts))


def read_one_directory(path: Path) -> tuple[int, float, float]:
    """(files, seconds to list + lstat, seconds to read them all)."""
    start = time.perf_counter()
    names = os.listdir(path)
    for name in names:
        os.lstat(path / name)
    listed = time.perf_counter()
    for name in names:
        with open(path / name, "rb") as fp:
            assert len(fp.read()) == BODY
    return len(names), listed - start, time.perf_counter() - listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--dirs", type=int, default=1000)
    parser.add_argument("--shard-records", type=int, default=8192,
                        help="fold_shard_records of the sharded variant")
    parser.add_argument("--json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aifs-fold-bench-"))
    stops: list = []
    r: dict = {"files": args.files, "dirs": args.dirs}
    try:
        start = time.perf_counter()
        index = make_index(work, args.files, args.dirs)
        r["index_s"] = time.perf_counter() - start
        shards = 1
        while shards * args.shard_records < index.record_count():
            shards *= 2
        r["shards"] = shards
        target = f"d{args.dirs // 2:04d}"
        for variant, count in (("one fold", 1), ("sharded", shards)):
            root = work / f"lake-{count}"
            r[f"{variant} bytes"] = make_lake(root, index, args.files, args.dirs, count)
            lake = Lake("local", f"file://{root}", {}, [], root=root)
            drop_kernel_caches()
            mount = Mount(lake, work / f"mnt-{count}", work / f"cache-{count}",
                          work / f"aifs-{count}.log", ["--log-level", "warning"])
            try:
                start = time.perf_counter()
                files, list_s, read_s = read_one_directory(mount.path / "tree" / target)
                r[f"{variant} s"] = time.perf_counter() - start
                r[f"{variant} list s"], r[f"{variant} read s"] = list_s, read_s
                assert files == -(-args.files // args.dirs), files
                r[f"{variant} stats"] = json.loads(os.getxattr(mount.path, "user.aifs.stats"))
            finally:
                mount.unmount()
    finally:
        finish(work, stops, r, args.json)
    for variant in ("one fold", "sharded"):
        stats = r[f"{variant} stats"]
        print(f"{variant}: list + lstat + read one directory of {args.files:,} packed files "
              f"in {args.dirs:,}: {r[f'{variant} s']:.3f} s (list {r[f'{variant} list s']:.3f}"
              f" s, read {r[f'{variant} read s']:.3f} s); fold objects "
              f"{r[f'{variant} bytes'] / 1e6:.1f} MB, {stats['journals_read']} fold read, "
              f"{stats.get('shards_read', 0)} of {r['shards'] if variant == 'sharded' else 0}"
              " shards read")


if __name__ == "__main__":
    main()
