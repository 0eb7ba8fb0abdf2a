"""Local (NVMe) data: blocks of lake objects (:mod:`~aifs.cache.blocks`,
keyed by key + ETag so a changed object is never served stale, with the
admission and eviction of the policies; small ones many to a file in
:mod:`~aifs.cache.segments`), whole local copies of files being
written or materialized (:mod:`~aifs.cache.files`), and writing cache files
past the page cache (:mod:`~aifs.cache.direct`).

May import ``policy`` and ``xattrs`` only: everything above builds on it.
"""

from aifs.cache.blocks import BlockCache, ObjectVersion

__all__ = ["BlockCache", "ObjectVersion"]
