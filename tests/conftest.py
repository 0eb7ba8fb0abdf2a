"""Fixtures: real lakes (a local directory, a moto S3 server process, a Ceph
RADOS Gateway when the script is there) and real FUSE mounts in subprocesses."""

from __future__ import annotations

import contextlib
import faulthandler
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import botocore.config
import pytest
import xxhash

from aifs.cli import process_alive  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent
HELPER = REPO / "mount" / "mount.aifs"  # mount(8)'s and umount(8)'s helper
AIFS = Path(sys.executable).parent / "aifs"  # the command, as installed with the tests
CEPH_SCRIPT = Path(os.environ.get("AIFS_CEPH_RGW_SCRIPT",
                                  REPO.parent / "shared" / "tools" / "ceph-rgw.sh"))
LAKE_KINDS = ["local", "moto", "ceph"]
S3_KINDS = ["moto", "ceph"]


def _ceph_left_out() -> str | None:
    """Why this run has no Ceph RGW tier, or None where it has one."""
    if not CEPH_SCRIPT.is_file():
        return (f"Ceph RGW tier skipped: {CEPH_SCRIPT} not found "
                "(set AIFS_CEPH_RGW_SCRIPT to its path)")
    if os.environ.get("AIFS_SKIP_CEPH") == "1":
        return "Ceph RGW tier skipped: AIFS_SKIP_CEPH=1"
    return None


# The heaviest cases (tens of seconds each on a 2-core machine: thousands of files,
# pip, a 300 MiB file, kill loops) run on one S3 server, not on both: the Ceph RGW
# where the run has one (the real server), else moto. Every other case still runs on
# both. AIFS_ALL_S3=1 runs the heavy ones on both too.
if os.environ.get("AIFS_ALL_S3") == "1":
    ONE_S3 = ["moto", "ceph"]
else:
    ONE_S3 = ["moto"] if _ceph_left_out() else ["ceph"]
HEAVY_LAKES = ["local", *ONE_S3]


