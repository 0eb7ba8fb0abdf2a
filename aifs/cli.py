"""The ``aifs`` command."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from aifs import __version__, xattrs
from aifs.errors import AifsError, ConfigError
from aifs.mount_options import mount_arguments

if TYPE_CHECKING:
    from tqdm import tqdm


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aifs", description="FUSE filesystem with AI-aware caching for data lakes")
    parser.add_argument("--version", action="version", version=f"aifs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    mount_arguments(sub.add_parser("mount", help="mount a lake",
                                    usage="aifs mount [LAKE_URL] MOUNTPOINT [options]"))
    _other_commands(sub)
    return parser


def _other_commands(sub: Any) -> None:
    umount = sub.add_parser("umount", help="promote pending changes, unmount and wait for "
                            "the daemon to exit")
    umount.add_argument("mountpoint")
    umount.add_argument("-l", "--lazy", action="store_true",
                        help="detach now though files are open (umount -l); the daemon "
                        "serves them until their last close, promotes all and exits")
    umount.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the daemon to exit after unmounting")
    umount.add_argument("--no-flush", action="store_true",
                        help="do not wait for promotion: pending changes stay in the cache "
                        "directory and the next mount promotes them")

    sync = sub.add_parser("sync", help="wait until every change under PATH is in the lake")
    sync.add_argument("path", nargs="?", default=".")
    sync.add_argument("--quiet", "-q", action="store_true", help="no progress output")

    status = sub.add_parser("status", help="what a mount is doing, and where PATHs stand "
                            "(local, promoting, in the lake)")
    status.add_argument("paths", nargs="*", default=["."], metavar="PATH")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    warmup = sub.add_parser("warmup", help="fetch files or trees into the local cache "
                            "(a second run resumes where one stopped)")
    warmup.add_argument("paths", nargs="+", metavar="PATH")
    warmup.add_argument("--jobs", "-j", type=int, default=16,
                        help="PATHs warmed at once (a tree's files: 32 at once)")
    warmup.add_argument("--quiet", "-q", action="store_true", help="no progress output")

    pin = sub.add_parser("pin", help="keep files or trees in the local cache (node-local); "
                         "fetches them unless --no-warmup")
    pin.add_argument("paths", nargs="+", metavar="PATH")
    pin.add_argument("--no-warmup", action="store_true")
    pin.add_argument("--jobs", "-j", type=int, default=16)
    pin.add_argument("--quiet", "-q", action="store_true")

    unpin = sub.add_parser("unpin", help="let pinned files be evicted again")
    unpin.add_argument("paths", nargs="+", metavar="PATH")

    pack = sub.add_parser("pack", help="pack the small plain objects of a lake directory "
                          "(written by other tools) into pack objects for fast reads; the "
                          "objects stay as they are")
    pack.add_argument("path", metavar="PATH")
    pack.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    gc = sub.add_parser("gc", help="compact sparse packs, delete packs nothing refers to "
                        "(after pack_gc_grace) and fold the journals into one")
    gc.add_argument("path", nargs="?", default=".", metavar="PATH")

    from aifs import bench
    bench.add_arguments(sub.add_parser("bench", help="the standard workloads on temporary "
                                       "mounts beside the local disk: one ratio table (root)"))


def _mount(args: argparse.Namespace) -> int:
    from aifs.config import REMOVED, default_lake_url, load_config
    from aifs.daemon import PRIVATE_UMASK, check_mountpoint, serve, setup_logging, wants_nonempty

    # Everything the mount creates (the local lake's objects and directories,
    # the cache, its LMDB store, the log) is the daemon user's alone, whatever
    # the caller's umask: no byte is readable outside the mount past its mode.
    os.umask(PRIVATE_UMASK)

    for name, why in REMOVED.items():
        if getattr(args, "removed_" + name, None) is not None:
            print(f"aifs: --{name.replace('_', '-')} was removed ({why}); ignored",
                  file=sys.stderr)
    if len(args.targets) > 2:
        raise ConfigError("expected [LAKE_URL] MOUNTPOINT")
    lake = args.targets[0] if len(args.targets) == 2 else None
    mountpoint = args.targets[-1] if args.targets else None
    overrides = {name: getattr(args, name) for name in (
        "cache_dir", "cache_size", "block_size", "memory_cache", "readahead_max",
        "kernel_readahead",
        "metadata_ttl", "endpoint_url", "region", "profile", "path_style", "sign_payload",
        "max_connections", "request_timeout", "retries", "promote_delay",
        "promote_workers", "multipart_threshold", "part_size", "parts_in_flight",
        "promote_busy_rate", "fsync",
        "direct_writes",
        "pack_threshold", "pack_size", "pack_wait", "pack_compact_below", "pack_gc_grace",
        "fold_shard_records", "stale_upload_age",
        "object_attrs", "dir_prefetch", "list_ahead", "fuse_binding", "passthrough",
        "fuse_poll_us",
        "policy_rules", "staging_hold",
        "checkpoint_keep",
        "stream_checkpoints", "stream_large_files", "stream_parts_in_flight",
        "recovered_max", "metrics_port", "metrics_address",
        "unmount_timeout", "allow_other", "log_level", "log_file", "log_format",
        "foreground", "fuse_options")}
    overrides["lake"] = lake
    overrides["mountpoint"] = os.path.abspath(mountpoint) if mountpoint else None
    config = load_config(args.config, overrides)
    if not config.mountpoint:
        raise ConfigError("no mountpoint: give one, or set mountpoint in the config file")
    config.mountpoint = os.path.abspath(config.mountpoint)
    if not config.lake and not lake:
        # The embedded default works with no configuration: create it.
        os.makedirs(default_lake_url()[len("file://"):], exist_ok=True)
    check_mountpoint(config.mountpoint, clear_dead=args.clear_dead_mount,
                     nonempty=wants_nonempty(config))

    if config.foreground:
        setup_logging(config.log_level, config.log_file or None, config.log_format)
        return serve(config)

    cache_dir = config.resolved_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_file = config.log_file or str(cache_dir / "aifs.log")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(read_end)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        status = 1
        try:
            setup_logging(config.log_level, log_file, config.log_format)
            status = serve(config, ready_fd=write_end)
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read().decode(errors="replace").strip()
    if answer == "OK":
        return 0
    if answer.startswith("ERR "):
        raise AifsError(answer[4:])
    os.waitpid(pid, 0)
    raise AifsError(f"the mount daemon exited before serving; see {log_file}")


def _mount_root(path: str) -> str:
    """The root of the aifs mount holding ``path``."""
    root = os.path.abspath(path)
    if not os.path.exists(root):
        raise AifsError(f"{path}: no such file or directory")
    while not os.path.ismount(root):
        root = os.path.dirname(root)
    try:
        os.getxattr(root, xattrs.PID)
    except OSError:
        raise AifsError(f"{path} is not in an aifs mount") from None
    return root


def _progress(desc: str, quiet: bool, **options: Any) -> tqdm:
    """A progress bar on stderr (none if ``quiet``), gone once closed: the
    command's result line follows it."""
    from tqdm import tqdm

    return tqdm(desc=desc, file=sys.stderr, disable=quiet, leave=False, dynamic_ncols=True,
                **options)


