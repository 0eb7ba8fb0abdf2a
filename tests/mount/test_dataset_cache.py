"""AI-aware read caching, checked the way a training job sees it: a shuffled
PyTorch DataLoader with several workers reads a dataset twice the size of the
cache for three epochs. Under the dataset policy the cache keeps a stable
subset, so from the second epoch about cache ÷ dataset of the samples come
from the NVMe tier; plain LRU (the same files under the default policy) evicts
each sample just before it is read again. Both are run, side by side."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import xxhash
from support.lakes import HEAVY_LAKES
from torch.utils.data import DataLoader, Dataset

MiB = 1 << 20
SAMPLES = 1200
CACHE = 20 * MiB


class Samples(Dataset):
    """Reads one sample file whole, as an image folder dataset does; then drops
    it from the page cache, as a dataset far larger than RAM would be."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, str]:
        fd = os.open(self.root / f"s{index:05d}.jpg", os.O_RDONLY)
        try:
            data = b""
            while chunk := os.read(fd, 1 << 20):
                data += chunk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return index, xxhash.xxh3_64_hexdigest(data)


def make_dataset(seed: int = 7) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"train/s{i:05d}.jpg": rng.randbytes(rng.randint(1 << 10, 64 << 10))
            for i in range(SAMPLES)}


def lake_gets(mountpoint: Path) -> int:
    metrics = json.loads(os.getxattr(mountpoint, "user.aifs.metrics"))
    return metrics["lake"]["requests"]["GetObject"]


def run_epochs(mountpoint: Path, expected: dict[int, str], epochs: int = 3) -> list[float]:
    """Hit ratio of each epoch: the share of samples read without a lake GET."""
    loader = DataLoader(Samples(mountpoint / "train"), batch_size=16, shuffle=True,
                        num_workers=2, generator=torch.Generator().manual_seed(1))
    ratios = []
    for _ in range(epochs):
        before = lake_gets(mountpoint)
        seen = 0
        for indices, digests in loader:
            for index, digest in zip(indices.tolist(), digests, strict=True):
                assert digest == expected[index], f"sample {index}: wrong bytes"
                seen += 1
        assert seen == SAMPLES
        ratios.append(1 - (lake_gets(mountpoint) - before) / SAMPLES)
    return ratios


@pytest.mark.slow
@pytest.mark.parametrize("lake", HEAVY_LAKES, indirect=True)
def test_dataloader_keeps_a_stable_subset_where_lru_thrashes(lake, mounter, record_property):
    data = make_dataset()
    lake.put_many(data)
    total = sum(len(v) for v in data.values())
    expected = {int(k[7:12]): xxhash.xxh3_64_hexdigest(v) for k, v in data.items()}
    share = CACHE / total
    assert 1.8 < total / CACHE < 2.4  # a dataset about twice the cache

    results = {}
    args = ("--cache-size", str(CACHE), "--block-size", "1M", "--memory-cache", "1M")
    for policy in ("dataset", "default"):
        mount = mounter(lake, *args, name=policy)
        os.setxattr(mount.path / "train", "user.aifs.policy", policy.encode())
        results[policy] = run_epochs(mount.path, expected)
        mount.unmount()
    # a warm restart: the cached subset and its admission survive a remount
    again = mounter(lake, *args, name="restart", cache="dataset")
    results["dataset after remount"] = run_epochs(again.path, expected, epochs=1)
    again.unmount()
    record_property("hit_ratios", json.dumps(results))
    print(f"\ncache/dataset {share:.2f}; hit ratio per epoch: dataset policy "
          f"{results['dataset']}, LRU {results['default']}")
    for ratio in results["dataset"][1:] + results["dataset after remount"]:
        assert ratio >= 0.8 * share, results
    # the comparison the policy exists for: LRU keeps far less of a shuffled scan
    assert min(results["dataset"][1:]) > max(results["default"][1:]), results


def cached(path: Path) -> int:
    return int(os.getxattr(path, "user.aifs.cached_bytes"))


def test_warmup_fetches_a_tree_once_and_resumes(lake, mounter, aifs_cli):
    rng = random.Random(5)
    files = {f"data/{d}/f{i}.bin": rng.randbytes(rng.randint(1, 3 * MiB))
             for d in ("a", "b") for i in range(6)}
    lake.put_many(files)
    mount = mounter(lake, "--block-size", "1M")
    first = aifs_cli("warmup", str(mount.path / "data" / "a"))  # stopped half way
    assert first.returncode == 0, first.stderr
    gets = lake_gets(mount.path)
    result = aifs_cli("warmup", str(mount.path / "data"))  # resumes: only b is fetched
    assert result.returncode == 0, result.stderr
    blocks_b = sum(-(-len(v) // MiB) for k, v in files.items() if k.startswith("data/b/"))
    assert lake_gets(mount.path) - gets == blocks_b
    assert "12 files" in result.stderr
    for name, data in files.items():
        assert cached(mount.path / name) == len(data), name
    gets = lake_gets(mount.path)
    for name, data in files.items():
        assert (mount.path / name).read_bytes() == data
    assert lake_gets(mount.path) == gets  # all from the cache disk
    again = aifs_cli("warmup", "--quiet", str(mount.path / "data"))
    assert again.returncode == 0 and lake_gets(mount.path) == gets


def test_pinned_files_stay_cached_under_pressure_and_across_remounts(lake, mounter,
                                                                    aifs_cli):
    weights = os.urandom(3 * MiB)
    lake.put("models/w.safetensors", weights)
    lake.put_many({f"other/o{i}.bin": os.urandom(MiB) for i in range(12)})
    args = ("--block-size", "1M", "--cache-size", "8M", "--memory-cache", "1M")
    mount = mounter(lake, *args)
    model = mount.path / "models" / "w.safetensors"
    result = aifs_cli("pin", str(mount.path / "models"))
    assert result.returncode == 0, result.stderr
    assert os.getxattr(model, "user.aifs.pinned") == b"1"
    assert cached(model) == len(weights)
    for i in range(12):  # 12 MiB of other reads through an 8 MiB cache
        (mount.path / "other" / f"o{i}.bin").read_bytes()
    assert cached(model) == len(weights)
    mount.unmount()

    again = mounter(lake, *args, name="again", cache="m")
    model = again.path / "models" / "w.safetensors"
    assert os.getxattr(model, "user.aifs.pinned") == b"1"
    assert cached(model) == len(weights)
    gets = lake_gets(again.path)
    assert model.read_bytes() == weights and lake_gets(again.path) == gets
    assert aifs_cli("unpin", str(again.path / "models")).returncode == 0
    assert os.getxattr(model, "user.aifs.pinned") == b"0"
    for i in range(12):
        (again.path / "other" / f"o{i}.bin").read_bytes()
    assert cached(model) < len(weights)  # evictable again
