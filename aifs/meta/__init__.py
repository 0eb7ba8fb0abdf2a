"""Node-local metadata in LMDB: the inodes, names and dirty state of one node.

What lives where:

- :mod:`aifs.meta.schema`: the on-disk form, the one table of every LMDB
  database and key, the database names, key encodings and schema versions
- :mod:`aifs.meta.inode`: the ``Inode`` record, file kinds, pending flags,
  ``Listed``, ``valid_name``
- :mod:`aifs.meta.store`: ``MetaStore``, assembled from
  :mod:`aifs.meta.base` (environment and in-transaction primitives),
  :mod:`aifs.meta.batches` (a first listing's plain files as one record per
  directory, and the write transactions that turn it into records),
  :mod:`aifs.meta.listing`, :mod:`aifs.meta.names` and
  :mod:`aifs.meta.promotion`; it re-exports the names above
- :mod:`aifs.meta.objattrs`: POSIX attributes in object user metadata

Imports: this package uses only :mod:`aifs.errors`, the standard library,
``lmdb`` and ``xxhash``, never the rest of aifs (which builds on it). Inside
it, modules import downwards: schema <- inode <- base <- batches <- listing,
names, promotion <- store; objattrs uses inode alone. The pack index keeps its
records in the same environment (:mod:`aifs.pack.index`; its databases are
in the schema table too).
"""

from aifs.meta.store import DIR, FILE, ROOT_INO, Inode, Listed, MetaStore, valid_name

__all__ = ["DIR", "FILE", "Inode", "Listed", "MetaStore", "ROOT_INO", "valid_name"]
