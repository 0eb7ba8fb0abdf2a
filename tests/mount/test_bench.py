"""``aifs bench``: it runs, prints its rows, and leaves nothing behind (the lake
as it was, no mount, no work directory); bad input gets one clear line. The
figures themselves are benchmarks, not tests: nothing here asserts a speed."""

from __future__ import annotations

import json
import math
import shutil
import uuid

import pytest
from support.lakes import lake_objects, lake_uploads

from aifs.bench.lake import table


def mounted_under(path) -> list[str]:
    with open("/proc/mounts") as fp:
        return [line for line in fp if str(path) in line.split()[1]]


def test_the_lake_rows_read_an_object_beside_boto3_and_leave_the_lake_as_it_was(
        s3_lake, tmp_path, aifs_cli):
    s3_lake.put("kept/by-the-user.txt", b"not the bench's")
    before = lake_objects(s3_lake)
    got = aifs_cli("bench", "--size", "16M", "--files", "10", "--runs", "1",
                   "--binding", "kernel", "--work-dir", str(tmp_path), "--json",
                   "--lake", s3_lake.url, *s3_lake.args, env=s3_lake.env, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    result = json.loads(got.stdout)
    lake = result["lake"]
    assert lake["url"] == s3_lake.url + "/" and lake["size"] == 16 << 20
    sides = {"boto3", "kernel"} | ({"s3fs"} if shutil.which("s3fs") else set())
    assert set(lake["seconds"]) == sides
    assert all(math.isfinite(s) and s > 0 for s in lake["seconds"].values())
    # the cold read's close made the object one local copy, read again from it
    assert lake["runs_with_a_local_copy"] == {"kernel": 1}
    assert set(lake["daemon_cpu_s_per_gib_again"]) == {"kernel"}
    assert set(lake["daemon_cpu_s_per_gib_cold"]) == sides - {"boto3"}
    assert set(lake["daemon_cpu_s_per_gib_copy"]) == {"kernel"}
    assert "nvme_read" in result["seconds"]["kernel"]  # the NVMe rows ran too

    printed = table(lake)
    for row in ("fresh-node read of the whole object", "daemon CPU per GiB of that cold read",
                "daemon CPU per GiB read again from the NVMe tier"):
        assert row in printed
    assert "x boto3 speed" in printed

    assert lake_objects(s3_lake) == before
    assert lake_uploads(s3_lake) == []
    assert mounted_under(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_a_lake_the_bench_cannot_use_gets_one_line_and_nothing_runs(moto_server, tmp_path,
                                                                    aifs_cli):
    cases = {
        "a wrong endpoint": (["--lake", "s3://bench/x", "--endpoint-url",
                              "http://127.0.0.1:9"], "cannot reach the lake s3://bench/x/"),
        "a missing bucket": (["--lake", "s3://no-such-bucket/x", "--endpoint-url",
                              moto_server.endpoint], "cannot reach the lake"),
        "a local directory": (["--lake", str(tmp_path / "lake")], "takes an s3://"),
        "a missing profile": (["--lake", "s3://bench/x", "--profile", "no-such-profile",
                               "--endpoint-url", moto_server.endpoint],
                              "could not be found"),
        "an endpoint without a lake": (["--endpoint-url", moto_server.endpoint],
                                       "--endpoint-url is for --lake"),
        "an object too small to copy": (["--size", "1M", "--lake", "s3://bench/x"],
                                        "--size must be at least 8M"),
    }
    for what, (args, says) in cases.items():
        got = aifs_cli("bench", "--size", "16M", "--runs", "1", "--work-dir", str(tmp_path),
                       *args, env=dict(moto_server.env, AWS_CONFIG_FILE=str(tmp_path / "no")))
        assert got.returncode == 1, what
        assert got.stdout == "", what
        lines = got.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("aifs: bench") and says in lines[0], \
            (what, got.stderr)
        assert list(tmp_path.iterdir()) == [], what


def test_the_lake_table_shows_speeds_against_boto3_and_cpu_against_s3fs():
    result = {"url": "s3://b/p/", "size": 1 << 30, "runs": 3,
              "seconds": {"boto3": 1.6, "s3fs": 2.5, "kernel": 2.0, "pyfuse3": 4.0},
              "daemon_cpu_s_per_gib_cold": {"s3fs": 1.4, "kernel": 1.12, "pyfuse3": 2.1},
              "daemon_cpu_s_per_gib_copy": {"kernel": 0.28},  # (pyfuse3 makes none)
              "seconds_again": {"kernel": 1.0},
              "daemon_cpu_s_per_gib_again": {"kernel": 0.0},
              "runs_with_a_local_copy": {"kernel": 3, "pyfuse3": 0}}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in table(result).splitlines()}
    # sides: boto3, s3fs, kernel, pyfuse3; then kernel vs, pyfuse3 vs; then the target
    assert rows["fresh-node read of the whole object"][:6] == [
        "671 MB/s", "429 MB/s", "537 MB/s", "268 MB/s", "0.80 x boto3 speed",
        "0.40 x boto3 speed"]
    assert rows["daemon CPU per GiB of that cold read"][:6] == [
        "-", "1.40 CPU-s", "1.12 CPU-s", "2.10 CPU-s", "0.80 x s3fs", "1.50 x s3fs"]
    assert rows["daemon CPU per GiB making the local copy after it (aifs only)"][:6] == [
        "-", "-", "0.28 CPU-s", "-", "1.00 x s3fs with the copy", "-"]
    again = rows["daemon CPU per GiB read again from the NVMe tier, page cache dropped"]
    assert again[:6] == ["-", "-", "0.000 CPU-s", "-", "", "no local copy made"]

    del result["daemon_cpu_s_per_gib_cold"]["s3fs"], result["seconds"]["s3fs"]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
            for line in table(result).splitlines()}
    assert rows["daemon CPU per GiB of that cold read"][:5] == [
        "-", "1.12 CPU-s", "2.10 CPU-s", "-", "-"]


