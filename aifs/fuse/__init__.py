"""The bindings: they turn kernel requests into calls on the ``core`` facade
and its answers into replies, and hold no filesystem logic.

- :mod:`~aifs.fuse.pyfuse3_adapter` — over libfuse 3 through pyfuse3.

May import ``core``, ``errors`` and ``meta`` (for the ``Inode`` it converts);
nothing below ``core`` calls back up here.
"""