def wait_for(condition: Callable[[], object], timeout: float, what: str,
             interval: float = 0.05) -> object:
    """Poll ``condition`` until it returns a true value, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    def __init__(self, kind: str, endpoint: str, access_key: str, secret_key: str,
                 directory: Path | None = None) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self.directory = directory  # a Ceph cluster's (its ceph.conf, for radosgw-admin)
        self.env = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
                    "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key, region_name="us-east-1",
            config=botocore.config.Config(
                s3={"addressing_style": "path"}, max_pool_connections=32,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required"))


def _http_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def moto_process(log_path: Path | None = None) -> Iterator[S3Server]:
    """A moto S3 server process on 127.0.0.1, stopped on exit."""
    port = free_port()
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _http_up(port) or proc.poll() is not None, 30, "moto server")
        if proc.poll() is not None:
            raise RuntimeError("moto server exited at start")
        yield S3Server("moto", f"http://127.0.0.1:{port}", "testing", "testing")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def ceph_process(directory: Path, store_gb: int = 20) -> Iterator[S3Server]:
    """A Ceph RADOS Gateway (ceph-rgw.sh) on 127.0.0.1, stopped on exit, even a
    half-started one."""
    port = free_port()
    env = dict(os.environ, CEPH_RGW_PORT=str(port), CEPH_RGW_MON_PORT=str(free_port()),
               CEPH_RGW_STORE_GB=str(store_gb))
    try:
        result = subprocess.run(["bash", str(CEPH_SCRIPT), "start", str(directory)], env=env,
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"ceph-rgw.sh start failed:\n{result.stdout}\n{result.stderr}")
        yield S3Server("ceph", f"http://127.0.0.1:{port}", "aifs", "aifs-secret", directory)
    finally:
        subprocess.run(["bash", str(CEPH_SCRIPT), "stop", str(directory)], env=env,
                       capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory) -> Iterator[S3Server]:
    with moto_process(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture(scope="session")
def ceph_server(tmp_path_factory) -> Iterator[S3Server]:
    if reason := _ceph_left_out():
        pytest.skip(reason)
    if chosen := os.environ.get("AIFS_CEPH_DIR"):  # one cluster per test worker
        directory = Path(chosen) / os.environ.get("PYTEST_XDIST_WORKER", "main")
    else:
        directory = tmp_path_factory.mktemp("ceph")
    with ceph_process(directory) as server:
        yield server


class Lake:
    """A fresh, empty lake of one kind, with direct (non-aifs) access to it."""

    def __init__(self, kind: str, url: str, env: dict[str, str], args: list[str],
                 server: S3Server | None = None, root: Path | None = None,
                 bucket: str = "", prefix: str = "") -> None:
        self.kind = kind
        self.url = url
        self.env = env
        self.args = args
        self.server = server
        self.root = root
        self.bucket = bucket
        self.prefix = prefix

    def put(self, key: str, data: bytes, meta: dict[str, str] | None = None) -> None:
        """Write an object as another tool would (``meta``: its user metadata,
        e.g. s3fs's ``mode``)."""
        if self.server:
            self.server.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data,
                                          Metadata=meta or {})
            return
        assert self.root is not None
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".put-{uuid.uuid4().hex}"
        tmp.write_bytes(data)
        for name, value in (meta or {}).items():  # where the local lake keeps metadata
            os.setxattr(tmp, "user.aifs.meta." + name, value.encode())
        os.rename(tmp, path)  # atomic, like an object PUT

    def put_many(self, items: dict[str, bytes], threads: int = 16) -> None:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda kv: self.put(*kv), items.items()))

    def mkdir_marker(self, key: str) -> None:
        if self.server:
            self.put(key.rstrip("/") + "/", b"")
        else:
            assert self.root is not None
            (self.root / key).mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> bytes:
        """The bytes of a file in the lake: its object, else its packed entry
        (a missing file raises what the lake raises: FileNotFoundError, NoSuchKey)."""
        try:
            return self.get_object(key)
        except Exception as exc:
            if not self._missing(exc):
                raise
            record = lake_packed(self).get(key)
            if record is None:
                raise
            return lake_packed_bytes(self, record)

    def _missing(self, exc: Exception) -> bool:
        if self.server:
            return isinstance(exc, self.server.client.exceptions.NoSuchKey)
        return isinstance(exc, (FileNotFoundError, IsADirectoryError))

    def get_object(self, key: str) -> bytes:
        """The bytes of one object."""
        if self.server:
            return self.server.client.get_object(
                Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        assert self.root is not None
        return (self.root / key).read_bytes()


def _make_lake(kind: str, request, tmp_path: Path) -> Lake:
    if kind == "local":
        root = tmp_path / "lake"
        root.mkdir()
        return Lake("local", f"file://{root}", {}, [], root=root)
    server: S3Server = request.getfixturevalue(f"{kind}_server")
    bucket = f"aifs-test-{uuid.uuid4().hex[:12]}"
    server.client.create_bucket(Bucket=bucket)
    return Lake(kind, f"s3://{bucket}/data", server.env,
                ["--endpoint-url", server.endpoint], server=server, bucket=bucket,
                prefix="data/")


@pytest.fixture(params=LAKE_KINDS)
def lake(request, tmp_path) -> Lake:
    return _make_lake(request.param, request, tmp_path)


@pytest.fixture(params=S3_KINDS)
def s3_lake(request, tmp_path) -> Lake:
    return _make_lake(request.param, request, tmp_path)


class Mount:
    """``aifs mount --foreground`` in a subprocess (pyfuse3 allows one mount per
    process); unmounted with ``aifs umount`` on close."""

    #: daemons running now, for the hang watchdog
    live: set[Mount] = set()

    def __init__(self, lake: Lake, mountpoint: Path, cache_dir: Path, log: Path,
                 extra: list[str]) -> None:
        self.lake = lake
        self.path = mountpoint
        self.cache_dir = cache_dir
        self.log = log
        mountpoint.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **lake.env)
        self.env = env
        with open(log, "ab") as fp:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aifs", "mount", lake.url, str(mountpoint),
                 "--foreground", "--cache-dir", str(cache_dir), "--log-level", "debug",
                 *lake.args, *extra], env=env, stdout=fp, stderr=subprocess.STDOUT)
        Mount.live.add(self)
        try:
            wait_for(lambda: os.path.ismount(mountpoint) or self.proc.poll() is not None,
                     60, f"mount on {mountpoint}")
        except AssertionError:
            self.kill()
            raise
        if self.proc.poll() is not None:
            raise AssertionError(f"aifs mount exited with {self.proc.returncode}:\n"
                                 f"{log.read_text()[-3000:]}")

    def unmount(self) -> None:
        if self.proc.poll() is None or os.path.ismount(self.path):
            result = subprocess.run([sys.executable, "-m", "aifs", "umount", str(self.path)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0 and os.path.ismount(self.path):
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("aifs daemon did not exit after unmount") from None
        finally:
            Mount.live.discard(self)
        assert not os.path.ismount(self.path)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        Mount.live.discard(self)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                       capture_output=True)

    def dump_stacks_and_kill(self) -> None:
        """For a daemon that stopped answering: its threads' stacks go to its
        log (SIGUSR1), then SIGKILL, which ends the kernel's wait of whatever
        test call was blocked on the mount (ENOTCONN)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)
        self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, in pyproject.toml): one worker per CPU, at
    most 4 (each worker starts its own moto and Ceph servers);
    ``AIFS_TEST_WORKERS`` sets it."""
    return int(os.environ.get("AIFS_TEST_WORKERS") or min(os.cpu_count() or 1, 4))


TEST_TIMEOUT = float(os.environ.get("AIFS_TEST_TIMEOUT", "900"))


@pytest.fixture(autouse=True)
def hang_watchdog(request) -> Iterator[None]:
    """A test that runs past ``AIFS_TEST_TIMEOUT`` seconds (900) fails instead
    of holding the run until CI's own limit: the daemons still running get
    their stacks written to their logs and are killed, which ends any call of
    the test blocked on their mounts. Should the test still not end, the run
    stops five minutes later with the stacks of pytest's own threads."""
    killed: list[Mount] = []
    fired = threading.Event()

    def fire() -> None:
        fired.set()
        for mount in Mount.live.copy():
            killed.append(mount)
            mount.dump_stacks_and_kill()

    timer = threading.Timer(TEST_TIMEOUT, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(TEST_TIMEOUT + 300, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    if fired.is_set():
        stacks = "\n".join(f"--- {m.log} ---\n{m.log_text()[-4000:]}" for m in killed)
        pytest.fail(f"ran past {TEST_TIMEOUT:.0f} s; {len(killed)} aifs daemon(s) killed "
                    f"(their stacks are at the end of their logs)\n{stacks}", pytrace=False)


@pytest.fixture
def mounter(tmp_path) -> Iterator[Callable[..., Mount]]:
    """Mount a lake: ``mounter(lake, *extra_args, name="m")``; all unmounted at the end."""
    mounts: list[Mount] = []

    def make(lake: Lake, *extra: str, name: str = "m", cache: str | None = None) -> Mount:
        mount = Mount(lake, tmp_path / f"mnt-{name}", tmp_path / f"cache-{cache or name}",
                      tmp_path / f"{name}.log", list(extra))
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        if mount.proc.poll() is None or os.path.ismount(mount.path):
            mount.unmount()


@pytest.fixture
def aifs_cli() -> Callable[..., subprocess.CompletedProcess]:
    def run(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aifs", *args], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    return run


def pytest_sessionfinish(session, exitstatus) -> None:
    """Safety net: report (and release) any test mount left behind."""
    base = str(session.config._tmp_path_factory.getbasetemp())
    with open("/proc/mounts") as fp:  # only this session's: others may run beside it
        leftovers = [line.split()[1] for line in fp
                     if line.split()[2] == "fuse.aifs" and line.split()[1].startswith(base)]
    for path in leftovers:
        print(f"\nLEFTOVER MOUNT {path}: a test did not unmount it", file=sys.stderr)
        subprocess.run(["fusermount3", "-u", "-z", path], check=False)


# -- direct views of a lake's contents (for the write-path tests) ----------------
LOCAL_STAGING = ".aifs-uploads"   # the local lake's multipart staging directory
LOCAL_TMP_PREFIX = ".aifs-tmp-"   # the local lake's not-yet-renamed objects


def lake_sizes(lake: Lake) -> dict[str, int]:
    """Every file and directory marker in the lake as a mount shows them, and its
    size: the objects (without aifs's own under ``.aifs/``) and the packed files
    the journals list. See :func:`lake_objects` for the objects alone."""
    objects = lake_objects(lake)
    out = {key: size for key, size in objects.items() if not key.startswith(".aifs/")}
    if any(key.startswith(JOURNALS) for key in objects):
        for key, record in lake_packed(lake, objects).items():
            out.setdefault(key, record["len"])
    return out


def lake_objects(lake: Lake) -> dict[str, int]:
    """Every object in the lake and its size, from one LIST, without the lake's
    prefix; a directory marker ends with "/" (on the local lake every directory
    counts as one, size 0)."""
    out: dict[str, int] = {}
    if lake.server:
        pages = lake.server.client.get_paginator("list_objects_v2").paginate(
            Bucket=lake.bucket, Prefix=lake.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][len(lake.prefix):]] = obj["Size"]
        return out
    assert lake.root is not None
    for dirpath, dirnames, filenames in os.walk(lake.root):
        rel = os.path.relpath(dirpath, lake.root)
        prefix = "" if rel == "." else rel + "/"
        dirnames[:] = [d for d in dirnames if not d.startswith(LOCAL_TMP_PREFIX)
                       and not (prefix == "" and d == LOCAL_STAGING)]
        if prefix:
            out[prefix] = 0
        for name in filenames:
            if name.startswith(LOCAL_TMP_PREFIX):
                continue
            try:
                out[prefix + name] = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass  # replaced between the listing and the stat
    return out


def lake_keys(lake: Lake) -> list[str]:
    """Every file and marker key in the lake, sorted (see :func:`lake_sizes`)."""
    return sorted(lake_sizes(lake))


def lake_tree(lake: Lake, under: str = "") -> tuple[dict[str, bytes], set[str]]:
    """(files, directories) below ``under`` ("" or "some/dir/"), as paths relative to it:
    files map to their bytes; directories are markers and every implied parent."""
    from concurrent.futures import ThreadPoolExecutor
    object_keys: list[str] = []
    dirs: set[str] = set()
    for key in lake_keys(lake):
        if not key.startswith(under) or key == under:
            continue
        rel = key[len(under):]
        if rel.endswith("/"):
            rel = rel.rstrip("/")
            dirs.add(rel)
        else:
            object_keys.append(key)
        parts = rel.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    with ThreadPoolExecutor(16) as pool:
        contents = list(pool.map(lake.get, object_keys))
    files = {key[len(under):]: data for key, data in zip(object_keys, contents, strict=True)}
    return files, dirs


def lake_meta(lake: Lake, key: str) -> dict[str, str]:
    """The user metadata of one object (s3fs names: mode, uid, gid, mtime, xattr),
    or of a packed file as its journal record gives it."""
    if _plain_size(lake, key) is None and (record := lake_packed(lake).get(key)):
        import urllib.parse
        seconds, nanos = divmod(record["mtime"], 1_000_000_000)
        meta = {"mode": str(0o100000 | (record["mode"] or 0o644)), "uid": str(record["uid"]),
                "gid": str(record["gid"]),
                "mtime": f"{seconds}.{nanos:09d}" if nanos else str(seconds)}
        if record.get("xattrs"):
            meta["xattr"] = urllib.parse.quote(json.dumps(
                record["xattrs"], separators=(",", ":"), sort_keys=True), safe="")
        return meta
    if lake.server:
        return lake.server.client.head_object(Bucket=lake.bucket,
                                              Key=lake.prefix + key)["Metadata"]
    assert lake.root is not None
    path = lake.root / key
    return {name[len("user.aifs.meta."):]: os.getxattr(path, name).decode()
            for name in os.listxattr(path) if name.startswith("user.aifs.meta.")}


JOURNALS = ".aifs/journal/"
PACKS = ".aifs/packs/"


_replayed: dict[tuple, dict[str, dict]] = {}


def lake_packed(lake: Lake, objects: dict[str, int] | None = None) -> dict[str, dict]:
    """The packed files of the lake, read from its journals as docs/packing.md
    describes them (written here independently of aifs): key -> its put record."""
    objects = lake_objects(lake) if objects is None else objects
    journals = tuple(sorted((k, v) for k, v in objects.items()
                            if k.startswith(JOURNALS) and not k.endswith("/")))
    cached = _replayed.get((lake.url, journals))
    if cached is not None:
        return cached
    newest: dict[str, dict] = {}
    for key, _ in journals:
        raw = lake.get_object(key)
        if key.endswith(".gz"):  # a fold: a header line, then a record per line
            lines = gzip.decompress(raw).splitlines()
            records = [json.loads(line) for line in lines[1:]]
            # a sharded fold: the records about keys are in its shards, a
            # header line then a record per line each
            ident = key[len(JOURNALS):-len(".fold.jsonl.gz")]
            for shard in range(json.loads(lines[0]).get("shards", 0)):
                part = gzip.decompress(lake.get_object(f".aifs/index/{ident}/{shard}.jsonl.gz"))
                records += [json.loads(line) for line in part.splitlines()[1:]]
        else:
            records = json.loads(raw)["records"]
        for record in records:
            current = newest.get(record.get("key", ""))
            if record["op"] in ("put", "del", "obj"):  # (obj: an object replaced it)
                stale_copy = (current is not None and record["op"] == current["op"] == "put"
                              and record["t"] == current["t"]
                              and record.get("mv", 0) < current.get("mv", 0))
                if (current is None or record["t"] >= current["t"]) and not stale_copy:
                    newest[record["key"]] = record
            elif record["op"] == "move" and current is not None \
                    and current["op"] == "put" \
                    and [current["pack"], current["off"]] == record["from"]:
                newest[record["key"]] = dict(current, pack=record["pack"], off=record["off"],
                                             mv=current.get("mv", 0) + 1)
    out = {key: record for key, record in newest.items() if record["op"] == "put"}
    _replayed[(lake.url, journals)] = out
    return out


def lake_packed_bytes(lake: Lake, record: dict) -> bytes:
    """A packed file's bytes, cut from its pack object."""
    data = lake.get_object(PACKS + record["pack"])
    return data[record["off"]:record["off"] + record["len"]]


def _plain_size(lake: Lake, key: str) -> int | None:
    import botocore.exceptions
    if lake.server:
        try:
            return lake.server.client.head_object(Bucket=lake.bucket,
                                                  Key=lake.prefix + key)["ContentLength"]
        except botocore.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
    assert lake.root is not None
    try:
        return os.stat(lake.root / key).st_size
    except FileNotFoundError:
        return None


def lake_size(lake: Lake, key: str) -> int | None:
    """The size of the file under ``key`` in the lake now (its object, else its
    packed entry), or None when there is none."""
    size = _plain_size(lake, key)
    if size is None and (record := lake_packed(lake).get(key)) is not None:
        return record["len"]
    return size


def lake_digest(lake: Lake, key: str) -> str:
    """xxh3-128 of a file's bytes in the lake (streamed from its object, else cut
    from its pack)."""
    import xxhash
    if _plain_size(lake, key) is None and (record := lake_packed(lake).get(key)) is not None:
        return xxhash.xxh3_128_hexdigest(lake_packed_bytes(lake, record))
    hasher = xxhash.xxh3_128()
    if lake.server:
        body = lake.server.client.get_object(Bucket=lake.bucket, Key=lake.prefix + key)["Body"]
        for chunk in body.iter_chunks(4 << 20):
            hasher.update(chunk)
        return hasher.hexdigest()
    assert lake.root is not None
    with open(lake.root / key, "rb") as fp:
        while chunk := fp.read(4 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


def lake_uploads(lake: Lake) -> list[str]:
    """Unfinished multipart uploads in the lake: their keys on S3, the staging
    entries on the local lake."""
    if lake.server:
        found: list[str] = []
        pages = lake.server.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=lake.bucket)
        for page in pages:
            found += [u["Key"] for u in page.get("Uploads", [])]
        return found
    assert lake.root is not None
    try:
        return sorted(name for name in os.listdir(lake.root / LOCAL_STAGING)
                      if not name.startswith(".aifs-tmp-"))  # a create cut short: no upload
    except FileNotFoundError:
        return []


def mtime_ns_of(value: str) -> int:
    """The s3fs ``mtime`` metadata ("SECONDS" or "SECONDS.NNNNNNNNN") in nanoseconds."""
    seconds, _, fraction = value.partition(".")
    return int(seconds) * 1_000_000_000 + int((fraction or "0").ljust(9, "0")[:9])


def lake_upload_parts(lake: Lake) -> int:
    """How many parts the lake holds for its unfinished multipart uploads
    (in a local lake, parts sent with their offsets share one file, "object",
    which counts as one: tests ask whether any part is there)."""
    if lake.server:
        client = lake.server.client
        uploads = client.list_multipart_uploads(Bucket=lake.bucket).get("Uploads", [])
        parts = 0
        for upload in uploads:
            try:
                parts += len(client.list_parts(Bucket=lake.bucket, Key=upload["Key"],
                                               UploadId=upload["UploadId"]).get("Parts", []))
            except client.exceptions.ClientError as exc:
                # completed or aborted since the listing (Ceph RGW says NoSuchKey)
                if exc.response["Error"]["Code"] not in ("NoSuchUpload", "NoSuchKey"):
                    raise
        return parts
    assert lake.root is not None
    parts = 0
    try:
        uploads = os.listdir(lake.root / LOCAL_STAGING)
    except FileNotFoundError:
        return 0
    for upload in uploads:
        try:
            parts += sum(1 for name in os.listdir(lake.root / LOCAL_STAGING / upload)
                         if name.startswith("part-") or name == "object")
        except (FileNotFoundError, NotADirectoryError):
            continue  # completed or aborted since the listing (as on S3 above)
    return parts


def delete_prefix(lake: Lake, prefix: str) -> None:
    """Remove every object under ``prefix`` (bucket-relative on S3, lake-relative locally)."""
    if lake.server:
        client = lake.server.client
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=lake.bucket,
                                                                  Prefix=prefix)
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=lake.bucket, Delete={"Objects": keys})
        return
    assert lake.root is not None
    path = lake.root / prefix
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def file_digest(path: Path) -> str:
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as fp:
        while chunk := fp.read(4 << 20):
            hasher.update(chunk)
    return hasher.hexdigest()


# -- the conformance suite (tests/conformance): one aifs mount per lake kind and
# module (mounting costs seconds; each test works in a directory of its own), and a
# tmpfs as the reference (Linux, not our opinion).


@pytest.fixture(scope="session")
def tmpfs(tmp_path_factory) -> Iterator[Path]:
    """A tmpfs, the reference every case is also run on."""
    path = open_dir() / "tmpfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(path)],
                   check=True)
    os.chmod(path, 0o777)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)
    shutil.rmtree(path.parent, ignore_errors=True)


