"""Builds and wires a mount: store, metadata, cache, core, FUSE; signals,
readiness (sd_notify and the parent's pipe), clean shutdown."""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from aifs import buffers
from aifs.cache.blocks import BlockCache
from aifs.cache.files import LocalFiles
from aifs.config import Config
from aifs.errors import AifsError, ConfigError
from aifs.lake.base import ObjectStore

if TYPE_CHECKING:
    from aifs.core import Filesystem
    from aifs.fuse.binding import Binding

log = logging.getLogger(__name__)

#: the mount's umask: what it creates is 0700 (directories) or 0600 (files)
PRIVATE_UMASK = 0o077


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (``log_format = "json"``)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {"time": f"{stamp}.{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, log_file: str | None, log_format: str = "text") -> None:
    """Log to ``log_file``, else to stderr (journald under systemd)."""
    handler: logging.Handler
    if log_file:
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif not log_file and os.environ.get("JOURNAL_STREAM"):
        # journald stamps each line itself; the level becomes a syslog prefix
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def enable_stack_dumps() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack to the log (or
    stderr): the one way to see where a daemon that stopped answering hangs,
    since its own threads may be the ones stuck."""
    out = next((h.stream for h in logging.getLogger().handlers
                if isinstance(h, logging.FileHandler)), sys.stderr)
    try:
        # (a FileHandler opened with delay has no stream yet: None, for which
        # faulthandler takes sys.stderr itself)
        faulthandler.register(signal.SIGUSR1, file=out or sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError) as exc:  # no fileno: no dumps
        log.debug("no stack dumps on SIGUSR1: %s", exc)


class JournalFormatter(logging.Formatter):
    """``<N>`` syslog priority prefixes, which journald turns into levels."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self.PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


def sd_notify(message: str) -> None:
    """Tell systemd (or whoever set NOTIFY_SOCKET) about our state."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)  # never stall the event loop on a reader that lags
        try:
            sock.connect(address)
            sock.send(message.encode())
        except BlockingIOError:
            log.debug("sd_notify: the reader's queue is full; dropped %r", message)
        except OSError as exc:
            log.warning("sd_notify failed: %s", exc)


NONEMPTY = "nonempty"


def mount_type(mountpoint: str) -> str | None:
    """The filesystem type mounted on ``mountpoint`` (from /proc/self/mountinfo)."""
    target = os.path.abspath(mountpoint)
    found = None
    try:
        with open("/proc/self/mountinfo") as fp:
            for line in fp:
                fields = line.split()
                if len(fields) < 10 or "-" not in fields:
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if point == target:
                    found = fields[fields.index("-") + 1]  # the last one mounted wins
    except OSError:
        return None
    return found


def clear_dead_mount(mountpoint: str) -> None:
    """Detach an aifs mount whose daemon is gone, so a restart can mount again."""
    kind = mount_type(mountpoint)
    if kind != "fuse.aifs":
        raise ConfigError(f"{mountpoint} is a dead {kind or 'FUSE'} mount, not aifs's: "
                          "unmount it first")
    result = subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise ConfigError(f"cannot clear the dead mount on {mountpoint}: "
                          f"{result.stderr.strip() or 'fusermount3 failed'}")
    log.warning("cleared a dead aifs mount on %s (its daemon had exited)", mountpoint)


def check_mountpoint(mountpoint: str, clear_dead: bool = False,
                     nonempty: bool = False) -> None:
    """Catch the usual mistakes before doing any work; with ``clear_dead`` a
    dead aifs mount (its daemon killed) is detached instead of refused. A
    directory with files in it is refused unless ``nonempty`` (-o nonempty):
    the mount would hide them, which is seldom what anyone meant."""
    dead = (f"{mountpoint} is a dead mount (its daemon is gone): run 'aifs umount "
            f"{mountpoint}' first")
    try:
        st = os.stat(mountpoint)
    except FileNotFoundError:
        raise ConfigError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise ConfigError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        if not clear_dead:
            raise ConfigError(dead) from None
        clear_dead_mount(mountpoint)
        return check_mountpoint(mountpoint, nonempty=nonempty)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        try:
            os.listdir(mountpoint)  # stat may come from the kernel's cache; readdir won't
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                if not clear_dead:
                    raise ConfigError(dead) from None
                clear_dead_mount(mountpoint)
                return check_mountpoint(mountpoint, nonempty=nonempty)
        raise ConfigError(f"mountpoint {mountpoint} is busy: something is mounted there")
    if not nonempty:
        try:
            with os.scandir(mountpoint) as entries:
                occupied = next(entries, None) is not None
        except OSError as exc:
            raise ConfigError(f"mountpoint {mountpoint}: {exc.strerror}") from None
        if occupied:
            raise ConfigError(f"mountpoint {mountpoint} is not empty: the mount would hide "
                              "its files (empty it, or mount with -o nonempty)")
    if not os.path.exists("/dev/fuse"):
        raise ConfigError("/dev/fuse is missing: load the fuse module (modprobe fuse) "
                          "or give the container the device")


class CacheLock:
    """One mount per cache directory: two would corrupt each other's state."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ConfigError(f"cache directory {directory} is in use by another "
                              "aifs mount") from None


