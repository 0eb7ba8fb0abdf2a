"""The two bindings behind one face: mount, serve until unmounted, stop.

``fuse_binding = kernel`` speaks the FUSE protocol itself
(:mod:`aifs.fuse.kernel`); ``pyfuse3`` goes through libfuse 3
(:mod:`aifs.fuse.pyfuse3_adapter`); ``auto`` tries the first and falls back
to the second where it cannot mount.
"""

from __future__ import annotations

import logging
import os
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

    def mount(self) -> None:
        import pyfuse3

        from aifs.fuse.pyfuse3_adapter import Operations
        try:
            pyfuse3.init(Operations(self.fs), self.mountpoint, self.options)
        except RuntimeError as exc:
            raise ConfigError(f"cannot mount on {self.mountpoint}: {exc}") from None

    async def serve(self) -> None:
        import pyfuse3
        await pyfuse3.main()

    def terminate(self) -> None:
        import pyfuse3
        pyfuse3.terminate()

    def unmount(self) -> None:
        import pyfuse3
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
        self.fd = -1

    def mount(self) -> None:
        from aifs.fuse.kernel import mount
        from aifs.fuse.kernel.session import Session
        self.fd = mount.mount(self.mountpoint, self.options)
        self.passthrough.devfd = self.fd
        from aifs.fuse.kernel.notify import Notifier
        self.notifier = Notifier(self.fd)
        self.fs.on_lake_changes(self.notifier.changed)
        self.session = Session(self.fd, self.ops, self.fs.forget, self.passthrough,
                               max_background=max(12, self.config.max_connections * 2),
                               want_passthrough=self.config.passthrough,
                               poll=self.config.fuse_poll_us / 1e6)

    async def serve(self) -> None:
        assert self.session is not None
        try:
            await self.session.run()
        finally:
            log.info("requests served: %s", self.session.summary())

    def terminate(self) -> None:
        if self.session is not None:
            self.session.terminate()

    def unmount(self) -> None:
        from aifs.fuse.kernel import mount
        self.fs.on_lake_changes(None)
        if self.notifier is not None:
            self.notifier.close()
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
