"""fsx-style random operations: a seeded sequence of file operations applied, one by
one, to a tree on an aifs mount and to a reference tree on the local disk (Linux is
the reference), with every result compared, errno included.

The operations: pwrite at random offsets (past EOF too, leaving holes), truncate
and ftruncate to random sizes (grow and shrink), reads at random offsets and
lengths (pread and read at the file position), append (O_APPEND), create and
unlink, rename (files, over an existing file, directories, into a subdirectory,
over a non-empty directory), mkdir and rmdir, stat and listdir, lseek, fsync, and
file descriptors kept open across many operations (open with assorted flags, their
files renamed or unlinked under them). Now and then the mount is unmounted and
mounted again on the same cache directory, and less often, once every change is
in the lake (``user.aifs.sync``) and the lake holds the reference tree, on an
EMPTY cache directory (a fresh node). Every ``compare_every`` operations, after
each remount and at the end, both trees are compared completely (names, types,
sizes, content).

A mismatch reports the seed, the operation's index and the last operations; the
whole sequence is in ``fsx-<seed>.ops.jsonl`` next to the test's mount logs, and
``AIFS_FSX_REPLAY=that-file`` replays it exactly (test_fsx_replay).

Knobs: AIFS_FSX_SEEDS ("1,2,3") and AIFS_FSX_OPS (3000) for the default run;
AIFS_FSX_SLOW_SEEDS ("11,12"; "11,12,13,14,15" for a longer run) and AIFS_FSX_SLOW_OPS
(20000) for the slow one.
"""

from __future__ import annotations

import collections
import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from fsxops import (
    FRESH,
    LOG_TAIL,
    OPS_TABLE,
    REMOUNT,
    TREE,
    Generator,
    Side,
    digest,
    explain,
    op_close,
    outcome,
    scan,
    show,
    snapshot,
    tree_differences,
)
from support.lakes import lake_tree

# Mount options per lake kind: promotion at once (uploads race the next operations)
# on the local lake, batched on moto; packs put soon; multipart from 5 MiB.
MOUNT_ARGS = {
    "local": ["--promote-delay", "0", "--pack-wait", "0.3",
              "--multipart-threshold", "5M", "--part-size", "5M"],
    "moto": ["--promote-delay", "0.2", "--pack-wait", "0.5",
             "--multipart-threshold", "5M", "--part-size", "5M"],
    "ceph": ["--promote-delay", "0.2", "--pack-wait", "0.5",
             "--multipart-threshold", "5M", "--part-size", "5M"],
}


def _ints(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).replace(",", " ").split()]


SEEDS = _ints("AIFS_FSX_SEEDS", "1,2,3")
OPS = int(os.environ.get("AIFS_FSX_OPS", "3000"))
SLOW_SEEDS = _ints("AIFS_FSX_SLOW_SEEDS", "11,12")
SLOW_OPS = int(os.environ.get("AIFS_FSX_SLOW_OPS", "20000"))


# -- the harness ----------------------------------------------------------------------------
class Mismatch(AssertionError):
    pass


