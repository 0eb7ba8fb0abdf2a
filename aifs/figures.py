"""What a running mount counts, as plain values: the snapshot the facade hands
out (:meth:`aifs.core.Filesystem.figures`, gathered by
:class:`aifs.posix.tally.Tally`) and :mod:`aifs.metrics` renders, as the JSON
of ``aifs status`` (the root's ``user.aifs.metrics`` xattr) and as Prometheus
text.

Each section's field names are the keys of its object in that JSON, in its
order (:func:`dataclasses.asdict` writes it). No part of the filesystem here:
a consumer of the figures sees these values, never the parts that keep them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheFigures:
    capacity_bytes: int
    bytes: dict[str, int]  # by tier: memory, blocks (of lake objects), files (local copies)
    dirty_bytes: int  # of local copies not yet in the lake
    by_policy: dict[str, int]  # bytes on the cache disk, by checkpoint policy
    by_class: dict[str, int]  # bytes of cached blocks, by class (aifs.cache.blocks.CLASSES)
    refused: int  # blocks the cache did not admit
    hits: dict[str, int]  # reads answered without the lake: memory, disk, local
    misses: int  # reads that waited for the lake
    hit_ratio: float
    evictions: int  # blocks and local files
    disk_full: int  # times the cache disk was found full


@dataclass(frozen=True, slots=True)
class RecoveredFigures:
    directory: str  # where copies the metadata could not take were kept
    files: int


@dataclass(frozen=True, slots=True)
class PromotionFigures:
    pending_files: int
    pending_bytes: int
    pending_deletes: int
    uploading: int
    oldest_age_s: float
    uploads: int
    upload_bytes: int
    deletes: int
    metadata_updates: int
    failures: int


@dataclass(frozen=True, slots=True)
class LakeFigures:
    requests: dict[str, int]  # by S3 operation (aifs.lake.counting.OPERATIONS)
    errors: dict[str, int]
    request_seconds: dict[str, float]
    retries: dict[str, int]  # by cause (aifs.errors.CAUSES)
    read_bytes: int
    written_bytes: int


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """Requests from the kernel that reached the daemon (the JSON's ``fs``)."""

    read_requests: int
    read_bytes: int
    write_requests: int
    write_bytes: int
    lookup_requests: int
    open_files: int


@dataclass(frozen=True, slots=True)
class PrefetchFigures:
    directory_scans: int
    directory_objects: int
    directory_peak_bytes: int
    attributes_ahead: int


@dataclass(frozen=True, slots=True)
class Throughput:
    """Bytes per second over the last few seconds (sampled once a second)."""

    read_bytes_per_s: float = 0.0
    write_bytes_per_s: float = 0.0
    lake_read_bytes_per_s: float = 0.0
    lake_written_bytes_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Figures:
    lake_url: str
    cache: CacheFigures
    recovered: RecoveredFigures
    promotion: PromotionFigures
    lake: LakeFigures
    fs: RequestFigures
    prefetch: PrefetchFigures
    throughput: Throughput
