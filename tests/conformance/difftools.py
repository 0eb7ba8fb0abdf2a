"""Differential running: a case is a function of a directory; it runs on aifs
and on tmpfs, and what it returns (or the errno it raises) must be the same."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def outcome(case: Callable[[Path], Any], root: Path) -> Any:
    try:
        return ("ok", case(root))
    except OSError as exc:
        return ("errno", exc.errno and os.strerror(exc.errno), exc.errno)


def both(sides, case: Callable[[Path], Any]) -> Any:
    """Run ``case`` on aifs and on tmpfs; assert equal outcomes; return it."""
    fuse, ref = sides
    expected = outcome(case, ref.path)
    got = outcome(case, fuse.path)
    assert got == expected, f"aifs: {got!r}\ntmpfs: {expected!r}"
    return got


def fresh_stat(mount, path: Path) -> os.stat_result:
    """``path``'s attributes as a new process sees them after the kernel's
    caches of the mount are dropped (they must come from aifs again)."""
    subprocess.run(["sync"], check=False)
    with open("/proc/sys/vm/drop_caches", "w") as fp:
        fp.write("2")
    return os.lstat(path)


def as_user(uid: int, gid: int, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python ``code`` as ``uid``:``gid`` (no supplementary groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                           sys.executable, "-c", code, *args],
                          capture_output=True, text=True, timeout=60)
