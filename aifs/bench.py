"""``aifs bench``: the standard workloads on temporary mounts beside the local disk.

Each workload runs on the local disk (a directory beside the cache) and on an
aifs mount of each binding asked for (``kernel``, ``pyfuse3``, and ``uring``:
the kernel binding over FUSE over io_uring, the fuse module's
``enable_uring`` turned on for the run and put back after), interleaved
run by run so no side gets a quieter machine; the table shows medians and
the ratio of each binding to the local disk. Before each side's run every
mount has promoted what earlier runs wrote (``user.aifs.sync``): a side's
figures carry the promotion of its own files, which falls due while its
later rows run, but no other side's. The lake is a fresh
local-directory lake in the work directory, so the mount's local copies (the
NVMe tier) are what is measured; the lake itself has benchmarks of its own
(``tests/bench/``). Needs root (drops the page cache) and /dev/fuse;
torch, where installed, adds ``torch.save``/``torch.load`` and a DataLoader
epoch.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from aifs import xattrs
from aifs.errors import ConfigError

MiB = 1 << 20
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


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fp:
        fp.write("1\n")


def daemon_cpu(pid: int) -> float:
    """CPU seconds the process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Mount:
    """``aifs mount --foreground`` of ``lake`` on ``path`` with one binding."""

    def __init__(self, lake: Path, path: Path, cache: Path, binding: str, log: Path) -> None:
        path.mkdir(parents=True)
        self.path = path
        env = dict(os.environ, AIFS_FUSE_TRANSPORT="uring" if binding == "uring" else "dev")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aifs", "mount", str(lake), str(path), "--foreground",
                 "--cache-dir", str(cache), "--fuse-binding",
                 "kernel" if binding == "uring" else binding,
                 "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not os.path.ismount(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"aifs bench: the {binding} mount did not come up "
                                  f"(log: {log})")
            time.sleep(0.05)

    def stop(self) -> None:
        if os.path.ismount(self.path):
            subprocess.run([sys.executable, "-m", "aifs", "umount", str(self.path)],
                           capture_output=True, timeout=600)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def write_big(path: Path, size: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb", buffering=0) as fp:
        for _ in range(size // MiB):
            fp.write(block)


def read_all(path: Path) -> None:
    with open(path, "rb", buffering=0) as fp:
        while fp.readinto(BUFFER):
            pass


BUFFER = bytearray(MiB)


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
    from torch.utils.data import DataLoader

    class Samples:
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


def run(size: int, files: int, runs: int, bindings: list[str], work_dir: str | None,
        progress: bool = True) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise ConfigError("aifs bench needs root (it drops the page cache and mounts)")
    try:
        import warnings

        import torch
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        gen = torch.Generator().manual_seed(0)
        state: Any = {f"w{i}": torch.rand(size // 32, generator=gen) for i in range(8)}
    except ImportError:
        state = None
    switch = contextlib.ExitStack()
    if "uring" in bindings:
        from aifs.fuse.kernel import uring
        try:
            switch.enter_context(uring.switched_on())
        except OSError as exc:
            raise ConfigError(f"aifs bench: FUSE over io_uring cannot be enabled here: "
                              f"{exc}") from None
    work = Path(tempfile.mkdtemp(prefix="aifs-bench-", dir=work_dir or "/var/tmp"))
    mounts: dict[str, Mount] = {}
    times: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        (work / "lake").mkdir()
        roots = {"local": work / "local"}
        roots["local"].mkdir()
        for binding in bindings:
            mounts[binding] = Mount(work / "lake", work / f"mnt-{binding}",
                                    work / f"cache-{binding}", binding,
                                    work / f"{binding}.log")
            roots[binding] = mounts[binding].path
        sides = list(roots)
        steps = tqdm(total=runs * len(sides), desc="aifs bench", unit="side",
                     disable=not progress)
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
        steps.close()
    finally:
        for mount in mounts.values():
            mount.stop()
        shutil.rmtree(work, ignore_errors=True)
        switch.close()
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


def main(size: int, files: int, runs: int, bindings: list[str], work_dir: str | None,
         as_json: bool) -> int:
    result = run(size, files, runs, bindings, work_dir, progress=not as_json)
    print(json.dumps(result, indent=2) if as_json else table(result))
    return 0
