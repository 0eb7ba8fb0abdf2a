"""Live figures of a running mount: one snapshot for ``aifs status`` (read
through the root's ``user.aifs.metrics`` xattr) and, in Prometheus' text
format (written by ``prometheus_client``), for an optional HTTP endpoint
bound to 127.0.0.1.

The figures are counters the layers keep anyway (the fetcher's hits and
misses, the promoter's uploads, the lake wrapper's requests); the facade
gathers them into one :class:`~aifs.figures.Figures` per request
(:meth:`aifs.core.Filesystem.figures`, handed to :class:`Metrics` as a
callable) and this module only renders it: it sees those values, never the
filesystem's parts (nothing here imports ``aifs.core`` or ``aifs.posix``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import trio
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from aifs import __version__
from aifs.figures import Figures

log = logging.getLogger(__name__)

class Metrics:
    """What ``aifs status`` and the endpoint show: the figures ``figures``
    returns (called once per snapshot), with the facts of this process."""

    def __init__(self, figures: Callable[[], Figures]) -> None:
        self.figures = figures
        self.started = time.time()
        self.url = ""  # of the HTTP endpoint, once it serves
        self.registry = registry_of(self.snapshot)  # what /metrics exposes

    def snapshot(self) -> dict[str, Any]:
        figures = self.figures()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "lake_url": figures.lake_url,
            "uptime_s": round(time.time() - self.started, 1),
            "metrics_url": self.url,
            "cache": asdict(figures.cache),
            "recovered": asdict(figures.recovered),
            "promotion": asdict(figures.promotion),
            "lake": asdict(figures.lake),
            "fs": asdict(figures.fs),
            "prefetch": asdict(figures.prefetch),
            "throughput": asdict(figures.throughput),
        }


# -- Prometheus text format (prometheus_client writes it) -----------------------
# (name, type, help, how to get the value(s) from a snapshot)
Getter = Callable[[dict[str, Any]], "float | dict[str, float]"]
_FAMILIES: list[tuple[str, str, str, str, Getter]] = [
    ("aifs_uptime_seconds", "gauge", "Seconds since the mount started.", "",
     lambda s: s["uptime_s"]),
    ("aifs_cache_capacity_bytes", "gauge", "Capacity of the local cache.", "",
     lambda s: s["cache"]["capacity_bytes"]),
    ("aifs_cache_bytes", "gauge", "Bytes cached, by tier (memory, blocks of lake "
     "objects, whole local files).", "tier", lambda s: s["cache"]["bytes"]),
    ("aifs_cache_dirty_bytes", "gauge", "Bytes of local files not yet in the lake.", "",
     lambda s: s["cache"]["dirty_bytes"]),
    ("aifs_cache_policy_bytes", "gauge", "Bytes cached on the local disk, by policy.",
     "policy", lambda s: s["cache"]["by_policy"]),
    ("aifs_cache_class_bytes", "gauge", "Bytes of cached blocks by class: regular (LRU), "
     "dataset (a stable subset) and pinned (never evicted).", "class",
     lambda s: s["cache"]["by_class"]),
    ("aifs_cache_refused_total", "counter", "Blocks the cache did not admit (a full "
     "dataset share keeps its subset instead).", "", lambda s: s["cache"]["refused"]),
    ("aifs_cache_hits_total", "counter", "Reads answered without waiting for the lake, "
     "by where they were found.", "tier", lambda s: s["cache"]["hits"]),
    ("aifs_cache_misses_total", "counter", "Reads that waited for the lake.", "",
     lambda s: s["cache"]["misses"]),
    ("aifs_prefetch_directory_objects_total", "counter", "Small objects fetched ahead "
     "of their readers by a directory scan.", "",
     lambda s: s["prefetch"]["directory_objects"]),
    ("aifs_cache_hit_ratio", "gauge", "Hits over all reads that reached the daemon.", "",
     lambda s: s["cache"]["hit_ratio"]),
    ("aifs_cache_evictions_total", "counter", "Blocks and local files evicted.", "",
     lambda s: s["cache"]["evictions"]),
    ("aifs_promotion_pending_files", "gauge", "Files and directories with changes not "
     "yet in the lake.", "", lambda s: s["promotion"]["pending_files"]),
    ("aifs_promotion_pending_bytes", "gauge", "Bytes of file data not yet in the lake.",
     "", lambda s: s["promotion"]["pending_bytes"]),
    ("aifs_promotion_pending_deletes", "gauge", "Deletes not yet made in the lake.", "",
     lambda s: s["promotion"]["pending_deletes"]),
    ("aifs_promotion_uploading", "gauge", "Promotions running now.", "",
     lambda s: s["promotion"]["uploading"]),
    ("aifs_promotion_oldest_age_seconds", "gauge", "Age of the oldest change not yet in "
     "the lake.", "", lambda s: s["promotion"]["oldest_age_s"]),
    ("aifs_promotion_uploads_total", "counter", "Files uploaded to the lake.", "",
     lambda s: s["promotion"]["uploads"]),
    ("aifs_promotion_upload_bytes_total", "counter", "Bytes of files uploaded.", "",
     lambda s: s["promotion"]["upload_bytes"]),
    ("aifs_promotion_deletes_total", "counter", "Keys deleted from the lake.", "",
     lambda s: s["promotion"]["deletes"]),
    ("aifs_promotion_failures_total", "counter", "Promotions that failed (retried later).",
     "", lambda s: s["promotion"]["failures"]),
    ("aifs_lake_requests_total", "counter", "Lake requests, by S3 operation (retries not "
     "included).", "op", lambda s: s["lake"]["requests"]),
    ("aifs_lake_errors_total", "counter", "Lake requests that failed after their retries, "
     "by S3 operation.", "op", lambda s: s["lake"]["errors"]),
    ("aifs_lake_request_seconds_total", "counter", "Seconds spent waiting for the lake, "
     "by S3 operation.", "op", lambda s: s["lake"]["request_seconds"]),
    ("aifs_lake_retries_total", "counter", "Lake requests made again after a transient "
     "failure, by its cause.", "cause", lambda s: s["lake"]["retries"]),
    ("aifs_lake_read_bytes_total", "counter", "Bytes read from the lake.", "",
     lambda s: s["lake"]["read_bytes"]),
    ("aifs_lake_written_bytes_total", "counter", "Bytes written to the lake.", "",
     lambda s: s["lake"]["written_bytes"]),
    ("aifs_fs_read_requests_total", "counter", "Read requests from the kernel.", "",
     lambda s: s["fs"]["read_requests"]),
    ("aifs_fs_lookup_requests_total", "counter", "Name lookups from the kernel (the entries "
     "of a listing come with their attributes; a walk that needs none is a good sign).", "",
     lambda s: s["fs"]["lookup_requests"]),
    ("aifs_fs_read_bytes_total", "counter", "Bytes read through the mount.", "",
     lambda s: s["fs"]["read_bytes"]),
    ("aifs_fs_write_requests_total", "counter", "Write requests from the kernel.", "",
     lambda s: s["fs"]["write_requests"]),
    ("aifs_fs_write_bytes_total", "counter", "Bytes written through the mount.", "",
     lambda s: s["fs"]["write_bytes"]),
    ("aifs_fs_open_files", "gauge", "Files open through the mount.", "",
     lambda s: s["fs"]["open_files"]),
]


class SnapshotCollector(Collector):
    """A Prometheus collector over a snapshot: each scrape takes one (a
    :meth:`Metrics.snapshot`) and yields the families above from it."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        info = GaugeMetricFamily("aifs_info", "The aifs version and the lake of this mount.",
                                 labels=["version", "lake"])
        info.add_metric([snapshot["version"], snapshot["lake_url"]], 1)
        yield info
        for name, kind, text, label, get in _FAMILIES:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            value = get(snapshot)
            if isinstance(value, dict):
                metric = family(name, text, labels=[label])
                for key, number in value.items():
                    metric.add_metric([str(key)], number)
            else:
                metric = family(name, text, value=value)
            yield metric


