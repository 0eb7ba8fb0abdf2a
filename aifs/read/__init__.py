"""Fetching lake bytes: :mod:`~aifs.read.fetcher` (the one path by which
object bytes are read: single flight per block, memory tier, block cache),
:mod:`~aifs.read.readahead` (sequential detection), :mod:`~aifs.read.attrs`
(POSIX attributes of listed objects: journal records, or HEADs when asked)
and :mod:`~aifs.read.scan` (directory prefetch).

May import ``cache``, ``pack`` (records, checksums), ``meta``, ``lake``,
``config``, ``errors``; never ``posix``, ``flush`` or ``core``.
"""

from aifs.read.fetcher import BlockFetcher
from aifs.read.readahead import Readahead

__all__ = ["BlockFetcher", "Readahead"]
