"""POSIX semantics over the lake, one responsibility a module.

``aifs.core.Filesystem`` is the facade the bindings call; it builds these
parts and hands each call to the one that owns it:

- :mod:`~aifs.posix.inodes` — the state every part shares: the inodes the
  kernel holds (lookup counts), open handles, files being written (size and
  mtime in memory), directory times, what changed since the last promotion.
- :mod:`~aifs.posix.listing` — directory listings (LIST merged with the pack
  index), lookups, getattr, readdir; revalidation after the TTL.
- :mod:`~aifs.posix.namespace` — create, mknod, mkdir, symlink, unlink,
  rmdir, link, rename; :mod:`~aifs.posix.moves` what a rename does in the lake.
- :mod:`~aifs.posix.files` — open, read, flush, fsync, release: handles and
  read planning (local copy, packed bytes, cached blocks).
- :mod:`~aifs.posix.writes` — write, truncate, setattr: local copies, room on
  the cache disk, a full disk.
- :mod:`~aifs.posix.hosting` — what the promoter asks of the filesystem
  (:class:`~aifs.flush.host.PromotionHost`), sync and the drain at unmount.
- :mod:`~aifs.posix.control` — xattrs: user ones and the ``user.aifs.*``
  facts and commands (sync, warmup, pack, gc, pin), stats, statfs.
- :mod:`~aifs.posix.recovery` — reconciling local copies with the metadata at
  mount, after any exit.
- :mod:`~aifs.posix.tally` — the figures the facade hands out
  (:class:`~aifs.figures.Figures`) for ``aifs status`` and the metrics.

No pyfuse3 here: tests drive these without a mount. May import ``cache``,
``flush``, ``read``, ``meta``, ``lake``, ``policy``, ``checkpoint``,
``xattrs``, ``errors``, ``config``; never ``core``, ``fuse`` or ``daemon``.
"""
