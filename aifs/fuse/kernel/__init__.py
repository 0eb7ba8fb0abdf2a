"""aifs's own FUSE session on ``/dev/fuse`` (the ``kernel`` binding).

- :mod:`~aifs.fuse.kernel.protocol` — the wire format of ``fuse.h`` 7.45.
- :mod:`~aifs.fuse.kernel.mount` — mount(2) as root, fusermount3 otherwise.
- :mod:`~aifs.fuse.kernel.session` — reading requests, INIT, replies, under trio.
- :mod:`~aifs.fuse.kernel.operations` — each request answered by the ``core`` facade.
- :mod:`~aifs.fuse.kernel.passthrough` — backing files for direct handles.
- :mod:`~aifs.fuse.kernel.notify` — telling the kernel what other writers changed.

Facts measured on these machines and the choices they led to:
``docs/kernel-binding.md``.
"""
