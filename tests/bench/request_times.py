"""Where a burst of small-file creates and opens spends its time, request by
request, on the kernel binding: how long the daemon takes to serve each kind
of request (wall and the daemon thread's CPU) and how long it waits between
an answer and the next request (the program's own work and the round trip).

A mount of a temporary local-directory lake is served by a daemon run from
this script, which times ``Session._serve`` (nothing else of aifs changes);
bursts of creates of 16 KiB files, then opens and reads of them, run on it
beside a directory of the same disk, as ``aifs bench`` does (its functions).
As root:

    python tests/bench/request_times.py [--files 2000] [--bursts 3]
        [--pause 3] [--promote-delay 3600] [--work-dir /var/tmp] [--json]

``--promote-delay 3600`` keeps promotion out of the bursts (the daemon's
own requests only); ``--pause`` seconds between bursts let spare files be
made again, as between a job's phases.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def daemon(argv: list[str], out: str) -> None:
    """Run ``aifs mount`` with ``Session._serve`` timed; the summary goes to ``out``."""
    from aifs import cli
    from aifs.fuse.kernel import protocol as p
    from aifs.fuse.kernel import session

    served: list[tuple[int, float, float, float]] = []  # opcode, start, end, CPU
    serve = session.Session._serve

    async def timed_serve(self: session.Session, data: memoryview) -> None:
        opcode = p.IN_HEADER.unpack_from(data)[1]
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            await serve(self, data)
        finally:
            served.append((opcode, start, time.perf_counter(), time.thread_time() - cpu))

    session.Session._serve = timed_serve  # type: ignore[method-assign]

    def summary() -> None:
        walls: dict[str, list[float]] = collections.defaultdict(list)
        cpus: dict[str, list[float]] = collections.defaultdict(list)
        gaps: dict[str, list[float]] = collections.defaultdict(list)
        pairs = zip(served, served[1:], strict=False)
        for (before, _, ended, _), (opcode, start, end, cpu) in pairs:
            if start - ended > 0.05 or end - start > 0.05:  # between bursts, or a sync
                continue
            name = p.NAMES.get(opcode, str(opcode))
            walls[name].append(end - start)
            cpus[name].append(cpu)
            gaps[f"{p.NAMES.get(before, before)} -> {name}"].append(start - ended)
        with open(out, "w") as fp:
            json.dump({"serve": walls, "cpu": cpus, "gaps": gaps}, fp)

    atexit.register(summary)
    sys.exit(cli.main(argv))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--promote-delay", default="3600")
    parser.add_argument("--work-dir", default="/var/tmp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from aifs.bench.mounts import timed
    from aifs.bench.nvme import creates, opens

    work = Path(tempfile.mkdtemp(prefix="aifs-requests-", dir=args.work_dir))
    lake, mnt, local, summary = work / "lake", work / "mnt", work / "local", work / "times.json"
    for path in (lake, mnt, local):
        path.mkdir()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--daemon", str(summary), "mount", str(lake), str(mnt),
         "--foreground", "--cache-dir", str(work / "cache"), "--fuse-binding", "kernel",
         "--promote-delay", args.promote_delay, "--log-level", "warning"])
    bursts: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("request_times: the mount did not come up")
            time.sleep(0.05)
        for burst in range(args.bursts):
            os.sync()
            row = {"local creates": timed(creates, local / f"b{burst}", args.files)}
            os.sync()
            row["creates"] = timed(creates, mnt / f"b{burst}", args.files)
            row["opens"] = timed(opens, mnt / f"b{burst}", args.files)
            row["local opens"] = timed(opens, local / f"b{burst}", args.files)
            bursts.append(row)
            time.sleep(args.pause)
    finally:
        if os.path.ismount(mnt):
            subprocess.run([sys.executable, "-m", "aifs", "umount", str(mnt)],
                           capture_output=True, timeout=600)
        proc.wait(120)
        times = json.loads(summary.read_text()) if summary.exists() else {}
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"bursts": bursts, **times}))
        return
    for i, row in enumerate(bursts):
        print(f"burst {i}: " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()))
    print("| request | n | serve, median (us) | serve, mean (us) | CPU, mean (us) | total (s) |")
    print("|---|---|---|---|---|---|")
    for name, values in sorted(times["serve"].items(), key=lambda kv: -sum(kv[1])):
        cpu = times["cpu"][name]
        print(f"| {name} | {len(values)} | {statistics.median(values) * 1e6:.1f} | "
              f"{statistics.fmean(values) * 1e6:.1f} | {statistics.fmean(cpu) * 1e6:.1f} | "
              f"{sum(values):.3f} |")
    print("| between an answer and the next request | n | median (us) | | | total (s) |")
    for name, values in sorted(times["gaps"].items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"| {name} | {len(values)} | {statistics.median(values) * 1e6:.1f} | | | "
              f"{sum(values):.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--daemon":
        daemon(sys.argv[3:], sys.argv[2])
    else:
        main()
