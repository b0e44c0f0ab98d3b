"""Qwen3.5 / Qwen3.6 as mlx-vlm builds them: the published checkpoints (``qwen3_5`` and
``qwen3_5_moe`` with a ``vision_config``) that oMLX serves through its VLM engine.

mlx-vlm's language model holds the same parameter tree as mlx-lm's ``qwen3_5.TextModel``, so the
decode and verify forwards run mlx-lm's layers over mlx-vlm's own arrays (shared, never copied;
quantized layers are built to match before they take the arrays).  That keeps one trunk walk for
both hosts, with mlx-lm's linear-attention layer the rollback replays, whatever the mlx-vlm
release's internals (its GDN kernels and cache protocol changed between 0.5 and 0.7).

Text tokens after an image sit at ``position + rope_delta`` (the vision tokens of mRoPE take fewer
positions than tokens); with the three mRoPE sections equal, mRoPE is plain RoPE at that position,
which is what the mlx-lm layers apply when the cache's offset carries the row's shift.  Image
prompts themselves are prefilled by the host's own model and caches."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_5

from .base import LogitsOnly
from .qwen3_5 import Qwen35Target

_MODULES = ("mlx_vlm.models.qwen3_5.", "mlx_vlm.models.qwen3_5_moe.")


class Qwen35MlxVlmTarget(Qwen35Target):
    family = "Qwen3.5 (mlx-vlm)"

    def __init__(self, model, compiled: bool | None = None):
        vlm_text = getattr(model, "language_model", model)
        if not type(vlm_text).__module__.startswith(_MODULES):
            raise TypeError(f"expected an mlx-vlm Qwen3.5 model, got {type(vlm_text).__name__}")
        self.vlm_text = vlm_text
        super().__init__(model, mlx_lm_text_over(vlm_text))

    @classmethod
    def matches(cls, model) -> bool:
        return type(getattr(model, "language_model", model)).__module__.startswith(_MODULES)

    @property
    def cache_classes(self):
        from mlx_vlm.models import cache

        return cache.KVCache, cache.RotatingKVCache

    @property
    def state_cache_class(self):
        from mlx_vlm.models import cache

        return cache.ArraysCache

    def plain_model(self):
        return LogitsOnly(self.vlm_text)


def mlx_lm_text_over(vlm_text) -> qwen3_5.TextModel:
    """mlx-lm's text model holding mlx-vlm's arrays.  Its own initial weights are never evaluated
    (MLX is lazy), so this costs no memory; a tree that differs in any name or shape is refused."""
    config = vlm_text.args
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    text = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(values))
    quantized = {path: _quantization(module) for path, module in vlm_text.named_modules() if _quantization(module)}
    if quantized:
        nn.quantize(text, class_predicate=lambda path, _: quantized.get(path, False))
    theirs = dict(tree_flatten(vlm_text.parameters()))
    ours = dict(tree_flatten(text.parameters()))
    differ = sorted(set(theirs) ^ set(ours)) + sorted(k for k in theirs.keys() & ours.keys() if theirs[k].shape != ours[k].shape)
    if differ:
        raise TypeError(f"mlx-vlm's Qwen3.5 language model does not match mlx-lm's ({len(differ)} parameters "
                        f"differ, e.g. {differ[0]})")
    text.update(tree_unflatten(list(theirs.items())))  # leaves only: mlx-vlm may add empty modules
    return text


def _quantization(module) -> dict | None:
    if not type(module).__name__.startswith("Quantized") or not hasattr(module, "bits"):
        return None
    return {"group_size": module.group_size, "bits": module.bits, "mode": getattr(module, "mode", "affine")}
