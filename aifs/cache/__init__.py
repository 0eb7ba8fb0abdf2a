"""Local (NVMe) data cache."""

from aifs.cache.blocks import BlockCache, ObjectVersion

__all__ = ["BlockCache", "ObjectVersion"]
