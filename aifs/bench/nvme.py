"""The NVMe-tier rows of ``aifs bench``: each workload on the local disk (a
directory beside the cache) and on an aifs mount of each binding asked for,
interleaved run by run so no side gets a quieter machine; the table shows
medians and the ratio of each binding to the local disk. Before each side's
run every mount has promoted what earlier runs wrote (``user.aifs.sync``): a
side's figures carry the promotion of its own files, which falls due while
its later rows run, but no other side's. The lake is a fresh local-directory
lake in the work directory, so the mount's local copies (the NVMe tier) are
what is measured. torch, where installed, adds ``torch.save``/``torch.load``
and a DataLoader epoch.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from aifs import xattrs
from aifs.bench.mounts import MiB, Mount, daemon_cpu, drop_caches, read_all, timed

SMALL = 16 << 10

#: key, workload, "speed" (ratio local/side time... shown as x local speed) or
#: "time" (side/local), target for the kernel binding
ROWS = [
    ("write", "{gib:g} GiB in 1 MiB writes until close", "speed", ">= 0.95 x"),
    ("read_after_write", "read right after it was written", "speed", ">= 0.9 x"),
    ("nvme_read", "read it from the NVMe tier, page cache dropped", "speed", ">= 0.9 x"),
    ("mmap", "mmap it and touch every page, page cache dropped", "speed", ">= 0.9 x"),
    ("save", "torch.save of a {gib:g} GiB state dict", "time", "<= 1.1 x"),
    ("load", "torch.load of it, page cache dropped", "speed", ">= 0.9 x"),
    ("creates", "{files:,} creates of 16 KiB", "time", "<= 0.35 s"),
    ("opens", "{files:,} opens + reads of those", "time", "<= 0.3 s"),
    ("epoch", "DataLoader epoch over them, 4 workers, page cache dropped", "time",
     "<= 2 x"),
]


def write_big(path: Path, size: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb", buffering=0) as fp:
        for _ in range(size // MiB):
            fp.write(block)


def touch_pages(path: Path) -> None:
    with open(path, "rb") as fp, mmap.mmap(fp.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        bytes(memoryview(mapped)[::4096])


def creates(root: Path, files: int) -> None:
    root.mkdir()
    data = os.urandom(SMALL)
    for i in range(files):
        with open(root / f"s{i:06d}", "wb") as fp:
            fp.write(data)


def opens(root: Path, files: int) -> None:
    for i in range(files):
        with open(root / f"s{i:06d}", "rb") as fp:
            fp.read()


def torch_rows(root: Path, size: int, files: int, state: Any) -> dict[str, Callable[[], float]]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Samples(Dataset[int]):
        def __len__(self) -> int:
            return files

        def __getitem__(self, index: int) -> int:
            with open(root / "small" / f"s{index:06d}", "rb") as fp:
                return len(fp.read())

    def save() -> float:
        os.sync()
        return timed(torch.save, state, root / "ckpt.pt")

    def load() -> float:
        drop_caches()
        return timed(lambda: torch.load(root / "ckpt.pt", weights_only=True))

    def epoch() -> float:
        loader = DataLoader(Samples(), batch_size=64, shuffle=True, num_workers=4)
        drop_caches()
        return timed(lambda: sum(int(batch.sum()) for batch in loader))

    return {"save": save, "load": load, "epoch": epoch}


def run(size: int, files: int, runs: int, bindings: list[str], work: Path,
        progress: bool = True) -> dict[str, Any]:
    try:
        import warnings

        import torch
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        gen = torch.Generator().manual_seed(0)
        state: Any = {f"w{i}": torch.rand(size // 32, generator=gen) for i in range(8)}
    except ImportError:
        state = None
    mounts: dict[str, Mount] = {}
    times: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, list[float]] = {}
    lake = work / "lake"
    steps = tqdm(total=runs * (1 + len(bindings)), desc="aifs bench: NVMe tier", unit="side",
                 disable=not progress)
    try:
        lake.mkdir()
        roots = {"local": work / "local"}
        roots["local"].mkdir()
        for binding in bindings:
            mounts[binding] = Mount(f"file://{lake}", work / f"mnt-{binding}",
                                    work / f"cache-{binding}", binding,
                                    work / f"{binding}.log")
            roots[binding] = mounts[binding].path
        sides = list(roots)
        for rep in range(runs):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                root = roots[side] / f"{side}-run{rep}"  # one lake: names of their own
                root.mkdir()
                big = root / "big.bin"
                got = times.setdefault(side, {})

                def note(key: str, seconds: float, got: dict = got) -> None:
                    got.setdefault(key, []).append(seconds)

                for mount in mounts.values():  # no side pays for an earlier one
                    os.getxattr(mount.path, xattrs.SYNC)
                os.sync()
                note("write", timed(write_big, big, size))
                note("read_after_write", timed(read_all, big))
                drop_caches()
                before = daemon_cpu(mounts[side].proc.pid) if side in mounts else 0.0
                note("nvme_read", timed(read_all, big))
                if side in mounts:
                    cpu.setdefault(side, []).append(
                        (daemon_cpu(mounts[side].proc.pid) - before) / (size / (1 << 30)))
                drop_caches()
                note("mmap", timed(touch_pages, big))
                big.unlink()
                os.sync()
                note("creates", timed(creates, root / "small", files))
                note("opens", timed(opens, root / "small", files))
                if state is not None:
                    for key, fn in torch_rows(root, size, files, state).items():
                        note(key, fn())
                    (root / "ckpt.pt").unlink()
                steps.update()
    finally:
        steps.close()  # (before any error is printed)
        for mount in mounts.values():
            mount.stop()
        shutil.rmtree(lake, ignore_errors=True)
    medians = {side: {key: statistics.median(values) for key, values in got.items()}
               for side, got in times.items()}
    return {"size": size, "files": files, "runs": runs, "seconds": medians,
            "daemon_cpu_s_per_gib_warm": {side: statistics.median(v) for side, v in cpu.items()}}


def table(result: dict[str, Any]) -> str:
    seconds = result["seconds"]
    sides = list(seconds)
    bindings = [side for side in sides if side != "local"]
    head = ["workload", *[f"{side} (s)" for side in sides],
            *[f"{b} vs local" for b in bindings], "target (kernel)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, workload, kind, target in ROWS:
        if key not in seconds["local"]:
            continue
        local = seconds["local"][key]
        cells = [workload.format(gib=result["size"] / (1 << 30), files=result["files"])]
        cells += [f"{seconds[side][key]:.3f}" for side in sides]
        for b in bindings:
            ratio = local / seconds[b][key] if kind == "speed" else seconds[b][key] / local
            cells.append(f"{ratio:.2f} x local {kind}")
        lines.append("| " + " | ".join(cells + [target]) + " |")
    cpu = result["daemon_cpu_s_per_gib_warm"]
    lines.append("| " + " | ".join(["daemon CPU per GiB read from the NVMe tier", "-",
                                    *[f"{cpu[b]:.3f} CPU-s" for b in bindings],
                                    *["" for _ in bindings], "<= 0.05 CPU-s"]) + " |")
    return "\n".join(lines)

