"""Error types shared by every layer.

The message of an :class:`AifsError` is written for the user: the CLI prints
it as one line, without a traceback.
"""

from __future__ import annotations

import errno


class AifsError(Exception):
    """An error whose message is fit to show the user as one line."""


class ConfigError(AifsError):
    """Bad configuration or command-line input."""


class LakeError(AifsError):
    """A lake request failed. ``transient`` errors are worth retrying."""

    transient = False
    errno = errno.EIO


class ObjectNotFound(LakeError):
    errno = errno.ENOENT


class PreconditionFailed(LakeError):
    """The object changed (ETag) since we learned of it."""

    errno = errno.ESTALE


class CorruptData(LakeError):
    """Bytes from the lake do not match their recorded checksum."""


class LakeUnavailable(LakeError):
    """Endpoint unreachable, timed out, throttled or answering 5xx.

    ``cause`` names the kind of failure for the retry metrics: one of
    :data:`CAUSES`. ``unreached``: no connection could be made at all (refused,
    no such host): at mount, a mistake in the endpoint more likely than a fault.
    """

    transient = True

    def __init__(self, message: str, cause: str = "error", unreached: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        self.unreached = unreached


#: why a lake request is tried again (the label of ``aifs_lake_retries_total``)
CAUSES = ("connection", "timeout", "truncated", "throttled", "server", "error")


class AccessDenied(LakeError):
    errno = errno.EACCES


class BucketNotFound(LakeError):
    pass


class LakeFull(LakeError):
    """The lake has no room for what was sent: its disk is full (a local
    lake; MinIO's ``XMinioStorageFull``) or a quota is spent (Ceph's
    ``QuotaExceeded``, which comes as a 403 and must not read as bad
    credentials; MinIO's bucket quota). The object was not stored;
    promotion tries again later."""

    def __init__(self, message: str, quota: bool = False) -> None:
        super().__init__(message)
        self.errno = errno.EDQUOT if quota else errno.ENOSPC


class Failure(str):
    """Why something keeps failing, as its message, and the errno a sync
    that gives up on it answers: a full lake's (ENOSPC, EDQUOT), else EIO.
    Kept instead of the exception, whose traceback would keep the failing
    frames, and the part buffers in them, alive."""

    errno: int

    def __new__(cls, why: object) -> Failure:
        self = super().__new__(cls, str(why))
        self.errno = why.errno if isinstance(why, LakeFull) else errno.EIO
        return self


class InvalidKey(LakeError):
    """A key the store cannot hold (for example ``..`` in a local lake)."""

    errno = errno.EINVAL


class FsError(Exception):
    """A POSIX error raised by core; the binding turns it into FUSEError."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(message or errno.errorcode.get(err, str(err)))
        self.errno = err


def lake_error_in(exc: BaseException) -> LakeError | None:
    """The LakeError behind ``exc``, also inside a (trio nursery) ExceptionGroup."""
    if isinstance(exc, LakeError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = lake_error_in(inner)
            if found is not None:
                return found
    return None
