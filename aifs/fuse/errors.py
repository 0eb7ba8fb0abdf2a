"""What every binding answers for an exception a request raised: an errno."""

from __future__ import annotations

import errno
import logging

import lmdb

from aifs.errors import FsError, lake_error_in

log = logging.getLogger(__name__)


def errno_for(exc: BaseException, what: str) -> int:
    """The errno a request that raised ``exc`` answers; logs what was not expected."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, (lmdb.DiskError, lmdb.MapFullError)):
        # the metadata could not grow: the cache disk is full (its reserve
        # spent); the caller is told so and nothing was changed
        log.warning("%s: metadata not written, cache disk full (%s)", what, exc)
        return errno.ENOSPC
    lake = lake_error_in(exc) if isinstance(exc, Exception) else None
    if lake is not None:
        log.warning("%s: %s", what, lake)
        return lake.errno
    log.error("unexpected error in %s", what, exc_info=exc)
    return errno.EIO