def mount_options(config: Config) -> set[str]:
    options = {"default_permissions"}  # the kernel checks permissions (pyfuse3's default)
    fsname = config.resolved_lake().replace(",", "_")
    options |= {f"fsname={fsname}", "subtype=aifs", "noatime"}
    if config.allow_other:
        options.add("allow_other")
    for opt in config.fuse_options:
        for part in opt.split(","):
            if part.strip() and part.strip() != NONEMPTY:  # ours: libfuse 3 has none
                options.add(part.strip())
    return options


def wants_nonempty(config: Config) -> bool:
    """Whether -o nonempty allows a mountpoint that has files in it."""
    return any(part.strip() == NONEMPTY for opt in config.fuse_options
               for part in opt.split(","))


#: mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory() -> None:
    """Have malloc keep freed memory for the next blocks: by default glibc
    maps an 8 MiB block's body afresh (or hands memory freed at the top of
    the heap back), and the kernel faults in and zeroes new pages as a body
    is received into them: on a machine whose free memory goes back to its
    hypervisor that cost 0.1-0.2 CPU-s per GiB read cold (1.50 -> 1.34 in
    ``aifs bench --lake``). Up to TRIM_THRESHOLD freed bytes may
    stay with the process per malloc arena."""
    try:
        libc = ctypes.CDLL(None)  # (the process's own symbols: libc's among them)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    except (OSError, AttributeError):  # not glibc: its defaults
        pass


def serve(config: Config, ready_fd: int | None = None) -> int:
    """Mount and serve until unmounted or signalled; return an exit status.

    Problems found before the mount serves are reported as one line, on
    ``ready_fd`` (to the parent of a daemonized mount) or raised.
    """
    def report(message: str) -> None:
        if ready_fd is not None:
            os.write(ready_fd, message.encode() + b"\n")
            os.close(ready_fd)

    # The trio thread answers FUSE requests while lake threads stream bodies;
    # a short GIL switch interval keeps request latency low under that load.
    sys.setswitchinterval(0.0005)
    keep_freed_memory()
    buffers.limit(config.memory_cache)  # receive buffers: what the memory cache holds
    enable_stack_dumps()
    try:
        cache_dir = config.resolved_cache_dir()
        lock = CacheLock(cache_dir)
        from aifs.lake import local_directory, open_store
        warn_if_open(cache_dir, "cache directory")
        if (lake_dir := local_directory(config)) is not None:
            warn_if_open(Path(lake_dir), "lake directory")
        store = open_store(config)
        return trio.run(_serve, config, store, cache_dir, report, lock)
    except AifsError as exc:
        if ready_fd is None:
            raise
        log.error("%s", exc)
        report(f"ERR {exc}")
        return 1


def warn_if_open(directory: Path, what: str) -> None:
    """One line where a directory aifs keeps file data or names in (created
    before, by someone else) lets other users in."""
    try:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
    except OSError:
        return
    if mode & 0o077:
        log.warning("%s %s is open to other users (mode %04o): they can read there what "
                    "the mount's permissions keep from them; chmod 700 it", what, directory,
                    mode)


