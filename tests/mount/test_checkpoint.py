"""Checkpoint-aware write-back through a real FUSE mount: the policy xattr,
streaming uploads of checkpoint files, commit markers that reach the lake only
after the shards they commit, staging names held back for their rename,
deletes before promotion, the ``user.aifs.state`` view and local retention of
the newest checkpoints.

Ordering properties are checked by a thread that polls the lake directly
while the mount promotes: what a reader of the lake could have seen, not what
the mount says about itself."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from support.lakes import lake_keys, lake_tree, lake_upload_parts, lake_uploads
from support.mounts import wait_for
from support.packed import lake_digest, lake_size

MiB = 1 << 20
POLICY = "user.aifs.policy"
STATE = "user.aifs.state"
CACHED = "user.aifs.cached_bytes"
STREAMING = ("--part-size", "5M", "--multipart-threshold", "5M", "--stream-checkpoints", "true")
STATE_RE = re.compile(r"(lake|local|promoting (\d+)/(\d+))")


# -- helpers ----------------------------------------------------------------------
def sync(aifs_cli, path: Path, timeout: float = 120) -> None:
    result = aifs_cli("sync", "-q", str(path), timeout=timeout)
    assert result.returncode == 0, f"aifs sync {path} failed: {result.stderr[-2000:]}"


def data_of(seed: int, size: int) -> bytes:
    """Reproducible incompressible bytes."""
    return random.Random(seed).randbytes(size)


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def write_all(path: Path, data: bytes, chunk: int = MiB) -> None:
    """Create ``path`` and write ``data`` front to back in ``chunk`` writes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(data), chunk):
            assert os.write(fd, data[offset:offset + chunk]) == len(data[offset:offset + chunk])
    finally:
        os.close(fd)


def getx(path: Path, name: str) -> str:
    return os.getxattr(path, name).decode()


def state_of(path: Path) -> tuple[str, int | None, int | None]:
    """``user.aifs.state`` parsed: (word, done, total); done/total only when promoting."""
    value = getx(path, STATE)
    match = STATE_RE.fullmatch(value)
    assert match, f"{path}: unexpected {STATE} {value!r}"
    if match.group(2) is None:
        return match.group(1), None, None
    return "promoting", int(match.group(2)), int(match.group(3))


def cached_bytes(path: Path) -> int:
    return int(getx(path, CACHED))


def lake_has_upload(lake) -> bool:
    return bool(lake_uploads(lake))


class Poller:
    """Runs ``probe`` in a thread, over and over, while the test acts; ``probe``
    returns complaints (an empty list when what it saw is fine). Use as a
    context manager; the thread is stopped (and its errors raised) on exit."""

    def __init__(self, probe: Callable[[], list[str]], interval: float = 0.02) -> None:
        self.probe = probe
        self.interval = interval
        self.rounds = 0
        self.complaints: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.complaints += self.probe()
            except BaseException as exc:  # reported by stop()
                self.error = exc
                return
            self.rounds += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> Poller:
        self._thread.start()
        wait_for(lambda: self.rounds or self.error, 30, "the lake poller's first round")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the lake poller did not stop"
        if self.error is not None and exc_info[0] is None:
            raise self.error

    def check(self, min_rounds: int = 3) -> None:
        assert self.rounds >= min_rounds, f"the poller looked only {self.rounds} times"
        distinct = list(dict.fromkeys(self.complaints))
        assert not distinct, f"{len(self.complaints)} bad observations, first: {distinct[:4]}"


def keys_seen(lake) -> tuple[set[str], Poller]:
    """A poller that records every key it ever saw in the lake."""
    seen: set[str] = set()

    def probe() -> list[str]:
        seen.update(lake_keys(lake))
        return []
    return seen, Poller(probe)


def marker_guard(lake, marker: str, shards: dict[str, int]) -> Callable[[], list[str]]:
    """A probe: whenever ``marker`` is in the lake, every shard must be there at its
    full size. The marker is looked at first and the shards after it, so a shard
    that arrives between the two looks cannot be mistaken for a late one."""
    def probe() -> list[str]:
        if lake_size(lake, marker) is None:
            return []
        sizes = {key: lake_size(lake, key) for key in shards}
        return [f"{marker} in the lake while {key} has {got} of {shards[key]} bytes"
                for key, got in sizes.items() if got != shards[key]]
    return probe


