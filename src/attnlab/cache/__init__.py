"""KV caches: the contract (base.py), the layout a variant declares (layout.py), every cache kind, built by
build.py, and the one helper that attends through any of them (attend.py)."""

from attnlab.cache.attend import attend_cache, attend_held, read_cache
from attnlab.cache.banks import BoundedCache, MemoryWrite
from attnlab.cache.base import BufferCache, LayerCache, ModelCache, Write
from attnlab.cache.build import build_cache
from attnlab.cache.dense import DenseCache
from attnlab.cache.layout import CacheLayout, Field, Read
from attnlab.cache.memories import H2OCache, MemoryCache, StreamingCache, WindowCache
from attnlab.cache.quantized import QuantizedCache, QuantizedRingCache
from attnlab.cache.ring import RingCache

__all__ = [
    "BufferCache", "LayerCache", "ModelCache", "Write", "DenseCache", "RingCache", "MemoryCache",
    "WindowCache", "StreamingCache", "H2OCache", "BoundedCache", "MemoryWrite", "QuantizedCache",
    "QuantizedRingCache", "CacheLayout", "Field", "Read", "build_cache", "attend_cache", "attend_held", "read_cache",
]  # fmt: skip