async def _serve(config: Config, store: ObjectStore, cache_dir: Path,
                 report: Callable[[str], None], lock: CacheLock) -> int:
    from aifs.core import Filesystem
    from aifs.fuse.binding import mount_binding
    from aifs.meta.store import MetaStore
    await store.check()
    meta = MetaStore(cache_dir / "meta")
    cache = await trio.to_thread.run_sync(BlockCache, cache_dir, config.cache_size)
    local = await trio.to_thread.run_sync(LocalFiles, cache_dir)
    fs = Filesystem(config, store, meta, cache, local)
    fs.recover()
    mountpoint = os.path.abspath(config.mountpoint)
    binding: Binding | None = None
    failed: AifsError | None = None

    def unmount() -> None:
        nonlocal binding
        if binding is not None:
            sd_notify("STOPPING=1")
            binding.unmount()
            binding = None
            log.info("unmounted %s", mountpoint)

    try:
        async with trio.open_nursery() as nursery:
            # The lake's journals are read while the mount is made: a fresh
            # node's first listing finds the pack index replayed.
            nursery.start_soon(fs.packer.journals.read_ahead)
            mounted = False

            def stop() -> None:
                if binding is not None:
                    binding.terminate()
                elif not mounted:  # a signal before the mount was made: do not make it
                    nursery.cancel_scope.cancel()

            # Signals are caught before the mount exists: a SIGTERM the moment
            # it appears (a stop during start-up) unmounts it, not kills us.
            await nursery.start(_on_signals, stop)
            await trio.lowlevel.checkpoint()  # (its LIST is on its way)
            try:
                binding = mount_binding(config, fs, mountpoint, mount_options(config))
                mounted = True
            except AifsError as exc:  # raised below as itself, not in a group
                failed = exc
                nursery.cancel_scope.cancel()
            else:
                await _serve_mounted(config, fs, binding, cache_dir, nursery, report,
                                     unmount)
    finally:
        unmount()
        fs.save_dir_times()
        local.close()
        fs.fetcher.wait_stored(10.0)
        cache.close()
        meta.close()
        await store.aclose()
    if failed is not None:
        raise failed
    return 0


async def _serve_mounted(config: Config, fs: Filesystem, binding: Binding, cache_dir: Path,
                         nursery: trio.Nursery, report: Callable[[str], None],
                         unmount: Callable[[], None]) -> None:
    from aifs.metrics import serve_http
    log.info("mounted %s on %s (cache %s, %s binding)", fs.store.description,
             binding.mountpoint, cache_dir, binding.name)
    fs.start(nursery)
    if config.metrics_port:
        await nursery.start(serve_http, config.metrics_address, config.metrics_port,
                            fs.metrics)
    nursery.start_soon(_announce_ready, binding.mountpoint, report, config)
    await binding.serve()
    unmount()
    # The mount is gone; the promoter still runs: finish what is pending.
    await fs.drain(config.unmount_timeout, _report_drain)
    nursery.cancel_scope.cancel()


def _report_drain(left: dict[str, float]) -> None:
    sd_notify(f"STATUS=promoting {left['files']:.0f} files ({left['bytes'] / 2**20:.1f} MiB) "
              f"and {left['deletes']:.0f} deletes before exiting")


FUSECTL = "/sys/fs/fuse/connections"


def tune_mount(device: int, config: Config) -> None:
    """Widen the kernel's readahead and async request queue for the mount
    whose ``st_dev`` is ``device``.

    The kernel offers FUSE only 128 KiB of readahead, so large sequential reads
    arrive as 128 KiB requests; a wider window (``kernel_readahead``) lets them
    arrive as 1 MiB ones (FUSE's max_pages), which is what makes reads from the
    NVMe tier reach local-disk speed. The queue of async requests (readahead
    among them; 12 by default) grows with the lake connections. Needs root;
    without it the defaults stay. The queue lives in the fusectl filesystem,
    which systemd mounts at boot; where nothing did, it is mounted here.
    """
    if not config.kernel_readahead:
        return
    queue = max(12, config.max_connections * 2)
    connection = f"{FUSECTL}/{os.minor(device)}"
    if not os.path.isdir(connection) and os.path.isdir(FUSECTL):
        result = subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL],
                                capture_output=True, text=True)
        if result.returncode != 0:
            log.debug("cannot mount fusectl: %s", result.stderr.strip())
    settings = {
        f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb":
            config.kernel_readahead // 1024,
        f"{connection}/max_background": queue,
        f"{connection}/congestion_threshold": queue * 3 // 4,
    }
    for path, value in settings.items():
        try:
            with open(path, "w") as fp:
                fp.write(f"{value}\n")
        except OSError as exc:
            log.debug("cannot set %s: %s", path, exc.strerror)


async def _announce_ready(mountpoint: str, report: Callable[[str], None],
                          config: Config) -> None:
    """READY only once the mount answers a request, not merely exists."""
    # Never stat the mount on this thread: the request would wait for this
    # very thread to answer it (it did, once the root's attributes had been
    # invalidated by a write: the daemon hung).
    st = await trio.to_thread.run_sync(os.stat, mountpoint)
    # Off this thread too: it may run mount(8) for fusectl.
    await trio.to_thread.run_sync(tune_mount, st.st_dev, config)
    sd_notify(f"READY=1\nSTATUS=serving {mountpoint}\nMAINPID={os.getpid()}")
    report("OK")


async def _on_signals(terminate: Callable[[], None],
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            log.info("signal %s: unmounting", signal.Signals(signum).name)
            terminate()
            return