def registry_of(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) that
    collects from ``snapshot``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


def prometheus_text(snapshot: dict[str, Any]) -> str:
    """``snapshot`` in Prometheus' text format (version 0.0.4)."""
    return generate_latest(registry_of(lambda: snapshot)).decode()


# -- the HTTP endpoint --------------------------------------------------------
MAX_REQUEST = 8192


async def serve_http(address: str, port: int, metrics: Metrics,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer ``GET /metrics`` (Prometheus) and ``GET /metrics.json`` on
    ``address:port``; report the bound port (0 picks a free one)."""
    import json

    async def answer(stream: trio.SocketStream) -> None:
        try:
            request = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    request += chunk
            parts = request.split(b"\r\n", 1)[0].split()
            path = parts[1].decode(errors="replace").split("?", 1)[0] if len(parts) > 1 else ""
            if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
                status, kind, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, kind = "200 OK", CONTENT_TYPE_PLAIN_0_0_4
                body = generate_latest(metrics.registry)
            elif path == "/metrics.json":
                status, kind = "200 OK", "application/json"
                body = json.dumps(metrics.snapshot(), indent=1).encode()
            else:
                status, kind, body = "404 Not Found", "text/plain", b"try /metrics\n"
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
            await stream.send_all(head + (body if parts[:1] != [b"HEAD"] else b""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()

    try:
        listeners = await trio.open_tcp_listeners(port, host=address)
    except OSError as exc:
        log.error("metrics endpoint %s:%d: %s; serving without it", address, port,
                  exc.strerror)
        task_status.started(0)
        return
    bound = listeners[0].socket.getsockname()[1]
    host = f"[{address}]" if ":" in address else address
    metrics.url = f"http://{host}:{bound}/metrics"
    log.info("metrics on %s", metrics.url)
    task_status.started(bound)
    await trio.serve_listeners(answer, listeners)
