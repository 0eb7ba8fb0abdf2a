"""Small-file creates through aifs beside s3fs and rclone mount, on one S3 server.

Each side mounts a fresh prefix of BUCKET (aifs: the kernel binding, an
empty cache; s3fs with its defaults; rclone with ``--vfs-cache-mode writes
--vfs-write-back 0s``, its closest to aifs's write-back), creates N files of
16 KiB in a new directory, and reports the time until the last ``close()``
returned and until every file is in the lake (aifs: ``aifs sync``; the
others: a LIST that counts N objects). Rounds rotate the order. As root,
with s3fs and rclone installed (Debian packages); credentials from
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY:

    python tests/bench/peer_creates.py --endpoint-url http://127.0.0.1:7481 \\
        --bucket bench [--files 2000] [--rounds 3] [--work-dir /mnt/benchfs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import boto3

AIFS = [sys.executable, "-m", "aifs"]
SMALL = 16 << 10


def mounted(path: str) -> bool:
    with open("/proc/mounts") as mounts:
        return any(line.split()[1] == path for line in mounts)


def lake_count(s3: object, bucket: str, prefix: str) -> int:
    pages = s3.get_paginator("list_objects_v2").paginate(  # type: ignore[attr-defined]
        Bucket=bucket, Prefix=prefix)
    return sum(len(page.get("Contents", [])) for page in pages)


def one(side: str, prefix: str, args: argparse.Namespace, s3: object,
        env: dict[str, str]) -> tuple[float, float]:
    mnt, work = f"/mnt/peer-{side}", Path(args.work_dir) / f"peer-{side}"
    os.makedirs(mnt, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ep, bucket = args.endpoint_url, args.bucket
    if side == "aifs":
        subprocess.run([*AIFS, "mount", f"s3://{bucket}/{prefix}", mnt, "--endpoint-url", ep,
                        "--cache-dir", str(work), "--fuse-binding", "kernel"], env=env,
                       check=True)
    elif side == "s3fs":
        s3.put_object(Bucket=bucket, Key=f"{prefix}/", Body=b"")  # type: ignore[attr-defined]
        subprocess.Popen(["s3fs", f"{bucket}:/{prefix}", mnt, "-o",
                          f"url={ep},use_path_request_style,endpoint=us-east-1,tmpdir={work}"],
                         env=env)
    else:
        subprocess.Popen(["rclone", "mount", f"peer:{bucket}/{prefix}", mnt,
                          "--vfs-cache-mode", "writes", "--vfs-write-back", "0s",
                          "--cache-dir", str(work)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not mounted(mnt):
        if time.monotonic() > deadline:
            raise SystemExit(f"{side} did not mount on {mnt}")
        time.sleep(0.1)
    try:
        os.mkdir(f"{mnt}/d")
        data = os.urandom(SMALL)
        start = time.perf_counter()
        for i in range(args.files):
            with open(f"{mnt}/d/s{i:06d}", "wb") as fp:
                fp.write(data)
        closed = time.perf_counter() - start
        if side == "aifs":
            subprocess.run([*AIFS, "sync", "-q", mnt], env=env, check=True)
        else:
            while lake_count(s3, bucket, f"{prefix}/d/") < args.files:
                time.sleep(0.2)
        return closed, time.perf_counter() - start
    finally:
        subprocess.run([*AIFS, "umount", mnt] if side == "aifs" else ["umount", mnt],
                       env=env, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint-url", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", default="/var/tmp")
    args = parser.parse_args()
    key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    # (rclone refuses AWS_CA_BUNDLE on a plain-HTTP endpoint)
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env.update(AWSACCESSKEYID=key, AWSSECRETACCESSKEY=secret, RCLONE_CONFIG_PEER_TYPE="s3",
               RCLONE_CONFIG_PEER_PROVIDER="Other", RCLONE_CONFIG_PEER_ENDPOINT=args.endpoint_url,
               RCLONE_CONFIG_PEER_ACCESS_KEY_ID=key, RCLONE_CONFIG_PEER_SECRET_ACCESS_KEY=secret)
    s3 = boto3.client("s3", endpoint_url=args.endpoint_url)
    sides = [s for s in ("aifs", "s3fs", "rclone") if s == "aifs" or shutil.which(s)]
    stamp = int(time.time())
    for rnd in range(args.rounds):
        for side in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
            closed, in_lake = one(side, f"peer-creates-{stamp}-{rnd}-{side}", args, s3, env)
            print(f"round {rnd + 1} {side}: {args.files} creates until the last close "
                  f"{closed:.2f} s, all in the lake {in_lake:.2f} s", flush=True)


if __name__ == "__main__":
    main()
