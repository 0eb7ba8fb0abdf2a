"""Crash tests of checkpoint-aware promotion with real PyTorch.

Each test saves a checkpoint into a mount from its own process, the way a
framework does: torch.save (also through ``x.pt.tmp`` and a rename),
torch.distributed.checkpoint save and async_save, DeepSpeed (``global_stepN/``
then ``latest``, two steps), the HF Trainer (``tmp-checkpoint-N/`` renamed to
``checkpoint-N/``, ``trainer_state.json`` inside). The daemon is SIGKILLed while
the checkpoint is being promoted; a new mount over the same cache directory
recovers and ``aifs sync`` waits for the lake; then a mount with an empty cache
loads the checkpoint in another process, and every tensor must equal the one
saved (regenerated there from its seed).

A poller thread LISTs the lake directly (boto3, or the local lake's directory)
all along, before and after the kill, and checks the commit invariant: a marker
in the lake means every file of the checkpoint it commits is in the lake,
complete. Each marker it sees (``latest`` read for the step it names) is
checked against the poller's next LIST, made after it (shards are never
deleted, so they must be there): every file with its exact final size, and the
first time a marker version is seen, its exact bytes. No file is ever seen with
another size, and no key under a staging name (``tmp-checkpoint-*``, ``*.tmp``)
ever appears.

The saver first saves the same state dicts outside the mount: torch.save and DCP
shards are byte-for-byte deterministic, so that copy gives every file's final
size and digest (but DCP's ``.metadata``, which names its own path: its bytes
are read from the recovered mount).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.lakes import HEAVY_LAKES, lake_sizes, lake_upload_parts, lake_uploads
from support.mounts import file_digest, wait_for
from support.packed import lake_digest

MiB = 1 << 20

# The saver and loader: ``save SCENARIO REF`` saves into REF (outside the mount),
# prints "ref", reads the directory to save into from stdin (the mount) and
# prints "done" once every file there is closed; ``load SCENARIO`` prints
# "ready", reads the directory to load from from stdin, loads and compares every
# tensor with state dicts regenerated from their seeds, and prints "loaded N"
# (N tensors). Both start before their mount is up: importing torch takes seconds.
# The HF saver prints "paused" before its rename and goes on at the next line.
SCRIPT = r'''
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

MiB = 1 << 20


def tensors(seed, sizes_mib, prefix="layer"):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, mib in enumerate(sizes_mib):
        rows = mib * MiB // 4 // 1024
        out[f"{prefix}{i}.weight"] = torch.randn(rows, 1024, generator=g)
    out[f"{prefix}.bias"] = torch.randn(1024, generator=g).to(torch.bfloat16)
    out[f"{prefix}.index"] = torch.randint(0, 1 << 40, (4096,), generator=g)
    return out


def model(seed, sizes_mib):
    return tensors(seed, sizes_mib)


def optim(seed, sizes_mib):
    return {"state": {"exp_avg": tensors(seed, sizes_mib, "m"),
                      "exp_avg_sq": tensors(seed + 1000, sizes_mib, "v")},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "step": seed}]}


def dcp_state(seed):
    return {"model": tensors(seed, [3, 3, 3, 3, 3, 3]), "step": seed}


DS_STEPS = (1, 2)
HF_STEP = 3


def expected(scenario):
    """relative path -> what loading it must give."""
    if scenario == "torch_save":
        rng = torch.Generator().manual_seed(3)
        return {"torch/model.pt": model(1, [6, 6, 4]),
                "torch/optim.pt": optim(2, [4, 3]),
                "torch/extra.pth": {"rng": torch.randn(1000, generator=rng), "epoch": 3}}
    if scenario == "dcp":
        return {"dcp/step-1": dcp_state(11), "dcp/step-2": dcp_state(12)}
    if scenario == "deepspeed":
        step = DS_STEPS[-1]
        return {f"ds/global_step{step}/mp_rank_00_model_states.pt": model(20 + step, [6, 4]),
                f"ds/global_step{step}/zero_pp_rank_0_mp_rank_00_optim_states.pt":
                    optim(30 + step, [3, 2])}
    if scenario == "hf":
        d = f"hf/checkpoint-{HF_STEP}"
        return {f"{d}/pytorch_model.bin": model(40, [6, 6]),
                f"{d}/optimizer.pt": optim(41, [4, 4]),
                f"{d}/scheduler.pt": {"last_epoch": HF_STEP, "_last_lr": [1e-3]},
                f"{d}/rng_state.pth": {"cpu": torch.Generator().manual_seed(42).get_state()}}
    raise ValueError(scenario)


def trainer_state():
    return json.dumps({"global_step": HF_STEP, "epoch": 0.5, "log_history": []}, indent=2)


def save(scenario, root, pause=lambda: None):
    if scenario == "torch_save":
        files = expected(scenario)
        os.makedirs(os.path.join(root, "torch"), exist_ok=True)
        torch.save(files["torch/model.pt"], os.path.join(root, "torch/model.pt"))
        tmp = os.path.join(root, "torch/optim.pt.tmp")  # the write-then-rename idiom
        torch.save(files["torch/optim.pt"], tmp)
        os.replace(tmp, os.path.join(root, "torch/optim.pt"))
        torch.save(files["torch/extra.pth"], os.path.join(root, "torch/extra.pth"))
    elif scenario == "dcp":
        states = expected(scenario)
        dcp.save(states["dcp/step-1"], storage_writer=FileSystemWriter(
            os.path.join(root, "dcp/step-1"), thread_count=3))
        writer = FileSystemWriter(os.path.join(root, "dcp/step-2"), thread_count=3)
        if hasattr(dcp, "async_save"):
            dcp.async_save(states["dcp/step-2"], storage_writer=writer).result()
        else:
            dcp.save(states["dcp/step-2"], storage_writer=writer)
    elif scenario == "deepspeed":
        for step in DS_STEPS:
            tag = f"global_step{step}"
            d = os.path.join(root, "ds", tag)
            os.makedirs(d, exist_ok=True)
            torch.save(model(20 + step, [6, 4]), os.path.join(d, "mp_rank_00_model_states.pt"))
            torch.save(optim(30 + step, [3, 2]),
                       os.path.join(d, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
            with open(os.path.join(root, "ds", "latest"), "w") as fp:  # as DeepSpeed does
                fp.write(tag)
    elif scenario == "hf":
        tmp = os.path.join(root, "hf", f"tmp-checkpoint-{HF_STEP}")
        os.makedirs(tmp)
        files = {os.path.basename(path): value for path, value in expected(scenario).items()}
        # the Trainer's order: the model, optimizer and scheduler, the trainer state
        # (the marker), then the RNG state
        for name in ("pytorch_model.bin", "optimizer.pt", "scheduler.pt"):
            torch.save(files[name], os.path.join(tmp, name))
        with open(os.path.join(tmp, "trainer_state.json"), "w") as fp:
            fp.write(trainer_state())
        torch.save(files["rng_state.pth"], os.path.join(tmp, "rng_state.pth"))
        os.makedirs(os.path.join(root, "hf", "runs"))  # a log written meanwhile
        with open(os.path.join(root, "hf", "runs", "events.out.tfevents"), "wb") as fp:
            fp.write(bytes(range(256)) * 64)
        pause()  # saving a real checkpoint takes a while: the staged files wait
        os.rename(tmp, os.path.join(root, "hf", f"checkpoint-{HF_STEP}"))
    else:
        raise ValueError(scenario)


def same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        return sum(same(a[k], b[k], f"{where}[{k!r}]") for k in a)
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        return sum(same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, (where, a, b)
    return 0


def load(scenario, root):
    count = 0
    if scenario == "dcp":
        for name, want in expected(scenario).items():
            got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                   "step": 0}
            dcp.load(got, checkpoint_id=os.path.join(root, name))
            count += same(want, got, name)
    else:
        if scenario == "deepspeed":
            with open(os.path.join(root, "ds", "latest")) as fp:
                assert fp.read() == f"global_step{DS_STEPS[-1]}"
        if scenario == "hf":
            d = os.path.join(root, "hf", f"checkpoint-{HF_STEP}")
            with open(os.path.join(d, "trainer_state.json")) as fp:
                assert fp.read() == trainer_state()
        for name, want in expected(scenario).items():
            got = torch.load(os.path.join(root, name), weights_only=True)
            count += same(want, got, name)
    return count


mode, scenario = sys.argv[1:3]
if mode == "save":
    save(scenario, sys.argv[3])
    print("ref", flush=True)
    root = sys.stdin.readline().strip()  # the mount is up
    if scenario == "dcp":
        print("async_save" if hasattr(dcp, "async_save") else "no async_save", flush=True)

    def pause():
        print("paused", flush=True)
        sys.stdin.readline()

    save(scenario, root, pause)
    print("done", flush=True)
else:
    print("ready", flush=True)
    root = sys.stdin.readline().strip()  # the mount is up
    print("loaded", load(scenario, root), flush=True)
'''


@dataclass(frozen=True)
class Scenario:
    """Where a framework's checkpoint goes and which of its files commit what."""

    name: str
    top: str  # the directory it writes under, relative to the mount root
    self_committed: bool = False  # each file is its own marker (torch.save)
    # the saver pauses before its last step until this (later) file is in the lake:
    # the promoter has looked at everything written before it
    paused_until: str | None = None
    # the daemon is killed once the lake holds a whole "file" of the checkpoint, or
    # already once it holds a "part" of one (then the recovering mount decides alone
    # in which order every file and marker goes)
    kill_at: str = "file"

    def is_marker(self, key: str) -> bool:
        base = key.rsplit("/", 1)[-1]
        if self.self_committed:
            return base.endswith((".pt", ".pth"))
        return base in (".metadata", "latest", "trainer_state.json")

    def committed(self, marker: str, content: bytes) -> tuple[str, bool]:
        """(prefix, itself): the marker commits the checkpoint files under
        ``prefix``, or only itself."""
        if self.self_committed:
            return marker, True
        if marker.endswith("/latest"):  # DeepSpeed: the tag it names
            return marker.rsplit("/", 1)[0] + "/" + content.decode() + "/", False
        return marker.rsplit("/", 1)[0] + "/", False

    def staging_name(self, key: str) -> bool:
        return "tmp-checkpoint-" in key or key.endswith(".tmp") or ".tmp/" in key