def test_a_mount_that_fails_after_the_object_is_put_leaves_the_lake_and_work_dir_as_they_were(
        moto_server, tmp_path, aifs_cli):
    """The bench's aifs mount cannot come up (a mount option aifs refuses,
    from the config file): the bench says so in one line and removes what it
    made: its object in the lake, its work directory."""
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    moto_server.client.create_bucket(Bucket=bucket)
    work = tmp_path / "work"
    work.mkdir()
    config = tmp_path / "lake.toml"
    config.write_text('fuse_options = ["no_such_option"]\n')
    got = aifs_cli("bench", "--size", "8M", "--files", "10", "--runs", "1",
                   "--binding", "kernel", "--work-dir", str(work),
                   "--lake", f"s3://{bucket}/data", "--endpoint-url", moto_server.endpoint,
                   "--config", str(config), "--json", env=moto_server.env, timeout=300)
    assert got.returncode == 1, (got.stdout, got.stderr)
    lines = got.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("aifs: bench: the kernel mount did not "
                                                   "come up: "), got.stderr
    assert moto_server.client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert moto_server.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert mounted_under(work) == []
    assert list(work.iterdir()) == []


class _FakeServer:
    bucket, prefix, where = "b", "p/", "s3://b/p/"

    def __init__(self) -> None:
        self.objects: set[str] = set()

    def put(self, source, key: str) -> None:
        assert source.stat().st_size == 16 << 20
        self.objects.add(key)

    def delete(self, key: str) -> None:
        self.objects.discard(key)

    def read(self, key: str, size: int) -> float:
        assert key in self.objects
        return 1.0


def test_the_lake_rows_count_a_copy_only_where_one_was_made(tmp_path, monkeypatch):
    """lake.run with its mounts and clocks faked (no FUSE): a binding that
    made no copy gets no copy CPU and no read-again figure, pyfuse3 is never
    waited for, and the object goes from the lake even when a read fails."""
    from aifs.bench import lake

    waited: list[str] = []
    copies = {"kernel": iter([True, False, True])}

    class FakeMount:
        def __init__(self, url, path, cache, side, log, options) -> None:
            self.path, self.side = path, side
            self.proc = type("P", (), {"pid": {"kernel": 1, "pyfuse3": 3}[side]})

        def stop(self) -> None:
            pass

    def wait(path) -> bool:
        side = path.name.removeprefix("lake-")
        waited.append(side)
        return next(copies[side])

    monkeypatch.setattr(lake, "Mount", FakeMount)
    monkeypatch.setattr(lake, "wait_admitted", wait)
    monkeypatch.setattr(lake, "read_with_cpu", lambda path, pid, size: (2.0, 0.5))
    monkeypatch.setattr(lake, "daemon_cpu", lambda pid: 0.0)
    monkeypatch.setattr(lake, "drop_caches", lambda: None)
    monkeypatch.setattr(lake.shutil, "which", lambda name: None)
    server = _FakeServer()
    server.lake = lake.Lake("s3://b/p")  # type: ignore[attr-defined]
    result = lake.run(server, 16 << 20, 3,  # type: ignore[arg-type]
                      ["kernel", "pyfuse3"], tmp_path, progress=False)
    assert server.objects == set()
    assert sorted(waited) == ["kernel"] * 3
    assert result["runs_with_a_local_copy"] == {"kernel": 2, "pyfuse3": 0}
    assert set(result["daemon_cpu_s_per_gib_copy"]) == {"kernel"}
    assert set(result["daemon_cpu_s_per_gib_again"]) == {"kernel"}
    assert set(result["seconds"]) == {"boto3", "kernel", "pyfuse3"}
    assert "no local copy made" in table(result)

    def fails(path, pid, size):
        raise lake.ConfigError("bench: a read failed")
    monkeypatch.setattr(lake, "read_with_cpu", fails)
    with pytest.raises(lake.ConfigError):
        lake.run(server, 16 << 20, 1, ["kernel"], tmp_path,  # type: ignore[arg-type]
                 progress=False)
    assert server.objects == set()
