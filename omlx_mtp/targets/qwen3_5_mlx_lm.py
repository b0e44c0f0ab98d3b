"""Qwen3.5 / Qwen3.6 as mlx-lm builds them (``qwen3_5``, ``qwen3_5_moe``): the text checkpoints
oMLX serves through its LLM engine.  mlx-lm's model runs unchanged."""

from __future__ import annotations

from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .qwen3_5 import Qwen35Target


class Qwen35MlxLmTarget(Qwen35Target):
    family = "Qwen3.5 (mlx-lm)"
    cache_classes = (KVCache, RotatingKVCache)
    state_cache_class = ArraysCache

    def __init__(self, model, compiled: bool | None = None):
        text = getattr(model, "language_model", model)
        if not isinstance(text, qwen3_5.TextModel):
            raise TypeError(f"expected an mlx-lm Qwen3.5 model, got {type(text).__name__}")
        super().__init__(model, text)

    @classmethod
    def matches(cls, model) -> bool:
        return isinstance(getattr(model, "language_model", model), qwen3_5.TextModel)

    def plain_model(self):
        return self.model
