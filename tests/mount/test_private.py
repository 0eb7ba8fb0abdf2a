"""Nothing aifs keeps is readable past its mode (issue 50): the local lake's
directories and objects, the cache directory, the LMDB store and the log are
the daemon user's alone (0700 directories, 0600 files) whatever the umask; a
lake or cache directory that already exists open to others gets one warning.
Checked as an unprivileged user, outside the mount."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from support.lakes import Lake
from support.mounts import Mount

NOBODY = 65534

#: run as ``nobody``: every path on argv opened (a directory: listed)
PROBE = """
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            out[path] = sorted(os.listdir(path))
        else:
            with open(path, "rb") as fp:
                out[path] = len(fp.read())
    except PermissionError:
        out[path] = "denied"
print(json.dumps(out))
"""


def test_nothing_aifs_keeps_is_readable_by_another_user_outside_the_mount():
    base = Path(tempfile.mkdtemp(prefix="aifs-private-", dir="/var/tmp"))
    os.chmod(base, 0o755)  # anyone may look inside: only aifs's own modes protect
    lake_root = base / "lake"
    lake_root.mkdir()
    lake_root.chmod(0o755)  # an existing lake directory open to others
    cache, log = base / "cache", base / "daemon.log"
    old = os.umask(0o022)  # the usual umask: aifs must not rely on it
    try:
        mount = Mount(Lake("local", f"file://{lake_root}", {}, [], root=lake_root),
                      base / "mnt", cache, base / "mount.log",
                      ["--log-file", str(log), "--pack-threshold", "0"])
    finally:
        os.umask(old)
    try:
        (mount.path / "secret").mkdir(mode=0o700)
        for path in (mount.path / "secret" / "f", mount.path / "top"):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"private bytes")
            os.close(fd)
        os.getxattr(mount.path, "user.aifs.sync")
        assert (lake_root / "secret" / "f").read_bytes() == b"private bytes"
    finally:
        mount.unmount()
    try:
        made = [p for root in (lake_root, cache) for p in root.rglob("*")] + [cache, log]
        assert made
        wide = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made
                if stat.S_IMODE(p.stat().st_mode) & 0o077}
        assert wide == {}
        probes = [lake_root / "secret", lake_root / "secret" / "f", lake_root / "top",
                  cache, cache / "meta" / "data.mdb", log]
        seen = json.loads(subprocess.run(
            ["/usr/bin/python3", "-c", PROBE, *map(str, probes)], user=NOBODY, check=True,
            capture_output=True, text=True).stdout)
        assert seen == {str(p): "denied" for p in probes}
        said = (base / "mount.log").read_text() + log.read_text()
        warned = [line for line in said.splitlines() if "open to other users" in line]
        assert len(warned) == 1 and str(lake_root) in warned[0], warned
    finally:
        shutil.rmtree(base, ignore_errors=True)
