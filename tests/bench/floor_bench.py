"""The floor under the speed targets: the workloads whose targets compare a
mount with the local disk, run through a do-nothing pyfuse3 filesystem
(``fuse_floor.py``: data in memory or discarded, no checks, no disk) beside the
local disk, interleaved, in one run.

No pyfuse3 daemon on this machine can beat these ratios: what it adds (a
kernel round trip per request, pyfuse3's copies, trio's scheduling) is all the
floor does. So a target the floor misses is out of reach of any daemon built on
pyfuse3 here, whatever it does inside.

    python tests/bench/floor_bench.py [--size 1G] [--samples 10000] [--files 20000]

Needs root (drops the page cache), /dev/fuse and torch. Unmounts all it mounts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_bench import make_state_dict, timed_restore  # noqa: E402
from common import fuse_floor  # noqa: E402
from dataset_bench import epoch  # noqa: E402
from write_bench import timed_creates, timed_write  # noqa: E402

from aifs.config import parse_size  # noqa: E402

MiB = 1 << 20


def after_sync(timed: Callable[..., float], *args: object) -> float:
    """``timed(*args)`` once the disk has written back what came before."""
    os.sync()
    return timed(*args)


def torch_save(path: Path, state: dict) -> float:
    import torch  # already loaded by checkpoint_bench, which quiets its NumPy warning
    start = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - start


def write_samples(root: Path, count: int, max_size: int) -> None:
    rng = random.Random(7)
    root.mkdir(parents=True)
    for index in range(count):
        (root / f"s{index:06d}.jpg").write_bytes(rng.randbytes(rng.randint(1024, max_size)))


def side_by_side(runs: int, local: Callable[[int], float],
                 floor: Callable[[int], float]) -> tuple[float, float]:
    """Median times of ``runs`` interleaved runs of each."""
    times: dict[str, list[float]] = {"local": [], "floor": []}
    for run in range(runs):
        times["local"].append(local(run))
        times["floor"].append(floor(run))
    return statistics.median(times["local"]), statistics.median(times["floor"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1G", help="bytes written and saved (1 MiB steps)")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("floor_bench: needs root (it drops the page cache)", file=sys.stderr)
        return 2
    size = parse_size(args.size) // MiB * MiB
    state = make_state_dict(size, 8)

    work = Path(tempfile.mkdtemp(prefix="aifs-floor-", dir="/var/tmp"))
    local = work / "local"
    local.mkdir()
    results: dict[str, object] = {"size": size, "samples": args.samples, "files": args.files}
    try:
        with fuse_floor(work / "mnt-discard", discard=True) as discard, \
                fuse_floor(work / "mnt-floor") as floor:
            results["write"] = side_by_side(
                args.runs, lambda run: after_sync(timed_write, local / "big.bin", run, size),
                lambda run: after_sync(timed_write, discard / f"big{run}.bin", run, size))
            print("write until close:", results["write"], flush=True)
            results["save"] = side_by_side(
                args.runs, lambda run: after_sync(torch_save, local / "ckpt.pt", state),
                lambda run: after_sync(torch_save, discard / f"ckpt{run}.pt", state))
            print("torch.save:", results["save"], flush=True)
            for root in (local, floor):
                torch_save(root / "ckpt.pt", state)
            results["load"] = side_by_side(args.runs,
                                           lambda run: timed_restore(local / "ckpt.pt", state),
                                           lambda run: timed_restore(floor / "ckpt.pt", state))
            print("torch.load:", results["load"], flush=True)
            (local / "ckpt.pt").unlink()

            write_samples(local / "samples", args.samples, 64 << 10)
            write_samples(floor / "samples", args.samples, 64 << 10)
            os.sync()
            for root in (local, floor):  # a first epoch, as a training node has had
                epoch(root / "samples", args.samples, args.workers, 0)
            results["epoch"] = side_by_side(
                args.runs,
                lambda run: epoch(local / "samples", args.samples, args.workers, run + 1),
                lambda run: epoch(floor / "samples", args.samples, args.workers, run + 1))
            print("DataLoader epoch:", results["epoch"], flush=True)

            def creates(root: Path) -> float:
                root.mkdir()
                return timed_creates(root, args.files, 16 << 10)

            results["create"] = side_by_side(
                args.runs, lambda run: creates(local / f"files{run}"),
                lambda run: creates(floor / f"files{run}"))
            print("creates:", results["create"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


#: (result, workload, the ratio as local "speed" or "time", target, rate unit)
ROWS = [
    ("write", "{mib} MiB in 1 MiB `write()`s until `close()`", "speed",
     ">= 0.8 x (write path)", "MB/s"),
    ("save", "`torch.save` of a {mib} MiB state dict", "time", "<= 1.2 x (checkpoints)", ""),
    ("load", "`torch.load` of it, page cache dropped", "speed", ">= 0.7 x (checkpoints)", ""),
    ("epoch", "DataLoader epoch, {samples:,} samples, page cache dropped", "time",
     "<= 1.5 x (datasets)", ""),
    ("create", "create {files:,} files of 16 KiB", "speed", ">= 3,000 /s (packing)", "/s"),
]


def report(r: dict) -> None:
    amounts = {"MB/s": r["size"] / 1e6, "/s": r["files"]}
    print()
    print("| workload | local disk | do-nothing pyfuse3 | floor ratio | target |")
    print("|---|---|---|---|---|")
    for key, workload, kind, target, unit in ROWS:
        local, floor = r[key]
        cells = [f"{t:.2f} s" + (f" ({amounts[unit] / t:,.0f} {unit})" if unit else "")
                 for t in (local, floor)]
        ratio = local / floor if kind == "speed" else floor / local
        name = workload.format(mib=r["size"] >> 20, samples=r["samples"], files=r["files"])
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} x local {kind} | {target} |")


if __name__ == "__main__":
    sys.exit(main())
