"""Serving caches: a paged pool of compressed rows and one sliding-window slot per sequence."""

from engine.cache.pool import CompressedPool
from engine.cache.spec import CacheSpec
from engine.cache.swa import SWASlots

__all__ = ["CacheSpec", "CompressedPool", "SWASlots"]
