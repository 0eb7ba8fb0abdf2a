"""A cache disk that fills up: the cache directory on a small tmpfs of its own.

What must hold: reads keep working; a writer waits while promotion makes room,
and gets ENOSPC (never EIO) only when what is not in the lake yet fills the
disk; creates and deletes keep working (the metadata has its reserve); the
mount works again by itself once space returns; nothing closed is lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from support.lakes import lake_tree

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "small-disk"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(path)],
                   check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def _write(path: Path, size: int, seed: int) -> bytes:
    data = (bytes([seed]) * 4096) * (size // 4096)
    with open(path, "wb") as fp:
        for start in range(0, len(data), MiB):
            fp.write(data[start:start + MiB])
    return data


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_a_full_cache_disk_refuses_only_what_cannot_fit_and_recovers(lake, mounter,
                                                                     small_disk):
    mount = mounter(lake, "--promote-delay", "0", "--cache-size", "10G",
                    "--cache-dir", str(small_disk / "cache"))  # (the last --cache-dir wins)
    root = mount.path
    kept = _write(root / "kept.bin", 5 * MiB, 1)
    # Written and closed one after the other: each fits once the one before is
    # in the lake and its copy evicted, though together they exceed the disk.
    firsts = {f"closed{i}.bin": _write(root / f"closed{i}.bin", 40 * MiB, 10 + i)
              for i in range(3)}
    # One open file larger than the free disk: refused with ENOSPC, not EIO.
    with pytest.raises(OSError) as refused:
        _write(root / "too-big.bin", 200 * MiB, 2)
    assert refused.value.errno == errno.ENOSPC
    # Creates, reads and deletes go on. (The refused file keeps what it has,
    # as on ext4, but is not published: test_a_file_whose_write_failed_...)
    (root / "empty").touch()
    assert (root / "kept.bin").read_bytes() == kept
    os.unlink(root / "too-big.bin")  # space returns
    (root / "small.txt").write_bytes(b"still works")
    again = _write(root / "after.bin", 30 * MiB, 3)  # no restart needed
    assert (root / "after.bin").read_bytes() == again
    mount.unmount()
    files, _ = lake_tree(lake)
    assert files["kept.bin"] == kept and files["after.bin"] == again
    assert files["small.txt"] == b"still works"
    for name, data in firsts.items():
        assert files[name] == data, name


@pytest.mark.parametrize("lake", ["local"], indirect=True)
def test_a_file_whose_write_failed_is_not_published(lake, mounter, small_disk, aifs_cli):
    """The writer saw ENOSPC, so what the file holds is not what it meant to
    write: as after a crash, the lake keeps the last published version and the
    next mount moves the bytes to the recovery directory. A file written
    again from nothing after the error is published as usual."""
    cache = small_disk / "cache"
    args = ("--promote-delay", "0", "--cache-size", "10G", "--cache-dir", str(cache))
    mount = mounter(lake, *args)
    root = mount.path
    first = _write(root / "model.bin", 4 * MiB, 1)
    assert aifs_cli("sync", str(root), "--quiet").returncode == 0
    # Failed, then written again from size 0 once space is back: published.
    with pytest.raises(OSError) as refused:
        _write(root / "retried.bin", 200 * MiB, 2)
    assert refused.value.errno == errno.ENOSPC
    retried = _write(root / "retried.bin", 8 * MiB, 3)
    # Failed and left so: not published.
    with pytest.raises(OSError) as refused:
        _write(root / "model.bin", 200 * MiB, 4)
    assert refused.value.errno == errno.ENOSPC
    result = aifs_cli("sync", str(root))
    assert result.returncode != 0 and "a write failed" in result.stderr, result.stderr
    files, _ = lake_tree(lake)
    assert files["model.bin"] == first and files["retried.bin"] == retried
    mount.unmount()
    files, _ = lake_tree(lake)
    assert files["model.bin"] == first and files["retried.bin"] == retried
    again = mounter(lake, *args, name="again")
    assert (again.path / "model.bin").read_bytes() == first
    assert (again.path / "retried.bin").read_bytes() == retried
    kept = list((cache / "recovered").glob("*/model.bin"))
    assert len(kept) == 1 and kept[0].stat().st_size > 0
    status = aifs_cli("status", str(again.path))
    assert "recovered" in status.stdout and "1 file" in status.stdout, status.stdout


def _sync_refused(mount, lake, name: str, size: int, expected: int,
                  aifs_cli) -> tuple[bytes, str]:
    """Write ``name`` and sync it into a lake that refuses it: the xattr's
    errno is ``expected``, `aifs sync` fails in one line (returned), nothing
    shows in the lake, the file reads back here. Returns its bytes too."""
    from aifs import xattrs

    data = os.urandom(size)
    (mount.path / name).write_bytes(data)
    with pytest.raises(OSError) as refused:
        os.getxattr(mount.path / name, xattrs.SYNC)
    assert refused.value.errno == expected
    result = aifs_cli("sync", str(mount.path), "--quiet")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert name not in lake_tree(lake)[0]
    assert (mount.path / name).read_bytes() == data
    return data, result.stderr


def test_a_full_lake_is_said_to_be_full_and_loses_nothing(mounter, small_disk, aifs_cli):
    """The lake itself has no room (here a local lake on a 16 MiB disk; a
    spent Ceph quota or a full MinIO answers the same): `aifs sync` fails
    with ENOSPC and one line that says so, not EIO; no partial object shows
    in the lake; the file stays readable here; once the lake has room again
    the next sync puts it there whole."""
    from support.lakes import Lake

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)
    lake = Lake("local", f"file://{small_disk / 'lake'}", {}, [], root=small_disk / "lake")
    (small_disk / "lake").mkdir()
    mount = mounter(lake, "--promote-delay", "3600")
    data, said = _sync_refused(mount, lake, "big.bin", 24 * MiB, errno.ENOSPC, aifs_cli)
    assert "No space left on device" in said
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    assert aifs_cli("sync", str(mount.path), "--quiet").returncode == 0
    assert lake_tree(lake)[0]["big.bin"] == data


@pytest.mark.parametrize("lake", ["ceph"], indirect=True)
def test_a_spent_lake_quota_is_said_to_be_spent_not_bad_credentials(lake, mounter,
                                                                     aifs_cli):
    """Ceph answers a PUT past a bucket's quota with 403 QuotaExceeded: that
    is EDQUOT and a line that names the quota, not "check the credentials";
    the file stays here and goes once the quota is lifted."""

    def quota(*args: str) -> None:
        subprocess.run(["radosgw-admin", "-c", str(lake.server.directory / "ceph.conf"),
                        "quota", *args, "--quota-scope=bucket", f"--bucket={lake.bucket}"],
                       check=True, capture_output=True, timeout=60)

    quota("set", "--max-size=1048576")
    quota("enable")
    mount = mounter(lake, "--promote-delay", "3600")
    data, said = _sync_refused(mount, lake, "model.bin", 4 * MiB, errno.EDQUOT, aifs_cli)
    assert "QuotaExceeded" in said and "credentials" not in said
    quota("disable")
    assert aifs_cli("sync", str(mount.path), "--quiet").returncode == 0
    assert lake_tree(lake)[0]["model.bin"] == data


@pytest.mark.parametrize(("code", "status", "expected"), [
    ("QuotaExceeded", 403, errno.EDQUOT),  # Ceph RGW (above, against a real one)
    ("XMinioAdminBucketQuotaExceeded", 400, errno.EDQUOT),  # MinIO's bucket quota
    ("XMinioStorageFull", 507, errno.ENOSPC),
    ("", 507, errno.ENOSPC),
    ("AccessDenied", 403, errno.EACCES),  # bad credentials stay that
])
def test_what_a_server_says_when_it_is_full_is_told_apart_from_a_refusal(code, status,
                                                                         expected):
    from aifs.errors import LakeFull
    from aifs.lake.s3http import error_of

    error = error_of(code, status, code, "upload of a", "http://127.0.0.1:9", "b")
    assert error.errno == expected
    assert isinstance(error, LakeFull) == (expected != errno.EACCES)
    assert ("credentials" in str(error)) == (expected == errno.EACCES)
