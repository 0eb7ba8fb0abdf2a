"""Running aifs as a service: the systemd unit (readiness, stop, restart after a
crash), fstab and mount(8) through the helper, and the live figures of
``aifs status`` and the Prometheus endpoint, checked against what the test did."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.lakes import Lake, lake_sizes
from support.mounts import AIFS, HELPER, REPO, wait_for

from aifs.cli import process_alive
from aifs.daemon import mount_type

UNIT = REPO / "deploy" / "aifs@.service"
KiB, MiB = 1 << 10, 1 << 20


# -- what deploy/quickstart.sh installs, pointing at this checkout -------------------
@pytest.fixture
def system_install() -> Iterator[None]:
    """/usr/local/bin/aifs and the mount helpers in /sbin, as the install makes
    them but linked to this checkout; what was there before is put back."""
    links = {Path("/usr/local/bin/aifs"): AIFS, Path("/sbin/mount.fuse.aifs"): HELPER,
             Path("/sbin/umount.fuse.aifs"): HELPER, Path("/sbin/umount.aifs"): HELPER}
    before: dict[Path, str | None] = {}
    for link, target in links.items():
        if link.exists() and not link.is_symlink():
            pytest.fail(f"{link} is not the link deploy/quickstart.sh installs")
        before[link] = os.readlink(link) if link.is_symlink() else None
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    try:
        yield
    finally:
        for link, old in before.items():
            link.unlink(missing_ok=True)
            if old is not None:
                link.symlink_to(old)


def write_config(lake: Lake, tmp_path: Path, mountpoint: Path, *extra: str) -> Path:
    """A /etc/aifs/NAME.toml for ``lake``."""
    lines = [f'lake = "{lake.url}"', f'mountpoint = "{mountpoint}"',
             f'cache_dir = "{tmp_path / "cache"}"', 'log_level = "debug"', *extra]
    if lake.server:
        lines.append(f'endpoint_url = "{lake.server.endpoint}"')
    path = tmp_path / "etc-aifs" / "test.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    mountpoint.mkdir(exist_ok=True)
    return path


# -- the systemd unit ------------------------------------------------------------
def test_unit_file_passes_systemd_analyze_verify(system_install, tmp_path):
    instance = tmp_path / "aifs@lake.service"  # verify an instance of the template
    instance.write_text(UNIT.read_text())
    result = subprocess.run(["systemd-analyze", "verify", str(instance)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "aifs@lake.service" not in result.stderr, result.stderr  # no warnings either


class Service:
    """The daemon started the way the unit starts it: its ExecStart and
    Environment, with NOTIFY_SOCKET on a socket this test listens to."""

    def __init__(self, lake: Lake, tmp_path: Path, config: Path, name: str = "svc") -> None:
        self.mountpoint = Path(tomllib_value(config, "mountpoint"))
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock_path = tmp_path / f"{name}-notify.sock"
        sock_path.unlink(missing_ok=True)
        self.notify.bind(str(sock_path))
        self.messages: list[tuple[str, bool]] = []  # (message, mounted when it came)
        command, unit_env = unit_service()
        command = [str(config) if arg == "/etc/aifs/%i.toml" else arg for arg in command]
        env = dict(os.environ, **lake.env, **unit_env, NOTIFY_SOCKET=str(sock_path))
        self.stderr = tmp_path / f"{name}.stderr"
        with open(self.stderr, "wb") as err:
            self.proc = subprocess.Popen(command, env=env, stdout=err, stderr=err)

    def wait(self, word: str, timeout: float) -> str:
        """The first notification holding ``word`` (fails if the daemon exits first)."""
        deadline = time.monotonic() + timeout
        self.notify.settimeout(0.1)
        while time.monotonic() < deadline:
            try:
                message = self.notify.recv(4096).decode()
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited ({self.proc.returncode}) before "
                                         f"{word}: {self.stderr.read_text()[-2000:]}") from None
                continue
            self.messages.append((message, mount_type(str(self.mountpoint)) == "fuse.aifs"))
            if word in message:
                return message
        raise AssertionError(f"no {word} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        self.notify.close()


def tomllib_value(config: Path, key: str) -> str:
    import tomllib
    return tomllib.loads(config.read_text())[key]


def unit_service() -> tuple[list[str], dict[str, str]]:
    """ExecStart (the aifs of this checkout for /usr/local/bin/aifs) and the
    Environment= settings of the unit file."""
    command: list[str] = []
    env: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "ExecStart":
            command = shlex.split(value)
        elif key == "Environment":
            name, _, setting = value.partition("=")
            env[name] = setting
    assert command[0] == "/usr/local/bin/aifs", command
    return [str(AIFS), *command[1:]], env


@pytest.fixture
def services() -> Iterator[list[Service]]:
    started: list[Service] = []
    yield started
    for service in started:
        service.close()


def test_unit_is_ready_only_once_the_mount_answers(lake, tmp_path, services):
    lake.put("data/sample-0.bin", b"x" * 1000)
    config = write_config(lake, tmp_path, tmp_path / "mnt")
    service = Service(lake, tmp_path, config)
    services.append(service)
    ready = service.wait("READY=1", 60)
    assert f"MAINPID={service.proc.pid}" in ready
    assert all(mounted for message, mounted in service.messages if "READY=1" in message)
    assert os.listdir(service.mountpoint) == ["data"]  # answered by the mount
    assert (service.mountpoint / "data" / "sample-0.bin").read_bytes() == b"x" * 1000


def test_unit_stop_promotes_pending_writes_and_releases_the_mount(lake, tmp_path,
                                                                  services):
    config = write_config(lake, tmp_path, tmp_path / "mnt", "promote_delay = 3600")
    service = Service(lake, tmp_path, config)
    services.append(service)
    service.wait("READY=1", 60)
    files = {"run/ckpt.pt": os.urandom(20 * MiB), "run/log.txt": b"step 1\n",
             "notes.md": b"# notes\n"}
    for name, data in files.items():
        (service.mountpoint / name).parent.mkdir(exist_ok=True)
        (service.mountpoint / name).write_bytes(data)
    assert not any(name in lake_sizes(lake) for name in files)  # held: promote_delay

    service.proc.send_signal(signal.SIGTERM)  # systemctl stop (KillMode=mixed: main first)
    service.wait("STOPPING=1", 30)
    assert service.proc.wait(120) == 0, service.stderr.read_text()[-2000:]
    assert not os.path.ismount(service.mountpoint)
    for name, data in files.items():
        assert lake.get(name) == data, name


def test_unit_start_fails_with_one_line_and_no_ready(s3_lake, tmp_path, services):
    config = write_config(s3_lake, tmp_path, tmp_path / "mnt")
    config.write_text(config.read_text().replace(s3_lake.bucket, "no-such-bucket-here"))
    service = Service(s3_lake, tmp_path, config)
    services.append(service)
    assert service.proc.wait(120) != 0
    service.notify.settimeout(0)
    with pytest.raises(BlockingIOError):
        service.notify.recv(4096)  # nothing was announced
    lines = service.stderr.read_text().strip().splitlines()
    assert lines and lines[-1].startswith("aifs: ") and "no-such-bucket-here" in lines[-1]
    assert "Traceback" not in service.stderr.read_text()
    assert not os.path.ismount(service.mountpoint)


def test_unit_restarts_after_a_crash_on_its_dead_mount(lake, tmp_path, services):
    config = write_config(lake, tmp_path, tmp_path / "mnt")
    first = Service(lake, tmp_path, config, name="first")
    services.append(first)
    first.wait("READY=1", 60)
    (first.mountpoint / "kept.txt").write_bytes(b"closed before the crash")
    first.proc.kill()  # what Restart=on-failure then recovers from
    first.proc.wait()
    assert mount_type(str(first.mountpoint)) == "fuse.aifs"  # dead, still mounted
    second = Service(lake, tmp_path, config, name="second")
    services.append(second)
    second.wait("READY=1", 60)
    assert (second.mountpoint / "kept.txt").read_bytes() == b"closed before the crash"
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(120) == 0
    assert lake.get("kept.txt") == b"closed before the crash"


class Gate:
    """A TCP proxy in front of an S3 server that can hold every byte: a lake
    that hangs without refusing anything."""

    def __init__(self, upstream: str) -> None:
        self.upstream = int(upstream.rsplit(":", 1)[1])
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                return
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                self.flowing.wait()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        self.flowing.set()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def test_unit_stop_gives_up_after_unmount_timeout_and_keeps_the_rest(moto_server, tmp_path,
                                                                     services):
    """A lake that hangs: stop waits unmount_timeout (plus at most one request
    timeout), not forever, and the next start promotes what was left."""
    bucket = f"aifs-gate-{os.getpid()}"
    moto_server.client.create_bucket(Bucket=bucket)
    gate = Gate(moto_server.endpoint)
    lake = Lake("moto", f"s3://{bucket}", moto_server.env, [], server=moto_server,
                bucket=bucket)
    mountpoint = tmp_path / "mnt"
    config = write_config(lake, tmp_path, mountpoint, "promote_delay = 3600",
                          "unmount_timeout = 2", "request_timeout = 5",
                          f'endpoint_url = "{gate.endpoint}"')
    config.write_text(config.read_text().replace(
        f'endpoint_url = "{moto_server.endpoint}"\n', ""))
    try:
        service = Service(lake, tmp_path, config)
        services.append(service)
        service.wait("READY=1", 60)
        data = os.urandom(64 * KiB)
        (service.mountpoint / "late.bin").write_bytes(data)
        gate.flowing.clear()  # from now on the lake answers nothing
        started = time.monotonic()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(60) == 0
        assert time.monotonic() - started < 2 + 5 + 5  # the timeout, one request, slack
        assert "unmount_timeout" in service.stderr.read_text()
        assert not os.path.ismount(mountpoint)
        gate.flowing.set()
        again = Service(lake, tmp_path, config, name="again")
        services.append(again)
        again.wait("READY=1", 60)
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(60) == 0
        assert lake.get("late.bin") == data
    finally:
        gate.close()


@pytest.fixture
def local_lake(tmp_path) -> Lake:
    root = tmp_path / "lake"
    root.mkdir()
    return Lake("local", f"file://{root}", {}, [], root=root)


# -- fstab and mount(8) -------------------------------------------------------------
def run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, **(env or {})))


def test_mount_t_fuse_aifs_and_umount_with_the_helper_leave_everything_in_the_lake(
        lake, tmp_path, system_install):
    mountpoint = tmp_path / "mnt"
    config = write_config(lake, tmp_path, mountpoint, "promote_delay = 3600")
    result = run("mount", "-t", "fuse.aifs", "none", str(mountpoint), "-o",
                 f"_netdev,nofail,config={config},helper=aifs,metadata_ttl=5",
                 env=lake.env)
    assert result.returncode == 0, result.stderr
    try:
        assert mount_type(str(mountpoint)) == "fuse.aifs"
        files = {f"out/part-{i}.bin": os.urandom(100 * KiB + i) for i in range(5)}
        files["out/big.bin"] = os.urandom(24 * MiB)
        (mountpoint / "out").mkdir()
        for name, data in files.items():
            (mountpoint / name).write_bytes(data)
        result = run("umount", str(mountpoint))  # helper=aifs: through aifs umount
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mountpoint)
        for name, data in files.items():  # at once: umount waited for the lake
            assert lake.get(name) == data, name
    finally:
        if os.path.ismount(mountpoint):
            run("fusermount3", "-u", "-z", str(mountpoint))


def test_fstab_line_mounts_and_plain_umount_still_promotes_everything(
        lake, tmp_path, system_install):
    mountpoint = tmp_path / "mnt"
    config = write_config(lake, tmp_path, mountpoint, "promote_delay = 3600")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{lake.url} {mountpoint} fuse.aifs _netdev,config={config} 0 0\n")
    result = run("mount", "--fstab", str(fstab), str(mountpoint), env=lake.env)
    assert result.returncode == 0, result.stderr
    try:
        pid = int(os.getxattr(mountpoint, "user.aifs.pid"))
        data = os.urandom(3 * MiB)
        (mountpoint / "written.bin").write_bytes(data)
        result = run("umount", str(mountpoint))  # the kernel's unmount: no helper
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mountpoint)
        wait_for(lambda: not process_alive(pid), 120, "the daemon promoting, then exiting")
        assert lake.get("written.bin") == data
    finally:
        if os.path.ismount(mountpoint):
            run("fusermount3", "-u", "-z", str(mountpoint))


# -- aifs status and the metrics endpoint ------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The endpoint's samples: 'name{labels}' -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_status_and_metrics_follow_the_reads_and_writes_made(lake, mounter, aifs_cli):
    samples = {f"in/s{i}.bin": os.urandom(100 * KiB) for i in range(4)}
    lake.put_many(samples)
    port = free_port()
    mount = mounter(lake, "--metrics-port", str(port), "--promote-delay", "3600")

    def status() -> dict:
        result = aifs_cli("status", str(mount.path), "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["metrics"]

    before, scraped = status(), scrape(port)
    assert before["metrics_url"] == f"http://127.0.0.1:{port}/metrics"
    for name, data in samples.items():
        assert (mount.path / name).read_bytes() == data
    after, scraped_after = status(), scrape(port)
    gets = after["lake"]["requests"]["GetObject"] - before["lake"]["requests"]["GetObject"]
    assert gets == 4  # one GET per 100 KiB sample (one block each)
    assert after["fs"]["read_bytes"] - before["fs"]["read_bytes"] == 400 * KiB
    assert after["lake"]["read_bytes"] - before["lake"]["read_bytes"] == 400 * KiB
    # each sample waited for its GET or was fetched ahead of its open (a directory read in order)
    assert (after["cache"]["misses"] - before["cache"]["misses"]
            + after["prefetch"]["directory_objects"]) >= 4
    wait_for(lambda: status()["cache"]["bytes"]["blocks"] >= 400 * KiB, 10,
             "the samples' blocks on the cache disk")
    key = 'aifs_lake_requests_total{op="GetObject"}'
    assert scraped_after[key] - scraped[key] == 4
    assert (scraped_after["aifs_fs_read_bytes_total"] - scraped["aifs_fs_read_bytes_total"]
            == 400 * KiB)

    written = {f"out/w{i}.txt": os.urandom(10 * KiB * (i + 1)) for i in range(3)}
    (mount.path / "out").mkdir()
    for name, data in written.items():
        (mount.path / name).write_bytes(data)
    queued = status()
    assert queued["promotion"]["pending_bytes"] == 60 * KiB
    assert queued["promotion"]["pending_files"] >= 3  # the files (and out/)
    assert queued["fs"]["write_bytes"] - after["fs"]["write_bytes"] == 60 * KiB
    puts_before = queued["lake"]["requests"]["PutObject"]
    assert aifs_cli("sync", str(mount.path)).returncode == 0
    synced, scraped_synced = status(), scrape(port)
    assert synced["promotion"]["pending_files"] == 0
    assert synced["promotion"]["pending_bytes"] == 0
    assert synced["lake"]["requests"]["PutObject"] - puts_before >= 3
    assert synced["promotion"]["upload_bytes"] - queued["promotion"]["upload_bytes"] \
        == 60 * KiB
    assert (scraped_synced["aifs_promotion_upload_bytes_total"]
            - scraped_after["aifs_promotion_upload_bytes_total"]) == 60 * KiB
    assert scraped_synced["aifs_promotion_pending_files"] == 0
    for name, data in written.items():
        assert lake.get(name) == data

    text = aifs_cli("status", str(mount.path))
    assert text.returncode == 0 and "hit ratio" in text.stdout and "GET 4" in text.stdout


def test_json_logs_are_one_object_per_line(local_lake, mounter):
    mount = mounter(local_lake, "--log-format", "json")
    (mount.path / "x").write_bytes(b"x")
    mount.unmount()
    lines = mount.log_text().strip().splitlines()
    assert lines
    for line in lines:
        entry = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(entry)
