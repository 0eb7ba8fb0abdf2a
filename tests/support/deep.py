"""Trees deeper than PATH_MAX, reached as a program on a local disk reaches
them: one name at a time, from the descriptor of the directory above."""

from __future__ import annotations

import contextlib
import os


def down(fd: int, names: list[str]) -> int:
    """The directory ``names`` below ``fd``, made where missing, opened by
    its name in its parent each step (no path past PATH_MAX is ever built);
    ``fd`` is closed."""
    for name in names:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=fd)
        deeper = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    return fd
