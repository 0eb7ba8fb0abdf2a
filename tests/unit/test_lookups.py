"""The kernel's reference counts (``aifs.posix.lookups``), against a plain dict."""

from __future__ import annotations

import itertools
import random
import tracemalloc

import pytest

from aifs.posix.lookups import DENSE, FULL, PAGE, LookupCounts


@pytest.mark.parametrize("seed", range(6))
def test_counts_follow_a_dict_through_random_lookups_and_forgets(seed):
    """Dense runs, scattered numbers, ranges, counts past a byte, forgets of
    more than is held: every count reads as the dict's, and pages go once empty."""
    rng = random.Random(seed)
    counts, model = LookupCounts(), {}
    bases = [rng.randrange(1, 1 << 40) for _ in range(4)] + [1, PAGE - 3]
    for _ in range(20000):
        ino = rng.choice(bases) + rng.randrange(3 * PAGE if rng.random() < 0.7 else 1 << 30)
        if rng.random() < 0.1:  # a READDIRPLUS page of a listing's files
            length = rng.choice((1, 5, DENSE, 200, PAGE + 7))
            counts.add_range(ino, length)
            for i in range(ino, ino + length):
                model[i] = model.get(i, 0) + 1
        elif rng.random() < 0.6:
            n = rng.choice((1, 1, 1, 2, FULL, 300))
            counts.add(ino, n)
            model[ino] = model.get(ino, 0) + n
        else:
            # the 50 newest, without copying the whole dict each step
            held = list(itertools.islice(reversed(model), 50)) or [ino]
            ino = rng.choice(held)
            n = rng.choice((1, 2, FULL, 1000))
            left = max(model.get(ino, 0) - n, 0)
            assert counts.drop(ino, n) == left
            if left:
                model[ino] = left
            else:
                model.pop(ino, None)
        assert counts.get(ino) == model.get(ino, 0)
        assert (ino in counts) == (ino in model)
    assert all(counts[ino] == count for ino, count in model.items())
    assert len(counts) == len(model)
    for ino, count in list(model.items()):
        assert counts.drop(ino, count) == 0
    assert len(counts) == 0 and not counts._pages and not counts._loose and not counts._big
    with pytest.raises(KeyError):
        counts[bases[0]]


def test_a_walk_of_a_million_entries_costs_bytes_not_a_dict_each():
    """The entries a walk hands the kernel (consecutive numbers, a listing at
    a time) cost about a byte each, where a dict costs ~60; numbers with no
    neighbours held cost at most about twice a dict's."""
    tracemalloc.start()
    try:
        counts = LookupCounts()
        for ino in range(2, 1_000_002):
            counts.add(ino)
        dense = tracemalloc.get_traced_memory()[0]
        scattered = LookupCounts()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20000):
            scattered.add(i * PAGE * 7 + 5)  # one number per page: never paged
        loose = tracemalloc.get_traced_memory()[0] - before
        plain = {}
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20000):
            plain[i * PAGE * 7 + 5] = 1
        as_dict = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert dense < 2 * 1_000_000, dense
    assert loose < 2.2 * as_dict, (loose, as_dict)
    assert len(counts) == 1_000_000 and counts[2] == 1 and 1_000_002 not in counts
    assert DENSE < PAGE
