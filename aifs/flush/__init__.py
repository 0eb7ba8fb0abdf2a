"""Promotion: local changes reach the lake in the background.

- :mod:`~aifs.flush.promoter` — the schedule, the workers, settling what
  landed, ``sync``; :mod:`~aifs.flush.host` what it asks of the filesystem
  (``PromotionHost``, implemented by :mod:`aifs.posix.hosting`).
- :mod:`~aifs.flush.uploads` — the upload of one inode: PUT, multipart,
  metadata, hard-link copies; :mod:`~aifs.flush.stream` — parts uploaded
  while a large file is still being written.
- :mod:`~aifs.flush.deletes` — deleting what tombstones name.
- :mod:`~aifs.flush.pacing` — promotion's reads of local copies yield to a
  busy mount (``promote_busy_rate``; streamed parts are not paced).

Small files go into packs (:mod:`aifs.pack`). Failed promotions wait with the
one backoff of :mod:`aifs.lake.retry`. May import ``pack``, ``meta``,
``lake``, ``cache``, ``config``, ``errors``; never ``posix`` or ``core``.
"""

from aifs.flush.promoter import Promoter

__all__ = ["Promoter"]
