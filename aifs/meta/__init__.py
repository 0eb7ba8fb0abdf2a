"""Node-local metadata in LMDB: see :mod:`aifs.meta.store` for the key schema."""

from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore, valid_name

__all__ = ["DIR", "FILE", "Inode", "Listed", "MetaStore", "ROOT_INO", "valid_name"]
