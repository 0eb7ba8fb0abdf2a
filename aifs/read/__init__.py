"""Fetching blocks from the lake: single flight, memory tier, readahead."""

from aifs.read.fetcher import BlockFetcher
from aifs.read.readahead import Readahead

__all__ = ["BlockFetcher", "Readahead"]