def open_dir() -> Path:
    """A new directory other users can reach (pytest's tmp_path is root's
    alone): permission cases switch to nobody."""
    path = Path(tempfile.mkdtemp(prefix="aifs-conf-", dir="/tmp"))
    os.chmod(path, 0o755)
    return path


class Side:
    """Where a case runs: ``path`` is a fresh directory on one filesystem."""

    def __init__(self, name: str, path: Path, mount: Mount | None = None) -> None:
        self.name = name
        self.path = path
        self.mount = mount


@pytest.fixture(scope="module", params=LAKE_KINDS)
def conf_mount(request, tmp_path_factory) -> Iterator[Mount]:
    """aifs on one lake kind, with allow_other (permission cases switch users)."""
    base = tmp_path_factory.mktemp(f"conf-{request.param}")
    lake = _make_lake(request.param, request, base)
    where = open_dir()
    mount = Mount(lake, where / "mnt", base / "cache", base / "aifs.log",
                  ["--allow-other"])
    os.chmod(mount.path, 0o777)
    yield mount
    if mount.proc.poll() is None or os.path.ismount(mount.path):
        mount.unmount()
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def sides(conf_mount, tmpfs) -> tuple[Side, Side]:
    """(aifs, tmpfs): an empty directory of this test's own on each."""
    name = uuid.uuid4().hex[:8]
    fuse_dir, ref_dir = conf_mount.path / name, tmpfs / name
    fuse_dir.mkdir()
    ref_dir.mkdir()
    os.chmod(fuse_dir, 0o777)
    os.chmod(ref_dir, 0o777)
    return Side("aifs", fuse_dir, conf_mount), Side("tmpfs", ref_dir)


@pytest.fixture
def second_mount(conf_mount, tmp_path) -> Iterator[Callable[[], Mount]]:
    """``second_mount()``: after everything of ``conf_mount`` reached the lake,
    the same lake mounted again on an empty cache (a fresh node)."""
    mounts: list[Mount] = []

    def make() -> Mount:
        os.getxattr(conf_mount.path, "user.aifs.sync")
        n = len(mounts)
        mount = Mount(conf_mount.lake, tmp_path / f"fresh{n}", tmp_path / f"fresh-cache{n}",
                      tmp_path / f"fresh{n}.log", ["--allow-other"])
        mounts.append(mount)
        return mount

    yield make
    for mount in mounts:
        mount.unmount()
