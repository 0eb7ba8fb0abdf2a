"""Checkpoint benchmark: a training-loop simulation that saves a state dict
(default 1 GiB, 8 tensors) every few seconds with torch.save, into a local file,
into an aifs mount and into an s3fs write-through mount of the same bucket.
Every figure is measured in the same run as its baselines:

- blocked in save: wall time of the save routine (torch.save, open to close,
  plus the write of a DeepSpeed-style ``latest`` commit marker), per target;
- published: from the start of the save until the checkpoint object is in the
  lake with its full size (the lake is polled directly: HEAD every 20 ms, or
  stat on the local lake), and until the ``latest`` marker names it; against
  the lake's PUT bandwidth measured with a boto3 multipart upload of the same
  file (same part size and parallelism as aifs);
- restore: torch.load of the newest checkpoint through the mount (its data is
  on the local NVMe tier) against torch.load of the local file, page cache
  dropped before each.

It also checks the commit order (the ``latest`` marker must never name a
checkpoint the lake does not hold in full: "MARKER ORDER VIOLATION"), that the
bytes in the lake are those saved, and reports CPU use during the saves (this
process, the mount daemon, the S3 server, all cores).

    python tests/bench/checkpoint_bench.py --lake local|moto|ceph [--size 1G] [--saves 3]
                                           [--step-seconds 5] [--runs 1] [--json F]

No fsync in the timed save by default (torch.save does none; ``--fsync`` adds
one for every target). ``sync`` runs, untimed, at the start of every training
step so no target inherits another's dirty pages. Needs root (drops the page
cache, mounts) and /dev/fuse; installs s3fs with apt-get when it is missing
(``--no-s3fs`` skips that target, and if s3fs cannot be used a labelled
emulation stands in). Unmounts and stops all it starts, also on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    FuseDaemon,
    bench_lake,
    boto3_multipart,
    drop_kernel_caches,
    finish,
)
from support.lakes import LOCAL_STAGING, Lake, delete_prefix  # noqa: E402
from support.mounts import (  # noqa: E402
    Mount,
    file_digest,
    wait_for,
)
from support.packed import lake_digest, lake_size  # noqa: E402
from support.servers import S3Server  # noqa: E402

from aifs.bench.mounts import daemon_cpu  # noqa: E402
from aifs.config import parse_size  # noqa: E402

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402

MiB = 1 << 20
MARKER = "latest"  # DeepSpeed's commit marker: names the newest complete checkpoint


# -- the simulated job ---------------------------------------------------------------
def make_state_dict(size: int, tensors: int) -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors of ``size`` bytes in all, random (built once)."""
    per = max(1, size // tensors // 4)
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.rand(per, generator=gen) for i in range(tensors)}


def training_step(sd: dict[str, torch.Tensor], step: int, seconds: float) -> None:
    """A CPU-light stand-in for training: the weights change a little (deterministically,
    so checkpoint ``i`` has the same bytes on every target) and time passes."""
    start = time.perf_counter()
    for tensor in sd.values():
        tensor[:1024] = float(step)
    os.sync()  # no target inherits another's dirty pages (part of the step, untimed)
    left = seconds - (time.perf_counter() - start)
    if left > 0:
        time.sleep(left)


