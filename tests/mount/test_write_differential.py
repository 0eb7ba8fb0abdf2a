"""Differential test of the write path: Hypothesis draws sequences of create, write
at an offset, truncate, rename, unlink, mkdir and rmdir; each is applied to a local
directory (the model) and to the mount, and the results (errno included) and the
whole trees must match after every step. At the end of each sequence: ``aifs sync``,
the lake's objects must be the model's files, and a new mount on an empty cache must
show the model's tree again.

Promotion runs at once on the local lake (uploads race the next steps) and after
0.2 s on moto. One mount serves the examples (each works in a fresh sub-directory);
the remount at the end of an example is the mount the next example uses.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test
from support.lakes import lake_tree

NAMES = ["a", "b", "c"]
PATHS = NAMES + [f"{x}/{y}" for x in NAMES for y in NAMES]
paths = st.sampled_from(PATHS)
data = st.binary(min_size=0, max_size=200)
offsets = st.one_of(st.integers(0, 20), st.integers(0, 3000))
sizes = st.one_of(st.integers(0, 20), st.integers(0, 4000))

SETTINGS = settings(
    max_examples=int(os.environ.get("AIFS_DIFF_EXAMPLES", "20")),
    stateful_step_count=20, deadline=None, database=None, print_blob=True,
    suppress_health_check=list(HealthCheck))


def outcome(fn) -> tuple[str, object]:
    try:
        return ("ok", fn())
    except OSError as exc:
        return ("error", errno.errorcode.get(exc.errno, exc.errno))


def tree(root: Path) -> dict[str, bytes | None]:
    """path -> bytes for files, None for directories."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames:
            out[os.path.normpath(os.path.join(rel, name))] = None
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fp:
                out[os.path.normpath(os.path.join(rel, name))] = fp.read()
    return out


def split(found: dict[str, bytes | None]) -> tuple[dict[str, bytes], set[str]]:
    return ({k: v for k, v in found.items() if v is not None},
            {k for k, v in found.items() if v is None})


class Context:
    """What the examples share: the lake, the current mount, the model's root."""

    def __init__(self, lake, mounter, aifs_cli, model_root: Path, delay: str) -> None:
        self.lake = lake
        self.delay = delay
        self.mounter = mounter
        self.aifs_cli = aifs_cli
        self.model_root = model_root
        model_root.mkdir()
        self.count = 0
        self.mount = mounter(lake, "--promote-delay", delay, name="d000")

    def sync(self, path: Path) -> None:
        result = self.aifs_cli("sync", str(path), timeout=300)
        assert result.returncode == 0, f"aifs sync failed: {result.stderr[-2000:]}"

    def remount(self) -> None:
        """umount, and mount again on a new, empty cache directory."""
        self.mount.unmount()
        self.mount = self.mounter(self.lake, "--promote-delay", self.delay,
                                  name=f"d{self.count:03d}")


class WriteMachine(RuleBasedStateMachine):
    ctx: Context

    def __init__(self) -> None:
        super().__init__()
        self.ctx.count += 1
        self.name = f"ex{self.ctx.count:03d}"
        self.model = self.ctx.model_root / self.name
        self.model.mkdir()
        os.mkdir(self.ctx.mount.path / self.name)
        self.busy = False

    @property
    def real(self) -> Path:
        return self.ctx.mount.path / self.name

    def apply(self, what: str, op) -> None:
        self.busy = True
        expected = outcome(lambda: op(self.model))
        got = outcome(lambda: op(self.real))
        assert got == expected, f"{what}: mount gave {got}, the model {expected}"
        real, model = tree(self.real), tree(self.model)
        assert real == model, f"after {what}: mount {real}, model {model}"
        self.busy = False

    @rule(path=paths, content=data)
    def create(self, path: str, content: bytes) -> None:
        def op(root: Path) -> int:
            fd = os.open(root / path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                return os.write(fd, content)
            finally:
                os.close(fd)
        self.apply(f"create({path!r}, {len(content)} bytes)", op)

    @rule(path=paths, offset=offsets, content=data)
    def write(self, path: str, offset: int, content: bytes) -> None:
        def op(root: Path) -> int:
            fd = os.open(root / path, os.O_WRONLY)
            try:
                return os.pwrite(fd, content, offset)
            finally:
                os.close(fd)
        self.apply(f"pwrite({path!r}, {len(content)} bytes at {offset})", op)

    @rule(path=paths, size=sizes)
    def truncate(self, path: str, size: int) -> None:
        self.apply(f"truncate({path!r}, {size})", lambda root: os.truncate(root / path, size))

    @rule(src=paths, dst=paths)
    def rename(self, src: str, dst: str) -> None:
        self.apply(f"rename({src!r}, {dst!r})", lambda root: os.rename(root / src, root / dst))

    @rule(path=paths)
    def unlink(self, path: str) -> None:
        self.apply(f"unlink({path!r})", lambda root: os.unlink(root / path))

    @rule(path=paths)
    def mkdir(self, path: str) -> None:
        self.apply(f"mkdir({path!r})", lambda root: os.mkdir(root / path))

    @rule(path=paths)
    def rmdir(self, path: str) -> None:
        self.apply(f"rmdir({path!r})", lambda root: os.rmdir(root / path))

    def teardown(self) -> None:
        if self.busy:  # a step failed: report that failure, not a later one
            return
        ctx = self.ctx
        ctx.sync(self.real)
        model = tree(self.model)
        files, dirs = lake_tree(ctx.lake, self.name + "/")
        assert (files, dirs) == split(model), \
            f"lake after aifs sync: {files} {dirs}, model {model}"
        ctx.remount()
        real = tree(self.real)
        assert real == model, f"after a remount on an empty cache: {real}, model {model}"


# Promotion at once (uploads race the next steps) on one lake, batched on the other.
@pytest.mark.parametrize(("lake", "delay"), [("local", "0"), ("moto", "0.2")],
                         indirect=["lake"])
def test_write_path_matches_a_local_directory(lake, mounter, aifs_cli, tmp_path, delay):
    ctx = Context(lake, mounter, aifs_cli, tmp_path / "model", delay)
    machine = type("WriteMachineHere", (WriteMachine,), {"ctx": ctx})
    run_state_machine_as_test(machine, settings=SETTINGS)
