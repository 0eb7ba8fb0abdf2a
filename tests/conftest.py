"""The test suite's root: the fixture modules under tests/support/ (servers,
lakes, mounts), the number of test workers, the hang watchdog, and the safety
net for mounts a test left behind.

The suite by kind: tests/unit (the facade and its parts, no mount),
tests/mount (real FUSE mounts in subprocesses), tests/faults (faults injected,
daemons killed, disks filled), tests/conformance (each syscall family on a mount
and on tmpfs), tests/programs (real programs on a mount); tests/bench holds
benchmark scripts, not tests. ``tests/`` is on ``sys.path`` (``pythonpath`` in
pyproject.toml): a test imports its helpers as ``from support.lakes import ...``."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

# The helpers' own asserts say what failed, as the tests' do.
pytest.register_assert_rewrite("support")

from support.mounts import Mount  # noqa: E402

pytest_plugins = ["support.servers", "support.lakes", "support.mounts"]


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


def pytest_sessionfinish(session, exitstatus) -> None:
    """Safety net: report (and release) any test mount left behind."""
    base = str(session.config._tmp_path_factory.getbasetemp())
    with open("/proc/mounts") as fp:  # only this session's: others may run beside it
        leftovers = [line.split()[1] for line in fp
                     if line.split()[2] == "fuse.aifs" and line.split()[1].startswith(base)]
    for path in leftovers:
        print(f"\nLEFTOVER MOUNT {path}: a test did not unmount it", file=sys.stderr)
        subprocess.run(["fusermount3", "-u", "-z", path], check=False)
