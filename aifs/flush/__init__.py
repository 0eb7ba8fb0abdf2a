"""Promotion of local changes to the lake."""

from aifs.flush.promoter import Promoter

__all__ = ["Promoter"]
