"""LMDB bytes per listed file: 100 directories of 1,000 listed objects put
through ``MetaStore.apply_listing`` (no mount, no lake), pages used over files.

    python tests/bench/lmdb_bench.py [--dirs 100] [--files 1000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from aifs.meta.store import DIR, FILE, ROOT_INO, Listed, MetaStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--files", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        meta = MetaStore(Path(work) / "meta")
        meta.apply_listing(ROOT_INO, [Listed(f"d{i:03d}", DIR, f"ds/d{i:03d}/", 0, "", 1.0)
                                      for i in range(args.dirs)])
        start = time.perf_counter()
        for i in range(args.dirs):
            directory = meta.lookup(ROOT_INO, f"d{i:03d}".encode())
            assert directory is not None
            meta.apply_listing(directory.ino, [
                Listed(f"s{j:06d}.jpg", FILE, f"ds/d{i:03d}/s{j:06d}.jpg", 16384,
                       '"0123456789abcdef0123456789abcdef"', 1.7e9 + j)
                for j in range(args.files)])
        took = time.perf_counter() - start
        used = meta.env.info()["last_pgno"] * meta.env.stat()["psize"]
        count = args.dirs * args.files
        meta.close()
    print(f"{used / count:.0f} LMDB bytes per listed file; {count / took:,.0f} files "
          f"listed per second into LMDB")


if __name__ == "__main__":
    main()