SCENARIOS = {s.name: s for s in (
    Scenario("torch_save", "torch", self_committed=True),
    Scenario("dcp", "dcp"),
    Scenario("deepspeed", "ds", kill_at="part"),
    Scenario("hf", "hf", paused_until="hf/runs/events.out.tfevents"),
)}


# -- the lake, seen directly -----------------------------------------------------
@dataclass
class Sighting:
    """A commit marker seen in the lake, and what the next LIST showed under it."""

    marker: str
    content: bytes
    round: int
    prefix: str
    itself: bool
    sizes: dict[str, int] | None = None  # the next LIST, under prefix
    digests: dict[str, str] = field(default_factory=dict)  # once per marker version


class CommitPoller:
    """LISTs the lake in a loop; records every marker sighting with what the
    following LIST holds under the checkpoint it commits (and, the first time a
    marker version is seen, the digests of those objects), every size seen of
    every key, and every key seen."""

    def __init__(self, lake, scenario: Scenario) -> None:
        self.lake = lake
        self.scenario = scenario
        self.sightings: list[Sighting] = []
        self.sizes_seen: dict[str, set[int]] = {}
        self.first_seen: dict[str, int] = {}  # key -> the round it was first listed in
        self.errors: list[str] = []
        self.rounds = 0
        self.killed_at: int | None = None  # the round the daemon was killed in
        self._digested: set[tuple[str, bytes]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        waiting: list[Sighting] = []
        while not self._stop.is_set():
            try:
                waiting = self._round(waiting)
            except Exception as exc:  # reported by check()
                self.errors.append(repr(exc))
            self.rounds += 1
            # a marker let go early may be in the local lake for milliseconds only
            self._stop.wait(0.001 if self.lake.kind == "local" else 0.005)
        try:
            self._round(waiting, look=False)  # the last sightings get their LIST too
        except Exception as exc:
            self.errors.append(repr(exc))

    def _round(self, waiting: list[Sighting], look: bool = True) -> list[Sighting]:
        listing = lake_sizes(self.lake)
        for key, size in listing.items():
            self.sizes_seen.setdefault(key, set()).add(size)
            self.first_seen.setdefault(key, self.rounds)
        # markers seen by the previous LIST: their checkpoints must be complete in this one
        for sighting in waiting:
            sighting.sizes = {k: s for k, s in listing.items() if not k.endswith("/") and (
                k == sighting.prefix if sighting.itself else k.startswith(sighting.prefix))}
            version = (sighting.marker, sighting.content)
            if version not in self._digested:
                self._digested.add(version)
                sighting.digests = {k: lake_digest(self.lake, k) for k in sighting.sizes}
        fresh: list[Sighting] = []
        for key in sorted(listing) if look else ():
            if not self.scenario.is_marker(key):
                continue
            content = self.lake.get(key) if key.endswith("/latest") else b""
            prefix, itself = self.scenario.committed(key, content)
            fresh.append(Sighting(key, content, self.rounds, prefix, itself))
        self.sightings += fresh
        return fresh

    def settle(self, rounds: int = 2) -> None:
        """Wait until the poller has made ``rounds`` more full rounds."""
        start = self.rounds
        wait_for(lambda: self.rounds >= start + rounds + 1 or self.errors, 120,
                 "the poller to list the lake again")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def check(self, ref: dict[str, tuple[int, str]], final_markers: set[str]) -> None:
        """``ref``: each checkpoint file's final size and digest (None: not known)."""
        assert not self.errors[:5], f"the poller failed: {self.errors[:5]}"
        assert self.rounds > 10, "the poller hardly ran"
        violations: dict[str, list[int]] = {}  # what was wrong -> the rounds it was seen in
        for s in self.sightings:
            assert s.sizes is not None, f"no LIST after the sighting of {s.marker}"
            wanted = ([s.marker] if s.itself else
                      [k for k in ref if k.startswith(s.prefix) and k != s.marker])
            assert wanted, f"{s.marker} ({s.content!r}) commits no known file"
            for key in wanted:
                size, digest = ref[key]
                if s.sizes.get(key) != size:
                    wrong = f"{key} is {s.sizes.get(key)} bytes, not {size}"
                elif s.digests and digest and s.digests.get(key) != digest:
                    wrong = f"{key} has other bytes"
                else:
                    continue
                violations.setdefault(f"{s.marker} ({s.content!r}) in the lake but {wrong}",
                                      []).append(s.round)
        kill = f"the kill was in round {self.killed_at}" if self.killed_at else "no kill"
        assert not violations, (
            f"a commit marker reached the lake before its checkpoint ({kill}; "
            f"{self.rounds} rounds):\n" + "\n".join(
                f"rounds {min(r)}..{max(r)}: {what}" for what, r in violations.items()))
        seen = {s.marker for s in self.sightings}
        assert final_markers <= seen, f"markers never checked: {final_markers - seen}"
        partial = {k: sorted(sizes) for k, sizes in self.sizes_seen.items()
                   if k in ref and ref[k][0] is not None and sizes != {ref[k][0]}}
        assert not partial, f"objects seen in the lake with other sizes: {partial}"
        staged = sorted(k for k in self.sizes_seen if self.scenario.staging_name(k))
        assert not staged, f"keys under staging names reached the lake: {staged}"


# -- processes ---------------------------------------------------------------------
class Torch:
    """The script in its own process; its stdout lines are collected."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self._stderr = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", SCRIPT, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float = 120) -> str:
        """The first line starting with ``prefix``, once the script says it."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if line.startswith(prefix):
                    return line
            try:
                self.seen.append(self.lines.get(timeout=0.05))
                continue
            except queue.Empty:
                pass
            if self.proc.poll() is not None and self.lines.empty():
                raise AssertionError(f"{self.proc.args[3:]} exited ({self.proc.returncode}) "
                                     f"before {prefix!r}:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.proc.args[3:]} did not say {prefix!r} "
                                     f"in {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


def reference(ref_root: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for path in sorted(ref_root.rglob("*")):
        if path.is_file():
            out[path.relative_to(ref_root).as_posix()] = (path.stat().st_size, file_digest(path))
    return out


# Uploads slow enough to be caught in the middle: 5 MiB parts, one at a time per
# file. The first mount promotes four files at once: a small marker let go as
# soon as it is due would overtake the shard uploads in flight beside it. The
# recovering mount promotes one file at a time, in the order they became
# pending, so whatever the commit rule lets go goes at once: a marker released
# before a shard written before it (rewritten ``latest``, a marker renamed
# after a later shard) reaches the lake while that shard still waits its turn.
FIRST_MOUNT = ("--promote-delay", "0.5", "--part-size", "5M", "--multipart-threshold", "5M",
               "--parts-in-flight", "1", "--promote-workers", "4")
RECOVERY_MOUNT = (*FIRST_MOUNT[:-2], "--promote-workers", "1")


def upload_parts(lake) -> int | str:
    try:
        return lake_upload_parts(lake)
    except Exception as exc:  # an upload completed between two requests: just a report
        return repr(exc)


class Phases:
    """When each phase of a test ended, printed (pytest shows it with -s or on failure)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {what}", flush=True)


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_checkpoint_survives_a_kill_during_promotion(name, lake, mounter, aifs_cli, tmp_path):
    scenario = SCENARIOS[name]
    phase = Phases()
    ref_root = tmp_path / "ref"
    ref_root.mkdir()
    poller = CommitPoller(lake, scenario)
    saver = Torch(tmp_path / "saver.log", "save", name, str(ref_root))
    loader = None
    try:
        mount = mounter(lake, *FIRST_MOUNT, name="m1")
        saver.expect("ref")
        ref = reference(ref_root)
        # DCP's .metadata names its own path: its bytes are known from the mount, at the end
        ref = {k: (v if not k.endswith("/.metadata") else (None, None)) for k, v in ref.items()}
        assert len(ref) >= 3, ref
        assert any(scenario.is_marker(k) for k in ref), ref
        phase("reference saved")
        saver.send(str(mount.path))
        if scenario.paused_until:
            saver.expect("paused")
            wait_for(lambda: scenario.paused_until in lake_sizes(lake), 60,
                     f"{scenario.paused_until} in the lake")
            phase(f"{scenario.paused_until} in the lake")
            saver.send("go on")
        saver.expect("done")
        phase(f"saved into the mount {[w for w in saver.seen if 'async_save' in w]}")

        checkpoint = [k for k in ref if k != scenario.paused_until]

        def started() -> bool:
            if any(k in checkpoint for k in lake_sizes(lake)):
                return True
            return scenario.kill_at == "part" and upload_parts(lake) != 0

        wait_for(started, 60, f"a {scenario.kill_at} of the checkpoint in the lake",
                 interval=0.002 if lake.kind == "local" else 0.01)
        state = os.getxattr(mount.path / scenario.top, "user.aifs.state").decode()
        mount.kill()
        poller.killed_at = poller.rounds
        at_kill = lake_sizes(lake)
        phase(f"killed ({state}; in the lake: {sorted(k for k in at_kill if k in checkpoint)}, "
              f"{upload_parts(lake)} parts of unfinished uploads)")
        missing = sorted(k for k in checkpoint if k not in at_kill)
        assert missing, f"the promotion was over before the kill (no crash tested): {at_kill}"
        assert state == "local" or state.startswith("promoting "), state
        saver.proc.wait(60)
        assert saver.proc.returncode == 0, saver.log.read_text()[-3000:]
        loader = Torch(tmp_path / "loader.log", "load", name)

        # recovery: the same cache directory, then aifs sync
        again = mounter(lake, *RECOVERY_MOUNT, name="m2", cache="m1")
        result = aifs_cli("sync", str(again.path), timeout=300)
        assert result.returncode == 0, f"aifs sync failed: {result.stderr[-2000:]}"
        phase("remounted and synced")
        assert os.getxattr(again.path / scenario.top, "user.aifs.state") == b"lake"
        for key in ref:
            assert os.getxattr(again.path / key, "user.aifs.state") == b"lake", key
            policy = b"checkpoint" if key in checkpoint else b"default"
            assert os.getxattr(again.path / key, "user.aifs.policy") == policy, key
        for key, (size, _) in ref.items():
            if size is None:  # known from the recovered local copy
                ref[key] = ((again.path / key).stat().st_size, file_digest(again.path / key))
        poller.settle()
        again.unmount()
    except BaseException:
        if loader:
            loader.stop()
        raise
    finally:
        poller.stop()
        saver.stop()

    # the lake holds exactly the checkpoint, byte for byte
    listing = lake_sizes(lake)
    files = {k: v for k, v in listing.items() if not k.endswith("/")}
    assert sorted(files) == sorted(ref), "the lake holds other files than the checkpoint"
    for key, (size, digest) in ref.items():
        assert files[key] == size, key
        assert lake_digest(lake, key) == digest, f"{key}: other bytes in the lake"
    assert lake_uploads(lake) == [], "unfinished multipart uploads left in the lake"
    staged = sorted(k for k in listing if scenario.staging_name(k))
    assert not staged, f"keys under staging names left in the lake: {staged}"

    # a fresh mount, an empty cache: the checkpoint loads, every tensor equal
    try:
        fresh = mounter(lake, name="fresh")
        loader.expect("ready")
        loader.send(str(fresh.path))
        assert int(loader.expect("loaded ").split()[1]) > 0
        loader.proc.wait(60)
        assert loader.proc.returncode == 0, loader.log.read_text()[-3000:]
    finally:
        loader.stop()
    fresh.unmount()
    phase("loaded through a fresh mount")

    phase("keys by the poller round they appeared in (the kill was in round "
          f"{poller.killed_at}): {sorted(poller.first_seen.items(), key=lambda kv: kv[1])}")
    # and all along, the lake never showed a marker before its checkpoint
    poller.check(ref, {k for k in ref if scenario.is_marker(k)})
