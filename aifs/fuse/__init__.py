"""The bindings: they turn kernel requests into calls on the ``core`` facade
and its answers into replies, and hold no filesystem logic.

- :mod:`~aifs.fuse.kernel` — aifs's own session on ``/dev/fuse`` (passthrough).
- :mod:`~aifs.fuse.pyfuse3_adapter` — over libfuse 3 through pyfuse3.
- :mod:`~aifs.fuse.binding` — the two behind one face; ``fuse_binding`` picks.
- :mod:`~aifs.fuse.errors` — the errno a request's exception answers.

May import ``core``, ``config``, ``errors`` and ``meta`` (for the ``Inode`` it converts);
nothing below ``core`` calls back up here.
"""