def save_checkpoint(sd: dict[str, torch.Tensor], directory: Path, index: int,
                    fsync: bool, marker: bool) -> tuple[float, float]:
    """torch.save of checkpoint ``index``, then the ``latest`` marker naming it.
    Returns (seconds in torch.save [+ fsync], seconds for the whole routine)."""
    path = directory / f"ckpt_{index}.pt"
    start = time.perf_counter()
    torch.save(sd, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    saved = time.perf_counter()
    if marker:
        with open(directory / MARKER, "w") as fp:
            fp.write(path.name)
            if fsync:
                fp.flush()
                os.fsync(fp.fileno())
    return saved - start, time.perf_counter() - start


def timed_restore(path: Path, expected: dict[str, torch.Tensor]) -> float:
    drop_kernel_caches()
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    elapsed = time.perf_counter() - start
    if loaded.keys() != expected.keys() or not all(
            torch.equal(loaded[k], expected[k]) for k in expected):
        raise RuntimeError(f"{path}: torch.load gave other tensors than were saved")
    return elapsed


# -- watching the lake -------------------------------------------------------------
class LakeWatch:
    """Polls the lake directly (HEAD / stat, every ``interval`` s) in a thread for
    checkpoint objects reaching their full size, and for the marker naming them."""

    def __init__(self, lake: Lake, interval: float) -> None:
        self.lake = lake
        self.interval = interval
        self.lock = threading.Lock()
        self.objects: dict[str, tuple[int, float]] = {}  # key -> (size, t0) still awaited
        self.seen: dict[str, float] = {}                  # key -> perf_counter when complete
        self.markers: dict[int, float] = {}               # index -> t0, still awaited
        self.marker_seen: dict[int, float] = {}           # index -> when marker named >= it
        self.marker_key = ""
        self.marker_etag: str | None = None
        self.sizes: dict[int, tuple[str, int]] = {}       # index -> (key, size)
        self.violations: list[str] = []
        self.requests = 0
        self.cpu_s = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lake-watch", daemon=True)
        self._thread.start()

    def expect(self, index: int, key: str, size: int, t0: float, marker_key: str) -> None:
        with self.lock:
            self.objects[key] = (size, t0)
            self.sizes[index] = (key, size)
            if marker_key:
                self.marker_key = marker_key
                self.markers[index] = t0

    def _size(self, key: str) -> int | None:
        self.requests += 1
        return lake_size(self.lake, key)

    def _marker(self) -> int | None:
        """The index the marker names now (GET only when its ETag/mtime changed)."""
        import botocore.exceptions
        self.requests += 1
        try:
            if self.lake.server:
                head = self.lake.server.client.head_object(
                    Bucket=self.lake.bucket, Key=self.lake.prefix + self.marker_key)
                tag = head["ETag"]
            else:
                assert self.lake.root is not None
                st = os.stat(self.lake.root / self.marker_key)
                tag = f"{st.st_mtime_ns}-{st.st_size}-{st.st_ino}"
            if tag == self.marker_etag:
                return None
            self.requests += 1
            text = self.lake.get(self.marker_key).decode()
        except FileNotFoundError:
            return None
        except botocore.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        self.marker_etag = tag
        return int(text.strip().removeprefix("ckpt_").removesuffix(".pt"))

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            while not self._stop.is_set():
                with self.lock:
                    objects = dict(self.objects)
                    markers = dict(self.markers)
                for key, (size, _t0) in objects.items():
                    if self._size(key) == size:
                        now = time.perf_counter()
                        with self.lock:
                            self.seen[key] = now
                            del self.objects[key]
                if markers:
                    named = self._marker()
                    if named is not None and named not in self.sizes:
                        self.marker_etag = None  # ahead of expect(): read it again
                    elif named is not None:
                        now = time.perf_counter()
                        key, size = self.sizes[named]
                        found = self._size(key)
                        if found != size:   # the rule aifs promises: marker after its files
                            self.violations.append(
                                f"marker named ckpt_{named} while the lake had {found} of "
                                f"{size} bytes of it")
                        with self.lock:
                            for index in [i for i in self.markers if i <= named]:
                                self.marker_seen[index] = now
                                del self.markers[index]
                self.cpu_s = time.thread_time() - cpu0
                self._stop.wait(self.interval)
        except BaseException as exc:  # reported by wait()
            self.error = exc

    def wait(self, timeout: float) -> None:
        """Until every checkpoint and marker expected so far was seen."""
        deadline = time.monotonic() + timeout
        while True:
            if self.error:
                raise RuntimeError(f"lake watch failed: {self.error!r}") from self.error
            with self.lock:
                if not self.objects and not self.markers:
                    return
                left = sorted(self.objects) + [f"marker>=ckpt_{i}" for i in self.markers]
            if time.monotonic() > deadline:
                raise RuntimeError(f"not in the lake after {timeout:.0f}s: {left}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# -- targets -------------------------------------------------------------------------
def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    with open("/proc/stat") as fp:
        fields = [int(v) for v in fp.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def server_pids(server: S3Server | None, work: Path) -> list[int]:
    """The S3 server's processes: the Ceph daemons started with our config, or the
    moto server on our port."""
    if server is None:
        return []
    port = server.endpoint.rsplit(":", 1)[1]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fp:
                argv = fp.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        line = " ".join(argv)
        if (server.kind == "ceph" and str(work / "ceph") in line
                and any(d in line for d in ("radosgw", "ceph-osd", "ceph-mon"))) or (
                server.kind == "moto" and "moto.server" in line and port in argv):
            found.append(int(entry))
    return found


def training_loop(sd: dict[str, torch.Tensor], directory: Path, args: argparse.Namespace,
                  name: str, record, on_saved=None,
                  pids: dict[str, list[int]] | None = None) -> list[tuple[float, float]]:
    """``--saves`` checkpoints, a training step before each; records ``NAME_save_s``
    (torch.save), ``NAME_blocked_s`` (the whole save routine), ``NAME_cpu_busy``
    (share of all cores busy during the save), ``NAME_writer_cpu_s`` (CPU seconds
    of this process during the save) and ``NAME_GROUP_cpu_s`` for each group of
    processes in ``pids``; returns (save, blocked) times."""
    out = []
    pids = pids or {}

    def cpu_of(group: list[int]) -> float:
        total = 0.0
        for pid in group:
            with contextlib.suppress(OSError):
                total += daemon_cpu(pid)
        return total

    for index in range(args.saves):
        training_step(sd, index, args.step_seconds)
        busy0, total0 = cpu_busy()
        cpu0 = {group: cpu_of(members) for group, members in pids.items()}
        writer0 = time.process_time()
        t0 = time.perf_counter()
        saved, blocked = save_checkpoint(sd, directory, index, args.fsync, bool(args.marker))
        writer1 = time.process_time()
        busy1, total1 = cpu_busy()
        out.append((saved, blocked))
        record(f"{name}_save_s", saved)
        record(f"{name}_blocked_s", blocked)
        record(f"{name}_cpu_busy", (busy1 - busy0) / max(1, total1 - total0))
        record(f"{name}_writer_cpu_s", writer1 - writer0)
        for group, members in pids.items():
            record(f"{name}_{group}_cpu_s", cpu_of(members) - cpu0[group])
        if on_saved:
            on_saved(index, t0, saved, blocked)
        print(f"  save {index}: torch.save {saved:.2f} s, blocked {blocked:.2f} s",
              file=sys.stderr, flush=True)
    return out


def ensure_s3fs() -> str | None:
    """The s3fs binary, installed with apt-get if missing (printed); None if it
    cannot be had without removing packages."""
    found = shutil.which("s3fs")
    if found:
        return found
    print("s3fs not found: `apt-get install -y s3fs` (checked first with -s: it must "
          "remove nothing)", file=sys.stderr, flush=True)
    sim = subprocess.run(["apt-get", "install", "-s", "-y", "s3fs"], capture_output=True,
                         text=True)
    if sim.returncode != 0 or any(line.startswith("Remv") for line in sim.stdout.splitlines()):
        print(f"  apt-get would fail or remove packages; not installing:\n{sim.stdout[-2000:]}"
              f"{sim.stderr[-2000:]}", file=sys.stderr)
        return None
    result = subprocess.run(["apt-get", "install", "-y", "-q", "s3fs"], capture_output=True,
                            text=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if result.returncode != 0:
        print(f"  apt-get install s3fs failed:\n{result.stderr[-2000:]}", file=sys.stderr)
        return None
    print("  installed s3fs", file=sys.stderr)
    return shutil.which("s3fs")


class S3fsMount(FuseDaemon):
    """``s3fs BUCKET MNT -f`` (defaults otherwise: 10 MB parts, 5 in parallel)."""

    def __init__(self, binary: str, server: S3Server, bucket: str, mountpoint: Path,
                 work: Path) -> None:
        passwd = work / "s3fs.passwd"
        passwd.write_text(f"{server.env['AWS_ACCESS_KEY_ID']}:"
                          f"{server.env['AWS_SECRET_ACCESS_KEY']}\n")
        passwd.chmod(0o600)
        command = [binary, bucket, str(mountpoint), "-f", "-o",
                   f"url={server.endpoint},use_path_request_style,passwd_file={passwd}"]
        super().__init__(command, mountpoint, work / "s3fs.log", "s3fs")


def emulated_write_through_loop(sd: dict[str, torch.Tensor], server: S3Server,
                                bucket: str, prefix: str, scratch: Path,
                                args: argparse.Namespace) -> list[tuple[float, float]]:
    """What a write-through mount does in close(): the save lands in a local temp file,
    then is uploaded (s3fs's defaults: 10 MB parts, 5 in parallel) before it returns."""
    out = []
    for index in range(args.saves):
        training_step(sd, index, args.step_seconds)
        start = time.perf_counter()
        saved, _ = save_checkpoint(sd, scratch, index, args.fsync, False)
        boto3_multipart(server, bucket, f"{prefix}ckpt_{index}.pt",
                        scratch / f"ckpt_{index}.pt", 10 * MiB, 10 * MiB, 5)
        uploaded = time.perf_counter()
        if args.marker:
            server.client.put_object(Bucket=bucket, Key=prefix + MARKER,
                                     Body=f"ckpt_{index}.pt".encode())
        out.append((uploaded - start, time.perf_counter() - start))
        (scratch / f"ckpt_{index}.pt").unlink()
        print(f"  save {index} (emulated s3fs): {out[-1][1]:.2f} s", file=sys.stderr,
              flush=True)
    return out


def streamed_bytes(lake: Lake, key: str) -> int:
    """Bytes of parts the lake holds for unfinished multipart uploads of ``key``:
    what aifs streamed before the file was closed."""
    if lake.server:
        client = lake.server.client
        uploads = client.list_multipart_uploads(Bucket=lake.bucket,
                                                Prefix=lake.prefix + key).get("Uploads", [])
        return sum(part["Size"] for u in uploads if u["Key"] == lake.prefix + key
                   for part in client.list_parts(Bucket=lake.bucket, Key=u["Key"],
                                                 UploadId=u["UploadId"]).get("Parts", []))
    assert lake.root is not None
    total = 0
    staging = lake.root / LOCAL_STAGING
    for upload in staging.iterdir() if staging.is_dir() else []:
        with contextlib.suppress(OSError):
            if (upload / "key").read_text() == key:
                total += sum(p.stat().st_size for p in upload.glob("part-*"))
    return total


def mount_stats(mountpoint: Path) -> dict[str, int]:
    return json.loads(os.getxattr(mountpoint, "user.aifs.stats"))


# -- the benchmark -------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", choices=["local", "moto", "ceph"], default="local")
    parser.add_argument("--size", default="1G", help="state dict size")
    parser.add_argument("--tensors", type=int, default=8, help="tensors in the state dict")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per target and run")
    parser.add_argument("--step-seconds", type=float, default=5.0,
                        help="simulated training step before each save")
    parser.add_argument("--runs", type=int, default=1,
                        help="runs (each: every target's loop); medians over all saves")
    parser.add_argument("--fsync", action="store_true", help="fsync inside the timed save")
    parser.add_argument("--marker", default=MARKER, choices=[MARKER, ""],
                        help="write the `latest` commit marker after each save ('' to skip)")
    parser.add_argument("--no-s3fs", action="store_true", help="skip the s3fs target")
    parser.add_argument("--emulate-s3fs", action="store_true",
                        help="use the write-through emulation even if s3fs is there")
    parser.add_argument("--multipart-threshold", default="16M")
    parser.add_argument("--part-size", default="8M")
    parser.add_argument("--parts-in-flight", type=int, default=8)
    parser.add_argument("--promote-workers", type=int, default=4)
    parser.add_argument("--promote-delay", default="2", help="seconds (aifs default: 2)")
    parser.add_argument("--stream-checkpoints", choices=["true", "false"], default="true",
                        help="aifs option (default as shipped: true)")
    parser.add_argument("--mount-opt", action="append", default=[], metavar="ARG",
                        help="extra `aifs mount` argument (repeatable), e.g. "
                        "--mount-opt=--log-level=debug")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy the mount logs here")
    parser.add_argument("--poll-interval", type=float, default=0.02,
                        help="seconds between polls of the lake")
    parser.add_argument("--publish-timeout", type=float, default=1800)
    parser.add_argument("--json", help="write results here too")
    args = parser.parse_args()
    size = parse_size(args.size)
    threshold = parse_size(args.multipart_threshold)
    part = parse_size(args.part_size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    print(f"building the state dict: {args.tensors} tensors, {size / MiB:.0f} MiB",
          file=sys.stderr, flush=True)
    sd = make_state_dict(size, args.tensors)
    load_before = os.getloadavg()[0]   # others' work on the machine skews every figure
    work = Path(tempfile.mkdtemp(prefix="aifs-cbench-", dir="/var/tmp"))
    results: dict = {}
    stops: list = []
    mounts: list[Mount] = []
    s3fs_mounts: list[S3fsMount] = []
    failed = True
    try:
        # Each run leaves its objects until the next run starts: size the store for all.
        lake, server = bench_lake(args.lake, work, stops, args.runs * args.saves * 3 * size, "c")
        servers = server_pids(server, work)
        s3fs_kind = why_emulated = ""
        s3fs_binary = None
        if server and not args.no_s3fs:
            s3fs_binary = None if args.emulate_s3fs else ensure_s3fs()
            s3fs_kind = "s3fs" if s3fs_binary else "emulated"
            if not s3fs_binary:
                why_emulated = "--emulate-s3fs" if args.emulate_s3fs else "s3fs not installable"
        cache_size = (args.saves + 2) * size + 1024 * MiB
        mount_args = ["--cache-size", str(cache_size), "--log-level", "warning",
                      "--multipart-threshold", args.multipart_threshold,
                      "--part-size", args.part_size,
                      "--parts-in-flight", str(args.parts_in_flight),
                      "--promote-workers", str(args.promote_workers),
                      "--promote-delay", args.promote_delay,
                      "--stream-checkpoints", args.stream_checkpoints, *args.mount_opt]
        samples: dict[str, list[float]] = {}

        def record(name: str, value: float) -> None:
            samples.setdefault(name, []).append(value)

        ckpt_bytes = 0
        violations: list[str] = []
        for rep in range(args.runs):
            print(f"run {rep + 1}/{args.runs}", file=sys.stderr, flush=True)
            # 1. local file on the cache disk (the physical limit)
            local_dir = work / f"local-{rep}"
            local_dir.mkdir()
            print(" local", file=sys.stderr, flush=True)
            training_loop(sd, local_dir, args, "local", record, pids={"server": servers})
            newest = local_dir / f"ckpt_{args.saves - 1}.pt"
            ckpt_bytes = newest.stat().st_size

            # 2. the lake's PUT bandwidth: the same files, as aifs would upload them
            print(" lake PUT baseline", file=sys.stderr, flush=True)
            for index in range(args.saves):
                source = local_dir / f"ckpt_{index}.pt"
                os.sync()
                if server:
                    record("put_s", boto3_multipart(
                        server, lake.bucket, f"boto3-{rep}/ckpt_{index}.pt", source,
                        threshold, part, args.parts_in_flight))
                else:
                    assert lake.root is not None
                    (lake.root / f"copy-{rep}").mkdir(exist_ok=True)
                    start = time.perf_counter()
                    shutil.copyfile(source, lake.root / f"copy-{rep}" / source.name)
                    record("put_s", time.perf_counter() - start)
            delete_prefix(lake, f"boto3-{rep}/" if server else f"copy-{rep}")

            # 3. aifs, then 4. the restore of its newest checkpoint
            print(" aifs", file=sys.stderr, flush=True)
            mount = Mount(lake, work / "mnt", work / f"cache-{rep}",
                          work / "aifs.log", mount_args)
            mounts.append(mount)
            violations += aifs_run(sd, lake, mount, f"run-{rep}", newest, args, record,
                                   servers)
            mount.unmount()
            mounts.remove(mount)
            shutil.rmtree(work / f"cache-{rep}")
            delete_prefix(lake, (lake.prefix if server else "") + f"run-{rep}")

            # 5. a write-through mount of the same bucket
            if s3fs_kind == "s3fs":
                print(" s3fs", file=sys.stderr, flush=True)
                assert server is not None and s3fs_binary is not None
                try:
                    s3fs_mount = S3fsMount(s3fs_binary, server, lake.bucket, work / "s3fs-mnt",
                                           work)
                except (RuntimeError, AssertionError) as exc:
                    print(f"  s3fs cannot mount ({exc}); using the emulation",
                          file=sys.stderr)
                    s3fs_kind = "emulated"
                    why_emulated = "s3fs could not mount"
                else:
                    s3fs_mounts.append(s3fs_mount)
                    target = s3fs_mount.path / f"s3fs-{rep}"
                    target.mkdir()
                    training_loop(sd, target, args, "s3fs", record,
                                  pids={"daemon": [s3fs_mount.proc.pid], "server": servers})
                    s3fs_mount.stop()
                    s3fs_mounts.remove(s3fs_mount)
                    found = lake_size(
                        Lake(lake.kind, "", {}, [], server=server, bucket=lake.bucket),
                        f"s3fs-{rep}/{newest.name}")
                    if found != ckpt_bytes:
                        raise RuntimeError(f"s3fs left {found} bytes of {newest.name} in the "
                                           f"lake, expected {ckpt_bytes}")
            if s3fs_kind == "emulated":
                print(" write-through emulation (torch.save to a temp file + boto3 upload)",
                      file=sys.stderr, flush=True)
                assert server is not None
                scratch = work / f"scratch-{rep}"
                scratch.mkdir()
                for saved, blocked in emulated_write_through_loop(
                        sd, server, lake.bucket, f"s3fs-{rep}/", scratch, args):
                    record("s3fs_save_s", saved)
                    record("s3fs_blocked_s", blocked)
                shutil.rmtree(scratch)
            if server:
                delete_prefix(lake, f"s3fs-{rep}/")
            shutil.rmtree(local_dir)

        for name, values in samples.items():
            results[name] = statistics.median(values)
        results.update(size=size, checkpoint_bytes=ckpt_bytes, tensors=args.tensors,
                       saves=args.saves, runs=args.runs, step_seconds=args.step_seconds,
                       fsync=args.fsync, marker=args.marker,
                       write_through=s3fs_kind + (f" ({why_emulated})" if why_emulated else ""),
                       part_size=part, parts_in_flight=args.parts_in_flight,
                       promote_delay=float(args.promote_delay),
                       marker_order_violations=violations,
                       loadavg_1min=[load_before, os.getloadavg()[0]], samples=samples)
        failed = False
    finally:
        for mount in mounts:     # only after a failure: stop the daemon hard, no flush
            mount.kill()
        for s3fs_mount in s3fs_mounts:
            s3fs_mount.stop()
        for mount_dir in (work / "mnt", work / "s3fs-mnt"):
            if os.path.ismount(mount_dir):
                subprocess.run(["fusermount3", "-u", "-z", str(mount_dir)], check=False)
        if failed:
            for log in (work / "aifs.log", work / "s3fs.log"):
                if log.exists():
                    print(f"--- tail of {log.name} ---\n" + log.read_text(
                        errors="replace")[-4000:], file=sys.stderr)
        elif (work / "aifs.log").exists():
            warnings_seen = [line for line in (work / "aifs.log").read_text(
                errors="replace").splitlines() if "WARNING" in line or "ERROR" in line]
            results["aifs_log_warnings"] = len(warnings_seen)
            for line in warnings_seen[:10]:
                print(f"aifs log: {line}", file=sys.stderr)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            for log in (work / "aifs.log", work / "s3fs.log"):
                if log.exists():
                    shutil.copyfile(log, Path(args.keep_logs) / log.name)
        finish(work, stops, results, args.json)
    report(args, results)
    return 0


def aifs_run(sd: dict[str, torch.Tensor], lake: Lake, mount: Mount,
             run_dir: str, newest_local: Path, args: argparse.Namespace,
             record, servers: list[int]) -> list[str]:
    """The training loop into the mount, its publication watched in the lake, then
    the restore of the newest checkpoint against the local file; returns the
    marker-order violations seen."""
    (mount.path / run_dir).mkdir()
    # its directory marker object is promoted before the loop starts
    wait_for(lambda: lake_size(lake, run_dir + "/") is not None,
             60, "the run directory in the lake")
    watch = LakeWatch(lake, args.poll_interval)
    starts: dict[int, float] = {}
    streamed: list[int] = []

    def on_saved(index: int, t0: float, saved: float, blocked: float) -> None:
        starts[index] = t0
        path = mount.path / run_dir / f"ckpt_{index}.pt"
        streamed.append(streamed_bytes(lake, f"{run_dir}/ckpt_{index}.pt"))
        watch.expect(index, f"{run_dir}/ckpt_{index}.pt", path.stat().st_size, t0,
                     f"{run_dir}/{MARKER}" if args.marker else "")
        policy = os.getxattr(path, "user.aifs.policy").decode()
        if policy != "checkpoint":
            raise RuntimeError(f"{path}: policy {policy!r}, expected checkpoint")

    try:
        saves = training_loop(sd, mount.path / run_dir, args, "aifs", record, on_saved,
                              pids={"daemon": [mount.proc.pid], "server": servers})
        watch.wait(args.publish_timeout)
    finally:
        watch.stop()
    for index, (saved, _blocked) in enumerate(saves):
        key = f"{run_dir}/ckpt_{index}.pt"
        record("aifs_publish_s", watch.seen[key] - starts[index])
        record("aifs_close_to_publish_s", watch.seen[key] - starts[index] - saved)
        if args.marker:
            record("aifs_marker_s", watch.marker_seen[index] - starts[index])
        record("aifs_streamed_at_close_bytes", streamed[index])
    loop_s = args.saves * args.step_seconds + sum(b for _, b in saves)
    record("watch_cpu_fraction", watch.cpu_s / loop_s)
    record("watch_requests_per_s", watch.requests / loop_s)

    print(" restore", file=sys.stderr, flush=True)
    before = mount_stats(mount.path)
    record("local_restore_s", timed_restore(newest_local, sd))
    record("aifs_restore_s", timed_restore(mount.path / run_dir / newest_local.name, sd))
    after = mount_stats(mount.path)
    record("aifs_restore_lake_gets", after["lake_gets"] - before["lake_gets"])
    key = f"{run_dir}/{newest_local.name}"
    if lake_digest(lake, key) != file_digest(newest_local):
        raise RuntimeError(f"lake object {key}: other bytes than the local save")
    return watch.violations


def cpu_line(r: dict, name: str) -> str:
    parts = [f"{name}: cores {100 * r[f'{name}_cpu_busy']:.0f}% busy over "
             f"{r[f'{name}_blocked_s']:.1f} s x {os.cpu_count()} cores",
             f"torch.save process {r[f'{name}_writer_cpu_s']:.1f}"]
    for group, label in (("daemon", "mount daemon"), ("server", "S3 server")):
        if f"{name}_{group}_cpu_s" in r:
            parts.append(f"{label} {r[f'{name}_{group}_cpu_s']:.1f}")
    return ", ".join(parts)


def report(args: argparse.Namespace, r: dict) -> None:
    mb = r["checkpoint_bytes"] / 1e6
    s3 = args.lake != "local"
    n = r["runs"] * r["saves"]

    def row(what: str, key: str, ratio: str = "", rate: bool = True) -> None:
        speed = f"{mb / r[key]:,.0f} MB/s" if rate else ""
        print(f"| {what} | {r[key]:.2f} s | {speed} | {ratio} |")

    put = (f"boto3 multipart upload of the same file ({args.part_size} parts x "
           f"{args.parts_in_flight} threads)" if s3 else
           "shutil.copyfile of the same file into the lake directory")
    sync = " + fsync" if r["fsync"] else ""
    marker = " + `latest` marker" if r["marker"] else ""
    print(f"\n## checkpoint benchmark: lake={args.lake} state dict {args.size} "
          f"({r['tensors']} tensors, file {r['checkpoint_bytes'] / MiB:.0f} MiB), "
          f"{r['saves']} saves x {r['runs']} run(s), {r['step_seconds']:g} s steps, "
          f"part-size={args.part_size} parts-in-flight={args.parts_in_flight} "
          f"promote-delay={args.promote_delay} stream-checkpoints={args.stream_checkpoints}; "
          f"medians of {n} saves\n")
    print("| measurement | time | throughput | ratio (target) |")
    print("|---|---|---|---|")
    row(f"local file: blocked in save (torch.save{sync}{marker})", "local_blocked_s", "1.00")
    row(f"aifs: blocked in save (torch.save{sync}{marker})", "aifs_blocked_s",
        f"**{r['aifs_blocked_s'] / r['local_blocked_s']:.2f} x local** (<= 1.2)")
    if "s3fs_blocked_s" in r:
        label = ("s3fs write-through mount" if r["write_through"] == "s3fs" else
                 "write-through EMULATION (torch.save to a temp file + boto3 upload "
                 f"10 MB x 5, s3fs's defaults) {r['write_through'].removeprefix('emulated ')}")
        row(f"{label}: blocked in save", "s3fs_blocked_s",
            f"**aifs {r['s3fs_blocked_s'] / r['aifs_blocked_s']:.1f} x shorter** (>= 10)")
    row(put, "put_s", "1.00")
    row("aifs: save start until the checkpoint is in the lake", "aifs_publish_s",
        f"**{r['aifs_publish_s'] / r['put_s']:.2f} x bytes / PUT bandwidth** (<= 1.3)")
    row("aifs: save return until the checkpoint is in the lake", "aifs_close_to_publish_s",
        rate=False)
    if "aifs_marker_s" in r:
        row("aifs: save start until `latest` in the lake names it", "aifs_marker_s",
            f"{r['aifs_marker_s'] / r['put_s']:.2f} x PUT time", rate=False)
    row("local file: torch.load of the newest, page cache dropped", "local_restore_s", "1.00")
    row("aifs: torch.load of the newest (NVMe tier), page cache dropped", "aifs_restore_s",
        f"**{r['local_restore_s'] / r['aifs_restore_s']:.2f} x local speed** (>= 0.7)")
    print(f"\nWhen aifs's save returned, the lake already held "
          f"{r['aifs_streamed_at_close_bytes'] / MiB:.0f} MiB of the checkpoint in parts "
          "(median); "
          f"lake GETs during the aifs restore: {r['aifs_restore_lake_gets']:.0f}; "
          f"marker-before-checkpoint violations: {len(r['marker_order_violations'])}; "
          f"lake polling: {r['watch_requests_per_s']:.0f} requests/s, "
          f"{100 * r['watch_cpu_fraction']:.0f}% of a core; "
          f"aifs log warnings: {r.get('aifs_log_warnings', 0)}; 1-min load average "
          f"{r['loadavg_1min'][0]:.1f} at the start, {r['loadavg_1min'][1]:.1f} at the end.\n")
    print("CPU during the save (seconds; all cores busy share): "
          + "; ".join(cpu_line(r, name) for name in ("local", "aifs", "s3fs")
                      if f"{name}_cpu_busy" in r) + ".\n")
    for violation in r["marker_order_violations"]:
        print(f"MARKER ORDER VIOLATION: {violation}")


if __name__ == "__main__":
    sys.exit(main())
