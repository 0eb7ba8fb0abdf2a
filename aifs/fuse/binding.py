"""The two bindings behind one face: mount, serve until unmounted, stop.

``fuse_binding = kernel`` speaks the FUSE protocol itself
(:mod:`aifs.fuse.kernel`); ``pyfuse3`` goes through libfuse 3
(:mod:`aifs.fuse.pyfuse3_adapter`); ``auto`` tries the first and falls back
to the second where it cannot mount.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Protocol

from aifs.config import Config
from aifs.core import Filesystem
from aifs.errors import ConfigError

if TYPE_CHECKING:
    from aifs.fuse.kernel.notify import Notifier
    from aifs.fuse.kernel.session import Session

log = logging.getLogger(__name__)


class Binding(Protocol):
    name: str
    mountpoint: str

    def mount(self) -> None: ...

    async def serve(self) -> None:
        """Answer requests until the mount is gone or :meth:`terminate`."""

    def terminate(self) -> None: ...

    def unmount(self) -> None: ...


class Pyfuse3Binding:
    name = "pyfuse3"

    def __init__(self, fs: Filesystem, mountpoint: str, options: set[str]) -> None:
        self.fs = fs
        self.mountpoint = mountpoint
        self.options = options
        self._replaced: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._notices: threading.Thread | None = None

    def mount(self) -> None:
        import pyfuse3

        from aifs.fuse.pyfuse3_adapter import Operations
        try:
            pyfuse3.init(Operations(self.fs), self.mountpoint, self.options)
        except RuntimeError as exc:
            raise ConfigError(f"cannot mount on {self.mountpoint}: {exc}") from None
        # What other writers changed leaves the kernel's caches at once (as
        # with the kernel binding: aifs/fuse/kernel/notify.py). libfuse sends
        # entry notices from a thread of its own; an inode's may block, so it
        # gets one of ours.
        self._notices = threading.Thread(target=self._invalidate_inodes, name="aifs-notify",
                                         daemon=True)
        self._notices.start()
        self.fs.on_lake_changes(self._changed)

    def _changed(self, parent: int, names: list[bytes], inodes: list[int]) -> None:
        import pyfuse3
        for name in names:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        for ino in inodes:
            self._replaced.put(ino)

    def _invalidate_inodes(self) -> None:
        import pyfuse3
        while (ino := self._replaced.get()) is not None:
            try:
                pyfuse3.invalidate_inode(ino)
            except OSError:  # the kernel holds nothing of it
                pass

    async def serve(self) -> None:
        import pyfuse3
        await pyfuse3.main()

    def terminate(self) -> None:
        import pyfuse3
        self.fs.on_lake_changes(None)  # no notices once requests are no longer read
        pyfuse3.terminate()

    def unmount(self) -> None:
        import pyfuse3
        self.fs.on_lake_changes(None)
        self._replaced.put(None)
        if self._notices is not None:
            self._notices.join(5)  # (none may use the session once it is closed)
        pyfuse3.close(unmount=True)


class KernelBinding:
    name = "kernel"

    def __init__(self, fs: Filesystem, mountpoint: str, options: set[str],
                 config: Config) -> None:
        from aifs.fuse.kernel.operations import Operations
        from aifs.fuse.kernel.passthrough import Passthrough
        self.fs = fs
        self.mountpoint = mountpoint
        self.options = options
        self.config = config
        self.passthrough = Passthrough(fs)
        self.ops = Operations(fs, self.passthrough)
        self.session: Session | None = None
        self.notifier: Notifier | None = None
        self.connection: int | None = None  # /sys/fs/fuse/connections/N
        self.fd = -1

    def mount(self) -> None:
        from aifs.fuse.kernel import mount
        from aifs.fuse.kernel.session import Session
        self.fd = mount.mount(self.mountpoint, self.options)
        self.passthrough.devfd = self.fd
        from aifs.fuse.kernel.notify import Notifier
        self.connection = mount.connection_id(self.mountpoint)
        self.notifier = Notifier(self.fd)
        self.fs.on_lake_changes(self.notifier.changed)
        self.session = Session(self.fd, self.ops, self.fs.forget, self.passthrough,
                               max_background=max(12, self.config.max_connections * 2),
                               want_passthrough=self.config.passthrough,
                               poll=self.config.fuse_poll_us / 1e6)
        self.fs.count_requests(self.session.served)  # promotion yields to them

    async def serve(self) -> None:
        assert self.session is not None
        try:
            await self.session.run()
        finally:
            log.info("requests served: %s", self.session.summary())

    def terminate(self) -> None:
        if self.notifier is not None:
            self.notifier.stop()  # before the session stops reading (see Notifier.stop)
        if self.session is not None:
            self.session.terminate()

    def unmount(self) -> None:
        from aifs.fuse.kernel import mount
        self.fs.on_lake_changes(None)
        if self.notifier is not None and not self.notifier.close() \
                and self.connection is not None:
            log.warning("a kernel cache notice is stuck; ending the FUSE connection")
            mount.abort(self.connection)
        mount.unmount(self.mountpoint)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount_binding(config: Config, fs: Filesystem, mountpoint: str,
                  options: set[str]) -> Binding:
    """Mount with the binding ``config`` asks for and return it."""
    if config.fuse_binding in ("kernel", "auto"):
        binding: Binding = KernelBinding(fs, mountpoint, options, config)
        try:
            binding.mount()
            return binding
        except (ConfigError, OSError) as exc:
            if config.fuse_binding == "kernel":
                raise ConfigError(str(exc)) from None
            log.warning("kernel binding cannot mount (%s): using pyfuse3", exc)
    binding = Pyfuse3Binding(fs, mountpoint, options)
    binding.mount()
    return binding
