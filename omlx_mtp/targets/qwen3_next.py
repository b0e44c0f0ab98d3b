"""Qwen3-Next (``qwen3_next``, Qwen3-Next-80B-A3B) as mlx-lm builds it: the hybrid walk of
``qwen3_5.HybridTarget`` over mlx-lm's own Qwen3-Next layers, unchanged.

Its Gated DeltaNet (fused ``in_proj_qkvz`` / ``in_proj_ba``) takes the mask and the cache's
per-row ``lengths`` as Qwen3.5's does (mlx-lm 0.31.3 and 0.32.x), so ``LinearStateCache``
takes its state back per row the same way.  The text model is the top-level model itself:
``model`` the body, ``lm_head``, ``args`` — no ``language_model`` wrapper, no vision tower."""

from __future__ import annotations

from mlx_lm.models import qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .qwen3_5 import HybridTarget


class Qwen3NextMlxLmTarget(HybridTarget):
    family = "Qwen3-Next (mlx-lm)"
    decoder_layer = qwen3_next.Qwen3NextDecoderLayer
    cache_classes = (KVCache, RotatingKVCache)
    state_cache_class = ArraysCache

    def __init__(self, model, compiled: bool | None = None):
        if not isinstance(model, qwen3_next.Model):
            raise TypeError(f"expected an mlx-lm Qwen3-Next model, got {type(model).__name__}")
        super().__init__(model, model)

    @classmethod
    def matches(cls, model) -> bool:
        return isinstance(model, qwen3_next.Model)

    def plain_model(self):
        return self.model
