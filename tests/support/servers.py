"""S3 servers for the tests: a moto server process, and a Ceph RADOS Gateway
(../shared/tools/ceph-rgw.sh) where the run has one; one of each per test
worker, as session fixtures (``moto_server``, ``ceph_server``)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.config
import pytest

from support.mounts import REPO, wait_for

CEPH_SCRIPT = Path(os.environ.get("AIFS_CEPH_RGW_SCRIPT",
                                  REPO.parent / "shared" / "tools" / "ceph-rgw.sh"))
# ceph-rgw.sh installs its Debian packages on a fresh machine: two test workers
# starting a cluster at once ran apt-get at once, and one failed on dpkg's lock
# (every Ceph test of that worker errored). Starts take turns.
CEPH_START_LOCK = Path(tempfile.gettempdir()) / "aifs-tests-ceph-start.lock"


def ceph_left_out() -> str | None:
    """Why this run has no Ceph RGW tier, or None where it has one."""
    if not CEPH_SCRIPT.is_file():
        return (f"Ceph RGW tier skipped: {CEPH_SCRIPT} not found "
                "(set AIFS_CEPH_RGW_SCRIPT to its path)")
    if os.environ.get("AIFS_SKIP_CEPH") == "1":
        return "Ceph RGW tier skipped: AIFS_SKIP_CEPH=1"
    return None


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
        with open(CEPH_START_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result = subprocess.run(["bash", str(CEPH_SCRIPT), "start", str(directory)],
                                    env=env, capture_output=True, text=True, timeout=600)
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
    if reason := ceph_left_out():
        pytest.skip(reason)
    if chosen := os.environ.get("AIFS_CEPH_DIR"):  # one cluster per test worker
        directory = Path(chosen) / os.environ.get("PYTEST_XDIST_WORKER", "main")
    else:
        directory = tmp_path_factory.mktemp("ceph")
    with ceph_process(directory) as server:
        yield server
