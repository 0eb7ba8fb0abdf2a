"""The promoter's counters (for ``aifs status`` and the metrics endpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromoteStats:
    uploads: int = 0
    upload_bytes: int = 0
    metadata_updates: int = 0
    deletes: int = 0
    failures: int = 0
