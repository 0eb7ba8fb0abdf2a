"""Small files in packs: many small files reach the lake as a few large
objects, with journals that say where each file is.

- :mod:`~aifs.pack.index` — the pack index in LMDB (packed files, journal
  records, the outbox of records to publish) and the record format.
- :mod:`~aifs.pack.folds` — the fold format: many journals in one object, and
  for a big index split by directory into shards.
- :mod:`~aifs.pack.journals` — reading other nodes' journals (replay), and the
  shards of sharded folds as directories are listed.
- :mod:`~aifs.pack.packer` — gathering settled small files into a pack and
  publishing the pack and its journal.
- :mod:`~aifs.pack.compaction` — compaction, garbage collection, and packing
  objects other tools wrote (``aifs pack``).

The lake layout is in ``docs/packing.md``. May import ``meta``, ``lake``,
``cache``, ``config``, ``errors``; never ``flush``, ``posix`` or ``core``
(promotion hands files to the packer, not the other way round).
"""
