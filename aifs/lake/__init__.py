"""Lake access: :func:`open_store` turns a lake URL into an ObjectStore.

:mod:`~aifs.lake.base` is the one interface (head, ranged get, put,
multipart, list, delete many, copy); :mod:`~aifs.lake.s3` (boto3, with
:mod:`~aifs.lake.s3http` for HEAD, GET and LIST, sent over the keep-alive
connections of :mod:`~aifs.lake.http1`) and :mod:`~aifs.lake.local` (a
directory, the embedded default) implement it; :mod:`~aifs.lake.retry` wraps
any store with the one backoff, :mod:`~aifs.lake.longkeys` stores keys longer
than S3 holds under short ones, :mod:`~aifs.lake.counting` counts requests,
:mod:`~aifs.lake.faulty` fails on purpose (tests).

May import ``config``, ``errors`` and ``xattrs`` only.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from aifs.config import Config
from aifs.errors import ConfigError
from aifs.lake.base import ListPage, ObjectInfo, ObjectStore

__all__ = ["ListPage", "ObjectInfo", "ObjectStore", "local_directory", "open_store"]


def open_store(config: Config) -> ObjectStore:
    """Build the store for ``config``'s lake URL (s3:// or file://), its calls
    retried with backoff."""
    from aifs.lake.retry import RetryingStore, RetryPolicy
    return RetryingStore(_open_one(config), RetryPolicy(attempts=config.retries))


def local_directory(config: Config) -> str | None:
    """The directory of ``config``'s lake if it is a local one (file://)."""
    url = config.resolved_lake()
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError(f"file:// lake must be local: {url}")
    return unquote(parsed.path)


def _open_one(config: Config) -> ObjectStore:
    if (directory := local_directory(config)) is not None:
        from aifs.lake.local import LocalStore
        return LocalStore(directory, max_threads=config.max_connections)
    url = config.resolved_lake()
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        from aifs.lake.longkeys import LongKeys
        from aifs.lake.s3 import S3Store
        if not parsed.netloc:
            raise ConfigError(f"no bucket in lake URL {url} (use s3://BUCKET[/PREFIX])")
        return LongKeys(S3Store(
            parsed.netloc, unquote(parsed.path), endpoint_url=config.endpoint_url,
            region=config.region, profile=config.profile, path_style=config.path_style,
            max_connections=config.max_connections, timeout=config.request_timeout,
            sign_payload=config.sign_payload))
    raise ConfigError(f"unsupported lake URL {url!r} (use s3://BUCKET/PREFIX or file:///DIR)")