def _sync(path: str, quiet: bool = False) -> None:
    """Block until everything under ``path`` is in the lake, showing progress."""
    import json
    import threading

    root = _mount_root(path)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            os.getxattr(path, xattrs.SYNC)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    next_show = time.monotonic() + 1.0
    # Shown after a second (a quick sync shows nothing): files done of those
    # pending since the first look (more may come), what is left to send.
    with _progress("aifs sync", quiet, unit=" files", delay=1.0) as bar:
        while worker.is_alive():
            worker.join(0.2)
            if quiet or not worker.is_alive() or time.monotonic() < next_show:
                continue
            try:
                pending = json.loads(os.getxattr(root, xattrs.PENDING))
            except (OSError, ValueError):
                continue
            left = pending.get("files", 0)
            bar.total = max(bar.total or 0, bar.n + left)
            bar.set_postfix_str(f"{pending.get('bytes', 0) / 2**20:.1f} MiB, "
                                f"{pending.get('deletes', 0)} deletes to go", refresh=False)
            bar.update(bar.total - left - bar.n)  # shows it (even with nothing done)
            next_show = time.monotonic() + 1.0
    error = outcome[0] if outcome else None
    if error is not None:
        reason = error.strerror if isinstance(error, OSError) else str(error)
        try:  # the mount says why
            reason = json.loads(os.getxattr(root, xattrs.PENDING)).get("error") or reason
        except (OSError, ValueError):
            pass
        raise AifsError(f"sync of {path} failed: {reason}; the changes stay in the local "
                        "cache (see the mount's log)")