class Fsx:
    def __init__(self, lake, mounter, workdir: Path, seed: int, mount_args: Sequence[str],
                 compare_every: int, check_lake: bool = True) -> None:
        self.lake = lake
        self.mounter = mounter
        self.seed = seed
        self.mount_args = list(mount_args)
        self.compare_every = compare_every
        self.check_lake = check_lake
        ref = workdir / f"ref-{seed}"
        ref.mkdir()
        self.ref = Side("ref", ref)
        self.mounts = 0
        self.cache = f"s{seed}-c0"
        self.mount = mounter(lake, *self.mount_args, name=f"s{seed}-m0", cache=self.cache)
        os.mkdir(self.mount.path / TREE)
        self.aifs = Side("aifs", self.mount.path / TREE)
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self.log_path = workdir / f"fsx-{seed}.ops.jsonl"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.counts: collections.Counter[str] = collections.Counter()
        self.index = -1
        self.times = {"remount": 0.0, "fresh": 0.0, "compare": 0.0}

    def fail(self, what: str) -> None:
        self.log.flush()
        tail = "\n".join(self.tail)
        raise Mismatch(f"fsx seed {self.seed}, op #{self.index}: {what}\n"
                       f"last {len(self.tail)} operations (index op -> reference outcome):\n"
                       f"{tail}\nall operations: {self.log_path} "
                       f"(replay: AIFS_FSX_REPLAY={self.log_path}); aifs log: {self.mount.log}")

    def apply(self, op: list) -> None:
        self.index += 1
        self.log.write(json.dumps(op) + "\n")
        self.counts[op[0]] += 1
        if op[0] == REMOUNT:
            self.tail.append(f"#{self.index} {op}")
            return self.remount(fresh=False)
        if op[0] == FRESH:
            self.tail.append(f"#{self.index} {op}")
            return self.remount(fresh=True)
        fn = OPS_TABLE[op[0]]
        expected = outcome(lambda: fn(self.ref, *op[1:]))
        self.tail.append(f"#{self.index} {op} -> {show(expected)}")
        got = outcome(lambda: fn(self.aifs, *op[1:]))
        if got != expected:
            self.fail(f"{op}: {explain(expected, got)}")
        if set(self.ref.fds) != set(self.aifs.fds):  # cannot happen when outcomes agree
            self.fail(f"open slots differ: {sorted(self.ref.fds)} {sorted(self.aifs.fds)}")
        if self.compare_every and (self.index + 1) % self.compare_every == 0:
            self.compare("periodic comparison")
        return None

    def compare(self, when: str) -> None:
        started = time.monotonic()
        differences = tree_differences(self.ref.root, self.aifs.root)
        self.times["compare"] += time.monotonic() - started
        if differences:
            self.fail(f"{when}: the trees differ:\n  " + "\n  ".join(differences))

    def close_fds(self) -> None:
        for slot in sorted(self.ref.fds.keys() | self.aifs.fds.keys()):
            expected = outcome(lambda s=slot: op_close(self.ref, s))
            got = outcome(lambda s=slot: op_close(self.aifs, s))
            if got != expected:
                self.fail(f"close of slot {slot} before a remount: {explain(expected, got)}")

    def remount(self, fresh: bool) -> None:
        started = time.monotonic()
        self.close_fds()
        self.compare("before the remount")
        self.mounts += 1
        if fresh:
            os.getxattr(self.mount.path, "user.aifs.sync")
            if self.check_lake:
                self.compare_lake()
            self.cache = f"s{self.seed}-c{self.mounts}"
        self.mount.unmount()
        self.mount = self.mounter(self.lake, *self.mount_args,
                                  name=f"s{self.seed}-m{self.mounts}", cache=self.cache)
        self.aifs.root = self.mount.path / TREE
        self.times["fresh" if fresh else "remount"] += time.monotonic() - started
        self.compare("after a remount on an empty cache" if fresh
                     else "after a remount on the same cache")

    def compare_lake(self) -> None:
        """After user.aifs.sync: the lake holds the reference tree."""
        files, dirs = lake_tree(self.lake, TREE + "/")
        expected = snapshot(self.ref.root)
        found = {path: ("dir",) for path in dirs}
        found.update({path: ("file", len(c), digest(c), len(c)) for path, c in files.items()})
        if found != expected:
            lines = [f"{p}: lake {found.get(p)}, expected {expected.get(p)}"
                     for p in sorted(found.keys() | expected.keys())
                     if found.get(p) != expected.get(p)]
            self.fail("after user.aifs.sync the lake differs from the reference:\n  "
                      + "\n  ".join(lines))

    def close(self) -> None:
        self.log.close()
        for side in (self.ref, self.aifs):
            try:
                side.close_all()
            except OSError:
                pass

    def run(self, ops: int, gen: Generator) -> None:
        for _ in range(ops):
            files, dirs = scan(self.ref.root)
            slots = {slot: (self._fd_path(slot), stat.S_ISDIR(os.fstat(fd).st_mode))
                     for slot, fd in self.ref.fds.items()}
            self.apply(gen.next(files, dirs, slots))
        self.finish()

    def replay(self, ops: list[list]) -> None:
        for op in ops:
            self.apply(op)
        self.finish()

    def finish(self) -> None:
        self.index += 1
        self.tail.append(f"#{self.index} (end: close every fd, compare)")
        self.close_fds()
        self.compare("at the end")

    def _fd_path(self, slot: int) -> str:
        """The reference file a slot has open (to size its operations), or ''."""
        try:
            target = os.readlink(f"/proc/self/fd/{self.ref.fds[slot]}")
        except OSError:
            return ""
        root = str(self.ref.root) + "/"
        return target[len(root):] if target.startswith(root) else ""


def run_fsx(lake, mounter, tmp_path: Path, seed: int, ops: int, *,
            remount_every: int, fresh_every: int, compare_every: int) -> None:
    started = time.monotonic()
    fsx = Fsx(lake, mounter, tmp_path, seed, MOUNT_ARGS[lake.kind], compare_every)
    try:
        fsx.run(ops, Generator(seed, remount_every, fresh_every))
    finally:
        fsx.close()
    elapsed = time.monotonic() - started
    times = ", ".join(f"{k} {v:.1f} s" for k, v in fsx.times.items())
    print(f"fsx {lake.kind} seed {seed}: {ops} ops in {elapsed:.1f} s ({times}); "
          f"{fsx.counts[REMOUNT]} remounts, {fsx.counts[FRESH]} on an empty cache; "
          f"ops: {dict(sorted(fsx.counts.items()))}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("lake", ["local", "moto"], indirect=True)
def test_fsx(lake, mounter, tmp_path, seed):
    run_fsx(lake, mounter, tmp_path, seed, OPS, remount_every=1000, fresh_every=2000,
            compare_every=250)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_fsx_long(lake, mounter, tmp_path, seed):
    run_fsx(lake, mounter, tmp_path, seed, SLOW_OPS, remount_every=4000, fresh_every=8000,
            compare_every=500)


@pytest.mark.skipif(not os.environ.get("AIFS_FSX_REPLAY"),
                    reason="set AIFS_FSX_REPLAY to an fsx-<seed>.ops.jsonl to replay it")
@pytest.mark.parametrize("lake", ["local", "moto"], indirect=True)
def test_fsx_replay(lake, mounter, tmp_path):
    """Replays a recorded sequence of operations, comparing after each."""
    with open(os.environ["AIFS_FSX_REPLAY"]) as fp:
        ops = [json.loads(line) for line in fp if line.strip()]
    fsx = Fsx(lake, mounter, tmp_path, 0, MOUNT_ARGS[lake.kind],
              int(os.environ.get("AIFS_FSX_COMPARE_EVERY", "1")))
    try:
        fsx.replay(ops)
    finally:
        fsx.close()
