"""A metadata store's records, as tests compare them (tests/unit/test_meta.py,
tests/unit/test_batches.py)."""

from __future__ import annotations

from aifs.meta.store import MetaStore


def meta_dump(meta: MetaStore) -> dict[bytes, list[tuple[bytes, bytes]]]:
    """Every record of every database of the store."""
    out = {}
    with meta.env.begin() as txn:
        for name, _ in txn.cursor():
            db = meta.env.open_db(bytes(name), txn=txn)
            out[bytes(name)] = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
    return out