def _umount(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    pid = None
    try:
        pid = int(os.getxattr(mountpoint, xattrs.PID))
    except (OSError, ValueError):
        pass
    if pid is not None:
        if args.no_flush:
            os.setxattr(mountpoint, xattrs.UNMOUNT_FLUSH, b"0")
        else:
            _sync(mountpoint)
    # As root, umount(8) without helpers (-i: it may be the helper calling us)
    # also drops the mount's line from /run/mount/utab; fusermount3 would not.
    command = (["umount", "-i", mountpoint] if os.geteuid() == 0 and shutil.which("umount")
               else ["fusermount3", "-u", mountpoint])
    if args.lazy:
        command.insert(-1, "-l" if command[0] == "umount" else "-z")
    result = subprocess.run(command, capture_output=True,
                            text=True)
    if result.returncode != 0:
        message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        raise AifsError(f"cannot unmount {mountpoint}: {message or 'umount failed'}")
    if pid is not None and not args.lazy:  # (lazily: it exits after the last close)
        deadline = time.monotonic() + args.timeout
        while process_alive(pid):
            if time.monotonic() > deadline:
                raise AifsError(f"unmounted, but daemon {pid} is still running after "
                                f"{args.timeout:.0f}s")
            time.sleep(0.05)
    return 0


def _status(args: argparse.Namespace) -> int:
    """Live figures of the mount holding the first PATH, and each PATH's state."""
    import json

    root = _mount_root(args.paths[0])
    try:
        metrics = json.loads(os.getxattr(root, xattrs.METRICS))
    except (OSError, ValueError) as exc:
        raise AifsError(f"cannot read the status of {root}: {exc}") from None
    paths = {}
    for path in args.paths:
        try:
            paths[path] = {"state": os.getxattr(path, xattrs.STATE).decode(),
                           "policy": os.getxattr(path, xattrs.POLICY).decode()}
        except OSError as exc:
            raise AifsError(f"{path}: {exc.strerror}") from None
    if args.json:
        print(json.dumps({"mountpoint": root, "metrics": metrics, "paths": paths}, indent=2))
        return 0
    for line in status_lines(root, metrics):
        print(line)
    for path, facts in paths.items():
        print(f"{facts['state']:<10} {path} ({facts['policy']})")
    return 0


def _retries(causes: dict[str, int]) -> str:
    total = sum(causes.values())
    named = ", ".join(f"{n} {cause}" for cause, n in causes.items() if n)
    return f"{total} retries ({named})" if named else f"{total} retries"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


#: short names of the S3 operations in the status output
_OPS = {"GetObject": "GET", "PutObject": "PUT", "HeadObject": "HEAD", "ListObjectsV2": "LIST",
        "UploadPart": "part", "CreateMultipartUpload": "create", "CompleteMultipartUpload":
        "complete", "AbortMultipartUpload": "abort", "DeleteObjects": "DELETE",
        "CopyObject": "COPY", "ListMultipartUploads": "uploads"}


def status_lines(root: str, m: dict) -> list[str]:
    """The human form of a mount's metrics snapshot."""
    cache, promo, lake, rate = m["cache"], m["promotion"], m["lake"], m["throughput"]
    tiers = cache["bytes"]
    used = tiers["blocks"] + tiers["files"]
    requests = ", ".join(f"{_OPS.get(op, op)} {n}" for op, n in lake["requests"].items() if n)
    policies = ", ".join(f"{p} {_size(n)}" for p, n in cache["by_policy"].items()) or "-"
    lines = [
        f"mount      {root} <- {m['lake_url']} (pid {m['pid']}, up {_duration(m['uptime_s'])})",
        f"cache      {_size(used)} of {_size(cache['capacity_bytes'])} on disk "
        f"(blocks {_size(tiers['blocks'])}, files {_size(tiers['files'])}, "
        f"{_size(cache['dirty_bytes'])} of them not in the lake); "
        f"memory {_size(tiers['memory'])}",
        f"policies   {policies}; pinned {_size(cache['by_class']['pinned'])}, "
        f"dataset subset {_size(cache['by_class']['dataset'])}",
        f"reads      hit ratio {cache['hit_ratio']:.2f} (memory {cache['hits']['memory']}, "
        f"disk {cache['hits']['disk']}, local files {cache['hits']['local']}; "
        f"{cache['misses']} misses); {cache['evictions']} evictions, "
        f"{cache['refused']} blocks not admitted",
        f"promotion  {promo['pending_files']} files ({_size(promo['pending_bytes'])}) and "
        f"{promo['pending_deletes']} deletes pending, oldest "
        f"{_duration(promo['oldest_age_s'])}; {promo['uploading']} uploading; "
        f"{promo['uploads']} uploaded ({_size(promo['upload_bytes'])}), "
        f"{promo['failures']} failures",
        f"lake       {requests or 'no requests'}; {sum(lake['errors'].values())} errors, "
        f"{_retries(lake['retries'])}; {_size(lake['read_bytes'])} in, "
        f"{_size(lake['written_bytes'])} out",
        f"throughput reads {_size(rate['read_bytes_per_s'])}/s, writes "
        f"{_size(rate['write_bytes_per_s'])}/s; lake in "
        f"{_size(rate['lake_read_bytes_per_s'])}/s, out "
        f"{_size(rate['lake_written_bytes_per_s'])}/s (last 10s)",
    ]
    recovered = m.get("recovered", {})
    if recovered.get("files"):
        lines.append(f"recovered  {recovered['files']} files written but never closed when "
                     f"a crash came (not published) are in {recovered['directory']}")
    return lines


def _warmup(paths: list[str], jobs: int, quiet: bool) -> int:
    """Fetch files, or whole trees, into the cache disk, with progress. A tree
    is one request: the daemon walks it from the listings (no lookup, nor HEAD,
    per file) and fetches 32 of its files at once; ``jobs`` PATHs go at once."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    roots = {path: _mount_root(path) for path in paths}
    totals = {"files": 0, "fetched": 0, "cached": 0, "refused": 0, "errors": 0}
    errors: list[str] = []

    def lake_bytes(root: str) -> int:
        try:
            metrics = json.loads(os.getxattr(root, xattrs.METRICS))
            return int(metrics["lake"]["read_bytes"])
        except (OSError, ValueError, KeyError):
            return 0

    def one(path: str) -> None:
        try:
            result = json.loads(os.getxattr(path, xattrs.WARMUP))
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
            return
        for name in totals:
            totals[name] += result.get(name, 0)

    started = time.monotonic()
    before = {root: lake_bytes(root) for root in set(roots.values())}
    with (ThreadPoolExecutor(max(1, jobs)) as pool,
          _progress("aifs warmup", quiet, unit="B", unit_scale=True) as bar):
        futures = [pool.submit(one, path) for path in paths]
        while not all(f.done() for f in futures):
            time.sleep(0.2)
            if quiet:
                continue
            got = sum(lake_bytes(root) - n for root, n in before.items())  # bytes fetched
            bar.update(max(0, got - bar.n))
    elapsed = time.monotonic() - started
    if not quiet:
        print(f"aifs warmup: {totals['files']} files in {elapsed:.1f}s: "
              f"{_size(totals['fetched'])} fetched from the lake "
              f"({_size(totals['fetched'] / max(elapsed, 1e-6))}/s), "
              f"{_size(totals['cached'])} cached now", file=sys.stderr)
    if totals["refused"]:
        print(f"aifs warmup: the cache did not take {totals['refused']} blocks: it is full "
              "(or the dataset share is); raise cache_size or warm less", file=sys.stderr)
    for line in errors[:10]:
        print(f"aifs warmup: {line}", file=sys.stderr)
    if errors or totals["errors"]:
        raise AifsError(f"{len(errors) + totals['errors']} files could not be fetched "
                        "(see the mount's log)")
    return 0


def _pack(path: str, quiet: bool) -> int:
    """``aifs pack``: one request does the work; a progress bar polls the mount."""
    import json
    import threading

    root = _mount_root(path)
    if not os.path.isdir(path):
        raise AifsError(f"{path}: not a directory")
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["result"] = json.loads(os.getxattr(path, xattrs.PACK))
        except OSError as exc:
            outcome["error"] = exc.strerror

    started = time.monotonic()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    with _progress("aifs pack", quiet, unit=" files") as bar:
        while worker.is_alive():
            worker.join(0.2)
            if quiet:
                continue
            try:
                now = json.loads(os.getxattr(root, xattrs.PACK_PROGRESS))
            except (OSError, ValueError):
                continue
            bar.total = now.get("files_total", 0)
            bar.set_postfix_str(_size(now.get("bytes_packed", 0)), refresh=False)
            bar.update(now.get("files_packed", 0) - bar.n)
    if "error" in outcome:
        raise AifsError(f"{path}: {outcome['error']} (see the mount's log)")
    result = outcome["result"]
    assert isinstance(result, dict)
    print(f"aifs pack: {result['files_packed']} files ({_size(result['bytes_packed'])}) "
          f"packed in {time.monotonic() - started:.1f}s; the objects stay as they are")
    return 0


def _gc(path: str) -> int:
    import json

    root = _mount_root(path)
    try:
        result = json.loads(os.getxattr(root, xattrs.GC))
    except OSError as exc:
        raise AifsError(f"{path}: {exc.strerror} (see the mount's log)") from None
    print(f"aifs gc: {result['packs_compacted']} packs compacted "
          f"({result['entries_moved']} files moved), {result['packs_deleted']} packs "
          f"deleted, {_size(result['bytes_reclaimed'])} reclaimed, "
          f"{result['journals_folded']} journals folded into one, "
          f"{result['uploads_aborted']} stale multipart uploads aborted")
    if result["corrupt"]:
        print(f"aifs gc: {len(result['corrupt'])} damaged files left in place (see the "
              "mount's log)", file=sys.stderr)
        return 1
    return 0


def _pin(paths: list[str], on: bool) -> None:
    for path in paths:
        _mount_root(path)
        try:
            os.setxattr(path, xattrs.PINNED, b"1" if on else b"0")
        except OSError as exc:
            raise AifsError(f"{path}: {exc.strerror}") from None


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie awaiting its reaper counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mount":
            return _mount(args)
        if args.command == "umount":
            return _umount(args)
        if args.command == "sync":
            _sync(args.path, args.quiet)
            return 0
        if args.command == "status":
            return _status(args)
        if args.command == "warmup":
            return _warmup(args.paths, args.jobs, args.quiet)
        if args.command == "pin":
            _pin(args.paths, True)
            return 0 if args.no_warmup else _warmup(args.paths, args.jobs, args.quiet)
        if args.command == "unpin":
            _pin(args.paths, False)
            return 0
        if args.command == "pack":
            return _pack(args.path, args.quiet)
        if args.command == "gc":
            return _gc(args.path)
        if args.command == "bench":
            from aifs import bench
            return bench.from_args(args)
    except AifsError as exc:
        print(f"aifs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `aifs status | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 2


if __name__ == "__main__":
    sys.exit(main())
