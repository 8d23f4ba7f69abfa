from attnlab.cache.base import BufferCache, LayerCache, ModelCache
from attnlab.cache.dense import DenseCache
from attnlab.cache.ring import RingCache

__all__ = ["BufferCache", "LayerCache", "ModelCache", "DenseCache", "RingCache"]