def in_background(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# -- 2a. the policy xattr ------------------------------------------------------------
def test_policy_xattr_shows_sets_and_survives_a_remount(lake, mounter, aifs_cli):
    # only checkpoints stream here, so a stream shows the policy acting
    mount = mounter(lake, "--promote-delay", "0.2", "--stream-large-files", "false",
                    *STREAMING)
    m = mount.path
    for rel in ("ckpt", "data", "models", "job/sub"):
        os.makedirs(m / rel)
    expected = {"ckpt/model.pt": "checkpoint", "data/part-0.parquet": "dataset",
                "models/m.safetensors": "weights", "notes.txt": "default",
                "job/sub/state.bin": "weights", "job/sub/state.dat": "default"}
    for rel in expected:
        (m / rel).write_bytes(b"x")
    for rel, policy in expected.items():
        assert getx(m / rel, POLICY) == policy, rel
    assert getx(m / "job", POLICY) == "default"

    # a directory's policy covers everything below it, whatever the names say
    os.setxattr(m / "job", POLICY, b"checkpoint")
    assert getx(m / "job", POLICY) == "checkpoint"
    assert getx(m / "job" / "sub", POLICY) == "checkpoint"
    assert getx(m / "job/sub/state.dat", POLICY) == "checkpoint"
    assert getx(m / "job/sub/state.bin", POLICY) == "checkpoint"
    assert getx(m / "notes.txt", POLICY) == "default"  # elsewhere nothing changed
    # a file's own xattr beats its name (and a directory above it)
    os.setxattr(m / "notes.txt", POLICY, b"dataset")
    assert getx(m / "notes.txt", POLICY) == "dataset"
    os.setxattr(m / "job/sub/state.bin", POLICY, b"weights")
    assert getx(m / "job/sub/state.bin", POLICY) == "weights"

    for bad in (b"nope", b"", b"Checkpoint", b"checkpoint,dataset"):
        with pytest.raises(OSError) as info:
            os.setxattr(m / "job", POLICY, bad)
        assert info.value.errno == errno.EINVAL, bad
    assert getx(m / "job", POLICY) == "checkpoint"

    # the policy acts: a file of default name under "job" is streamed like a checkpoint
    data = data_of(1, 8 * MiB)
    fd = os.open(m / "job/sub/big.dat", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for offset in range(0, len(data), MiB):
            os.write(fd, data[offset:offset + MiB])
        wait_for(lambda: lake_has_upload(lake), 20,
                 "a streaming upload of job/sub/big.dat while it is open")
    finally:
        os.close(fd)

    sync(aifs_cli, m)
    assert lake_digest(lake, "job/sub/big.dat") == digest(data)
    mount.unmount()

    again = mounter(lake, name="again")
    a = again.path
    assert getx(a / "job", POLICY) == "checkpoint"
    assert getx(a / "job" / "sub", POLICY) == "checkpoint"
    assert getx(a / "job/sub/state.dat", POLICY) == "checkpoint"
    assert getx(a / "job/sub/state.bin", POLICY) == "weights"
    assert getx(a / "notes.txt", POLICY) == "dataset"
    assert getx(a / "ckpt/model.pt", POLICY) == "checkpoint"
    assert getx(a / "data/part-0.parquet", POLICY) == "dataset"


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_removing_the_policy_xattr_restores_the_rules(lake, mounter):
    mount = mounter(lake, "--promote-delay", "0.2")
    m = mount.path
    os.makedirs(m / "job/sub")
    (m / "job/sub/state.dat").write_bytes(b"x")
    assert getx(m / "job/sub/state.dat", POLICY) == "default"
    os.setxattr(m / "job", POLICY, b"checkpoint")
    assert getx(m / "job/sub/state.dat", POLICY) == "checkpoint"
    os.removexattr(m / "job", POLICY)
    assert getx(m / "job", POLICY) == "default"
    assert getx(m / "job/sub/state.dat", POLICY) == "default"


# -- 2b. streaming ------------------------------------------------------------------------
def test_checkpoint_is_uploaded_while_it_is_written(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", *STREAMING)
    os.makedirs(mount.path / "ckpt")
    path = mount.path / "ckpt" / "model.pt"
    data = data_of(2, 20 * MiB + 12345)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for offset in range(0, 12 * MiB, MiB):
            os.write(fd, data[offset:offset + MiB])
        wait_for(lambda: lake_has_upload(lake), 20, "an upload in progress while open")
        assert lake_size(lake, "ckpt/model.pt") is None, "a partial object is visible"
        for offset in range(12 * MiB, len(data), MiB):
            os.write(fd, data[offset:offset + MiB])
    finally:
        os.close(fd)
    # no sync: it lands on its own, soon after close
    wait_for(lambda: lake_size(lake, "ckpt/model.pt") == len(data), 30,
             "ckpt/model.pt in the lake after close")
    assert lake_digest(lake, "ckpt/model.pt") == digest(data)
    sync(aifs_cli, mount.path)
    assert lake_uploads(lake) == []
    assert path.read_bytes() == data
    log = mount.log_text()
    assert "streaming upload of" not in log or "abandoned" not in log, log[-3000:]


def test_non_sequential_checkpoint_falls_back_to_a_whole_upload(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", *STREAMING)
    os.makedirs(mount.path / "ckpt")
    path = mount.path / "ckpt" / "model.pt"
    model = bytearray(data_of(3, 20 * MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for offset in range(0, len(model), MiB):
            os.write(fd, model[offset:offset + MiB])
        # the first part is in the lake: its bytes can no longer change in the upload
        wait_for(lambda: lake_upload_parts(lake) >= 1, 20, "a part uploaded while open")
        patch = data_of(4, MiB + 7)
        os.pwrite(fd, patch, MiB - 3)  # an early region, long handed to the upload
        model[MiB - 3:MiB - 3 + len(patch)] = patch
    finally:
        os.close(fd)
    sync(aifs_cli, mount.path)
    assert lake_digest(lake, "ckpt/model.pt") == digest(bytes(model))
    wait_for(lambda: not lake_uploads(lake), 20, "the abandoned upload aborted")
    # seen at the write (through the daemon), or before completion (a direct
    # writer: its parts are checked against the copy)
    log = mount.log_text()
    assert ("abandoned: not written front to back" in log
            or "abandoned: part 1 was rewritten after it was sent" in log), log[-3000:]
    assert path.read_bytes() == model


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_checkpoint_with_a_hole_is_not_streamed_but_promoted(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", *STREAMING)
    os.makedirs(mount.path / "ckpt")
    model = bytearray(12 * MiB)
    fd = os.open(mount.path / "ckpt" / "sparse.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        head, tail = data_of(5, 2 * MiB), data_of(6, 6 * MiB)
        os.pwrite(fd, head, 0)
        os.pwrite(fd, tail, 6 * MiB)  # past the end: a hole, not a front-to-back writer
        model[:len(head)] = head
        model[6 * MiB:] = tail
    finally:
        os.close(fd)
    stats = json.loads(os.getxattr(mount.path, "user.aifs.stats"))
    if not stats["direct_opens"]:
        # Through the daemon the hole is seen: never streamed. (A direct writer
        # is followed by its size, which shows no hole: it may stream, and its
        # parts are checked against the copy, holes read as zeros, before the
        # upload completes.)
        assert lake_uploads(lake) == []
    sync(aifs_cli, mount.path)
    assert lake_digest(lake, "ckpt/sparse.pt") == digest(bytes(model))
    assert lake_uploads(lake) == []


def test_checkpoint_unlinked_while_streamed_never_reaches_the_lake(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2", *STREAMING)
    os.makedirs(mount.path / "ckpt")
    path = mount.path / "ckpt" / "doomed.pt"
    data = data_of(7, 16 * MiB)
    seen, poller = keys_seen(lake)
    with poller:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for offset in range(0, 12 * MiB, MiB):
                os.write(fd, data[offset:offset + MiB])
            wait_for(lambda: lake_has_upload(lake), 20, "an upload in progress while open")
            os.unlink(path)
            for offset in range(12 * MiB, len(data), MiB):
                os.write(fd, data[offset:offset + MiB])
        finally:
            os.close(fd)
        (mount.path / "ckpt" / "kept.pt").write_bytes(b"kept")
        sync(aifs_cli, mount.path)
        wait_for(lambda: not lake_uploads(lake), 20, "the upload of the deleted file aborted")
    poller.check()
    assert "ckpt/doomed.pt" not in seen
    assert "ckpt/doomed.pt" not in lake_keys(lake)
    assert lake.get("ckpt/kept.pt") == b"kept"


# -- 2c. commit markers ---------------------------------------------------------------
def test_dcp_metadata_reaches_the_lake_after_every_shard(lake, mounter, aifs_cli):
    """DCP: shards, then ``.metadata`` (written as ``.metadata.tmp`` and renamed).
    The marker is pushed by ``aifs sync`` on it while the shards still wait for the
    promotion delay: it must wait for them."""
    mount = mounter(lake, "--promote-workers", "1", "--promote-delay", "3")
    step = mount.path / "run" / "step_1"
    os.makedirs(step)
    shards = {f"run/step_1/__{rank}_0.distcp": data_of(10 + rank, 3 * MiB + rank)
              for rank in range(4)}
    for rel, data in shards.items():
        write_all(mount.path / rel, data)
    metadata = b"dcp metadata: " + b",".join(sorted(k.encode() for k in shards))
    (step / ".metadata.tmp").write_bytes(metadata)
    os.rename(step / ".metadata.tmp", step / ".metadata")

    probe = marker_guard(lake, "run/step_1/.metadata",
                         {key: len(data) for key, data in shards.items()})
    with Poller(probe) as poller:
        sync(aifs_cli, step / ".metadata")
        sync(aifs_cli, mount.path)
    poller.check()
    files, _ = lake_tree(lake, "run/step_1/")
    assert files == {**{k.rpartition("/")[2]: v for k, v in shards.items()},
                     ".metadata": metadata}


def test_deepspeed_latest_reaches_the_lake_after_its_step(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-workers", "1", "--promote-delay", "3")
    ckpt = mount.path / "ckpt"
    os.makedirs(ckpt / "global_step2")
    shards = {"ckpt/global_step2/mp_rank_00_model_states.pt": data_of(20, 4 * MiB),
              "ckpt/global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt":
                  data_of(21, 4 * MiB + 1)}
    for rel, data in shards.items():
        write_all(mount.path / rel, data)
    (ckpt / "latest").write_bytes(b"global_step2")

    probe = marker_guard(lake, "ckpt/latest", {k: len(v) for k, v in shards.items()})
    with Poller(probe) as poller:
        sync(aifs_cli, ckpt / "latest")
        sync(aifs_cli, mount.path)
    poller.check()
    assert lake.get("ckpt/latest") == b"global_step2"
    for key, data in shards.items():
        assert lake.get(key) == data


def test_torchsnapshot_metadata_reaches_the_lake_after_its_data(lake, mounter, aifs_cli):
    """torchsnapshot writes ``<path>/<rank>/<logical path>`` (names with no suffix),
    then ``<path>/.snapshot_metadata``, which commits the snapshot."""
    mount = mounter(lake, "--promote-workers", "1", "--promote-delay", "3")
    snap = mount.path / "snap" / "epoch_3"
    os.makedirs(snap / "0" / "model")
    data = {"snap/epoch_3/0/model/layer.weight": data_of(25, 2 * MiB),
            "snap/epoch_3/0/model/layer.bias": data_of(26, 4096)}
    for rel, blob in data.items():
        write_all(mount.path / rel, blob)
    (snap / ".snapshot_metadata").write_bytes(b"manifest")

    probe = marker_guard(lake, "snap/epoch_3/.snapshot_metadata",
                         {k: len(v) for k, v in data.items()})
    with Poller(probe) as poller:
        sync(aifs_cli, snap / ".snapshot_metadata")
        sync(aifs_cli, mount.path)
    poller.check()


def test_rewritten_latest_waits_for_the_step_it_names(lake, mounter, aifs_cli):
    """Two saves in a row, faster than promotion: ``latest`` is rewritten while its
    first version is still pending. Whoever reads ``latest`` in the lake must find
    the step it names complete."""
    mount = mounter(lake, "--promote-workers", "1", "--promote-delay", "30")
    ckpt = mount.path / "ckpt"
    sizes: dict[str, dict[str, int]] = {}
    for step in (1, 2):
        name = f"global_step{step}"
        os.makedirs(ckpt / name)
        sizes[name] = {}
        for rank in range(2):
            rel = f"ckpt/{name}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            data = data_of(30 + 10 * step + rank, 3 * MiB + rank)
            write_all(mount.path / rel, data)
            sizes[name][rel] = len(data)
        (ckpt / "latest").write_bytes(name.encode())

    def probe() -> list[str]:
        try:
            named = lake.get("ckpt/latest").decode()
        except Exception:
            return []  # not there yet
        return [f"latest names {named} while {key} has {lake_size(lake, key)} bytes"
                for key, size in sizes.get(named, {"?": 1}).items()
                if lake_size(lake, key) != size]

    with Poller(probe) as poller:
        sync(aifs_cli, ckpt / "global_step1")  # the first step is in the lake
        pushed, errors = in_background(lambda: sync(aifs_cli, ckpt / "latest"))
        pushed.join(3)  # latest is pushed while global_step2 still waits for its delay
        sync(aifs_cli, mount.path)
        pushed.join(120)
        assert not errors, errors
    poller.check()
    assert lake.get("ckpt/latest") == b"global_step2"


def test_rewritten_latest_keeps_its_order_across_a_kill_right_after_close(lake, mounter,
                                                                          aifs_cli):
    """The marker's place in the publication order is renewed before close()
    returns: a daemon killed right after the second ``latest`` closed must not
    publish it before the step it names after the remount."""
    if lake.kind != "local":
        pytest.skip("mount-side ordering: the local lake shows it")
    args = ("--promote-workers", "1")
    mount = mounter(lake, *args, "--promote-delay", "3600")
    ckpt = mount.path / "ckpt"
    shard = {}
    for step in (1, 2):
        os.makedirs(ckpt / f"global_step{step}")
        data = data_of(70 + step, 6 * MiB)
        write_all(ckpt / f"global_step{step}" / "model.pt", data)
        shard[f"global_step{step}"] = len(data)
        (ckpt / "latest").write_bytes(f"global_step{step}".encode())
    mount.kill()  # at once after close() returned

    def probe() -> list[str]:
        try:
            named = lake.get("ckpt/latest").decode()
        except OSError:
            return []
        key = f"ckpt/{named}/model.pt"
        got = lake_size(lake, key)
        return [] if got == shard[named] else [f"latest names {named}; {key} has {got}"]

    with Poller(probe, interval=0.001) as poller:
        again = mounter(lake, *args, "--promote-delay", "0.2", name="m2", cache="m")
        sync(aifs_cli, again.path)
    poller.check()
    assert lake.get("ckpt/latest") == b"global_step2"


def test_latest_advances_in_the_lake_while_saves_keep_coming(lake, mounter, aifs_cli):
    """A training loop rewrites ``latest`` every few hundred milliseconds, faster
    than the lake takes the steps: the lake's ``latest`` must still advance (to
    steps that are complete there), not wait for the loop to stop."""
    mount = mounter(lake, "--promote-workers", "1")
    ckpt = mount.path / "ckpt"
    sizes: dict[str, int] = {}
    stop = threading.Event()

    def save_loop() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            os.makedirs(ckpt / f"global_step{step}")
            rel = f"ckpt/global_step{step}/model.pt"
            data = data_of(900 + step, 2 * MiB)
            write_all(mount.path / rel, data)
            sizes[rel] = len(data)
            (ckpt / "latest").write_bytes(f"global_step{step}".encode())
            stop.wait(0.3)  # the training step between saves

    def probe() -> list[str]:
        if lake_size(lake, "ckpt/latest") is None:
            return []
        try:
            named = lake.get("ckpt/latest").decode()
        except Exception:  # deleted between the two looks: not there
            return []
        key = f"ckpt/{named}/model.pt"
        return [] if lake_size(lake, key) == sizes.get(key) else [f"{named} incomplete"]

    with Poller(probe) as poller:
        saver, errors = in_background(save_loop)
        try:
            wait_for(lambda: lake_size(lake, "ckpt/latest") is not None or errors, 60,
                     "latest in the lake while saves keep coming")
        finally:
            stop.set()
            saver.join(60)
        assert not errors, errors
        sync(aifs_cli, mount.path)
    poller.check()
    assert lake.get("ckpt/latest") == (ckpt / "latest").read_bytes()


# -- 2d. staging names -------------------------------------------------------------------
def test_hf_tmp_checkpoint_reaches_the_lake_only_under_its_final_name(lake, mounter,
                                                                     aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2")
    out = mount.path / "out"
    tmp = out / "tmp-checkpoint-5"
    files = {"model.safetensors": data_of(40, 3 * MiB), "optimizer.pt": data_of(41, 2 * MiB),
             "trainer_state.json": b'{"global_step": 5}'}
    seen, poller = keys_seen(lake)
    with poller:
        os.makedirs(tmp)
        for name, data in files.items():
            write_all(tmp / name, data)
        # a file written after them: once it is in the lake, they would be too
        # if they were not held back
        (out / "log.txt").write_bytes(b"saved 5")
        wait_for(lambda: lake_size(lake, "out/log.txt") == 7, 30, "out/log.txt in the lake")
        rounds = poller.rounds
        wait_for(lambda: poller.rounds > rounds + 2, 30, "the poller to look again")
        os.rename(tmp, out / "checkpoint-5")
        sync(aifs_cli, mount.path)
    poller.check()
    got, _ = lake_tree(lake, "out/checkpoint-5/")
    assert got == files
    leaked_files = sorted(k for k in seen if "tmp-checkpoint-5" in k and not k.endswith("/"))
    assert not leaked_files, f"staging files reached the lake: {leaked_files}"
    leaked = sorted(k for k in seen if "tmp-checkpoint-5" in k)
    assert not leaked, f"the staging directory reached the lake: {leaked}"
    assert not [k for k in lake_keys(lake) if "tmp-checkpoint-5" in k]


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_staging_file_is_promoted_after_the_hold(lake, mounter):
    hold = 1.5
    mount = mounter(lake, "--promote-delay", "0.2", "--staging-hold", str(hold))
    os.makedirs(mount.path / "ckpt")
    data = data_of(50, MiB)
    write_all(mount.path / "ckpt" / "x.tmp", data)
    closed = time.monotonic()
    wait_for(lambda: lake_size(lake, "ckpt/x.tmp") == len(data), 30,
             "a never-renamed staging file in the lake after the hold")
    waited = time.monotonic() - closed
    assert waited >= hold - 0.3, f"promoted {waited:.2f}s after close, before the hold"
    assert lake.get("ckpt/x.tmp") == data


def test_sync_promotes_a_held_staging_file_at_once(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2")  # the default hold: 300 s
    os.makedirs(mount.path / "ckpt")
    (mount.path / "ckpt" / "y.tmp").write_bytes(b"held")
    started = time.monotonic()
    sync(aifs_cli, mount.path / "ckpt" / "y.tmp", timeout=60)
    assert time.monotonic() - started < 30
    assert lake.get("ckpt/y.tmp") == b"held"


# -- 2e. deleting checkpoints ------------------------------------------------------------
def test_checkpoint_deleted_before_promotion_never_reaches_the_lake(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "30")
    step = mount.path / "ckpt" / "global_step1"
    seen, poller = keys_seen(lake)
    with poller:
        os.makedirs(step)
        write_all(step / "a.pt", data_of(60, MiB))
        write_all(step / "b.pt", data_of(61, 3 * MiB))
        (mount.path / "ckpt" / "latest").write_bytes(b"global_step1")
        shutil.rmtree(step)
        os.unlink(mount.path / "ckpt" / "latest")
        sync(aifs_cli, mount.path)
    poller.check()
    leaked = sorted(k for k in seen if k.startswith(("ckpt/global_step1", "ckpt/latest")))
    assert not leaked, f"a deleted, never promoted checkpoint reached the lake: {leaked}"
    assert set(lake_keys(lake)) <= {"ckpt/"}
    assert lake_uploads(lake) == []


def test_streamed_checkpoint_deleted_right_after_close_leaves_nothing(lake, mounter,
                                                                     aifs_cli):
    """Deleted the moment it closed, while its streamed upload is being completed
    (or about to be): after sync neither the object nor an upload is left."""
    mount = mounter(lake, "--promote-delay", "30", *STREAMING)
    step = mount.path / "ckpt" / "global_step1"
    os.makedirs(step)
    write_all(step / "b.pt", data_of(62, 8 * MiB))  # parts of 5 + 3 MiB
    shutil.rmtree(step)
    sync(aifs_cli, mount.path)
    wait_for(lambda: not lake_uploads(lake), 5, "the upload of the deleted b.pt gone")
    assert not [k for k in lake_keys(lake) if k.startswith("ckpt/global_step1")]


def test_streamed_checkpoint_renamed_right_after_close_leaves_no_upload(lake, mounter,
                                                                       aifs_cli):
    mount = mounter(lake, "--promote-delay", "30", *STREAMING)
    ckpt = mount.path / "ckpt"
    os.makedirs(ckpt)
    data = data_of(63, 8 * MiB)
    write_all(ckpt / "model.pt", data)
    os.rename(ckpt / "model.pt", ckpt / "model-step5.pt")
    sync(aifs_cli, mount.path)
    assert lake_digest(lake, "ckpt/model-step5.pt") == digest(data)
    assert "ckpt/model.pt" not in lake_keys(lake)
    wait_for(lambda: not lake_uploads(lake), 5, "no upload left under either name")


def test_streamed_checkpoint_is_completed_at_close_whatever_the_delay(lake, mounter):
    """Its parts are in the lake already: close completes it, no promote delay."""
    mount = mounter(lake, "--promote-delay", "3600", *STREAMING)
    os.makedirs(mount.path / "ckpt")
    data = data_of(64, 12 * MiB)
    write_all(mount.path / "ckpt" / "model.pt", data)
    wait_for(lambda: lake_size(lake, "ckpt/model.pt") == len(data), 20,
             "the streamed checkpoint completed after close")
    assert lake_digest(lake, "ckpt/model.pt") == digest(data)


def test_deleting_a_promoted_checkpoint_removes_it_from_the_lake(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "0.2")
    ckpt = mount.path / "ckpt"
    for step in (1, 2):
        os.makedirs(ckpt / f"checkpoint-{step}")
        write_all(ckpt / f"checkpoint-{step}" / "model.pt", data_of(70 + step, 2 * MiB))
        (ckpt / f"checkpoint-{step}" / "trainer_state.json").write_bytes(b"{}")
    sync(aifs_cli, mount.path)
    assert lake_size(lake, "ckpt/checkpoint-1/model.pt") == 2 * MiB
    shutil.rmtree(ckpt / "checkpoint-1")
    sync(aifs_cli, mount.path)
    assert not [k for k in lake_keys(lake) if k.startswith("ckpt/checkpoint-1")]
    files, _ = lake_tree(lake, "ckpt/")
    assert sorted(files) == ["checkpoint-2/model.pt", "checkpoint-2/trainer_state.json"]


# -- 2f. user.aifs.state ---------------------------------------------------------------------
def test_state_xattr_of_a_checkpoint_directory(lake, mounter, aifs_cli):
    mount = mounter(lake, "--promote-delay", "30", "--promote-workers", "1",
                    "--parts-in-flight", "1", *STREAMING)
    ckpt = mount.path / "ckpt"
    step = ckpt / "checkpoint-3"
    os.makedirs(step)
    files = {"model.pt": data_of(80, 12 * MiB), "optimizer.pt": data_of(81, 3 * MiB),
             "trainer_state.json": b"{}"}
    for name, data in files.items():
        write_all(step / name, data)
    total = sum(len(d) for d in files.values())

    for path in (step, ckpt, step / "optimizer.pt"):
        word, done, pending = state_of(path)
        assert word in ("local", "promoting"), (path, word)
        if word == "promoting":
            assert pending == (total if path.is_dir() else 3 * MiB), (path, pending)
    assert state_of(step / "trainer_state.json")[0] == "local"

    # what may still be pending while it promotes: the sizes of some of the files
    sizes = [len(d) for d in files.values()]
    totals = {sum(s for i, s in enumerate(sizes) if mask >> i & 1)
              for mask in range(1, 1 << len(sizes))}
    seen: list[tuple[str, int | None, int | None]] = []

    def probe() -> list[str]:
        value = state_of(step)
        seen.append(value)
        word, done, pending = value
        if word == "promoting" and not (pending in totals and 0 < done <= pending):
            return [f"state {value}: not a pending total of {sizes}"]
        return []

    with Poller(probe, interval=0.005) as poller:
        sync(aifs_cli, mount.path)
    poller.check(min_rounds=1)
    for path in (step, ckpt, mount.path, *(step / n for n in files)):
        assert state_of(path)[0] == "lake", path

    (step / "optimizer.pt").unlink()
    # Deletes are not delayed: the promoter may have made it before the state
    # is asked. "lake" must then be true of the lake; else a delete is pending.
    if state_of(step)[0] == "lake":
        assert "ckpt/checkpoint-3/optimizer.pt" not in lake_keys(lake)
    sync(aifs_cli, mount.path)
    assert state_of(step)[0] == "lake"
    assert "ckpt/checkpoint-3/optimizer.pt" not in lake_keys(lake)


@pytest.mark.parametrize("lake", ["local"], indirect=True)  # mount-side logic only
def test_state_of_a_checkpoint_being_streamed(lake, mounter):
    """While a checkpoint file is streamed (still open), the state of its
    directory shows the bytes the lake already has."""
    mount = mounter(lake, "--promote-delay", "30", *STREAMING)
    step = mount.path / "ckpt" / "checkpoint-1"
    os.makedirs(step)
    data = data_of(90, 16 * MiB)
    fd = os.open(step / "model.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for offset in range(0, 12 * MiB, MiB):
            os.write(fd, data[offset:offset + MiB])

        def promoting() -> tuple | None:
            value = state_of(step)
            return value if value[0] == "promoting" else None
        word, done, pending = wait_for(promoting, 5, "state 'promoting D/T' while streamed")
        assert 5 * MiB <= done <= pending, (done, pending)
        assert pending == 12 * MiB, pending
        assert state_of(step / "model.pt")[0] == "promoting"
    finally:
        os.close(fd)


# -- 2g. retention -------------------------------------------------------------------------
RETENTION = ("--cache-size", "96M", "--checkpoint-keep", "2", "--promote-delay", "0.2")


def _save_checkpoints(mount, aifs_cli) -> dict[int, list[Path]]:
    """checkpoint-1 .. checkpoint-4, 16 MiB each in two files, each promoted before
    the next is saved."""
    saved: dict[int, list[Path]] = {}
    for step in range(1, 5):
        directory = mount.path / "ckpt" / f"checkpoint-{step}"
        os.makedirs(directory)
        saved[step] = []
        for part, name in enumerate(("model.pt", "optimizer.pt")):
            write_all(directory / name, data_of(100 + 10 * step + part, 8 * MiB))
            saved[step].append(directory / name)
        sync(aifs_cli, mount.path)
        for path in saved[step]:
            assert cached_bytes(path) == 8 * MiB, path
    return saved


def test_retention_keeps_the_newest_checkpoints_when_writes_need_room(lake, mounter,
                                                                      aifs_cli):
    mount = mounter(lake, *RETENTION)
    saved = _save_checkpoints(mount, aifs_cli)
    # other data, promoted after the checkpoints: plain LRU would keep it over them
    os.makedirs(mount.path / "data")
    write_all(mount.path / "data" / "recent.dat", data_of(200, 8 * MiB))
    sync(aifs_cli, mount.path)
    assert cached_bytes(mount.path / "data" / "recent.dat") == 8 * MiB
    # 64 MiB checkpoints + 8 MiB recent + 64 MiB new data > 96 MiB: 40 MiB must go
    write_all(mount.path / "data" / "new.dat", data_of(201, 64 * MiB))
    cached = {step: [cached_bytes(p) for p in paths] for step, paths in saved.items()}
    assert cached[4] == [8 * MiB, 8 * MiB] and cached[3] == [8 * MiB, 8 * MiB], cached
    assert cached[1] == [0, 0] and cached[2] == [0, 0], cached
    assert cached_bytes(mount.path / "data" / "recent.dat") == 0
    # evicted copies still read back (from the lake)
    assert saved[1][0].read_bytes() == data_of(110, 8 * MiB)
    sync(aifs_cli, mount.path)


def test_retention_keeps_the_newest_checkpoints_when_reads_need_room(lake, mounter,
                                                                     aifs_cli):
    """Reading a large lake file needs cache room too: the older checkpoints'
    clean local copies should be what makes it, not the data being read."""
    big = data_of(300, 64 * MiB)  # 64 MiB of checkpoints + 64 MiB read > 96 MiB
    lake.put("data/train.tar", big)
    mount = mounter(lake, *RETENTION)
    saved = _save_checkpoints(mount, aifs_cli)
    with open(mount.path / "data" / "train.tar", "rb") as fp:
        assert digest(fp.read()) == digest(big)
    cached = {step: [cached_bytes(p) for p in paths] for step, paths in saved.items()}
    assert cached[4] == [8 * MiB, 8 * MiB] and cached[3] == [8 * MiB, 8 * MiB], cached
    assert cached[1] == [0, 0] and cached[2] == [0, 0], \
        f"old checkpoints kept while a read needed room: {cached}"
    # and much of what was read is cached, in the room the old checkpoints left
    # (how much exactly depends on the read-ahead windows in flight while the
    # room was made: 40 to 64 MiB; without that room it would be 32 at most)
    assert cached_bytes(mount.path / "data" / "train.tar") > 32 * MiB
