"""Qwen3.5 / Qwen3.6 as mlx-vlm builds them: the published checkpoints (``qwen3_5`` and
``qwen3_5_moe`` with a ``vision_config``) that oMLX serves through its VLM engine.

mlx-vlm's language model holds the same parameter tree as mlx-lm's ``qwen3_5.TextModel``, so the
decode and verify forwards run mlx-lm's layers over mlx-vlm's own arrays (shared, never copied;
quantized layers are built to match before they take the arrays).  That keeps one trunk walk for
both hosts, with mlx-lm's linear-attention layer the rollback replays, whatever the mlx-vlm
release's internals (its GDN kernels and cache protocol changed between 0.5 and 0.7).

The full-attention layers are the exception: they run mlx-vlm's own attention, because its
multimodal RoPE rounds differently from mlx-lm's in half precision, and MTP must decode with the
host's numbers.  Text tokens after an image sit at ``position + rope_delta`` (an image takes fewer
mRoPE positions than tokens); those positions, all three sections equal, are passed in from each
row's RoPE offset.  Image prompts themselves are prefilled by the host's own model and caches."""

from __future__ import annotations

import contextlib
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
        text = mlx_lm_text_over(vlm_text)
        for ours, theirs in zip(text.model.layers, vlm_text.model.layers):
            if not ours.is_linear:
                ours.self_attn = HostAttention(theirs.self_attn)
        super().__init__(model, text)

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

    def hidden(self, tokens: mx.array, cache: list, embeddings: mx.array | None = None) -> mx.array:
        with _text_only_rope():
            return super().hidden(tokens, cache, embeddings)

    def plain_model(self):
        return LogitsOnly(self.vlm_text)


class HostAttention(nn.Module):
    """mlx-vlm's attention module of a full-attention layer, as mlx-lm's decoder layer calls one,
    given the forward's mRoPE positions: each row's RoPE offset onwards, the three sections equal."""

    def __init__(self, attention):
        super().__init__()
        self.host = attention

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        start = mx.array(cache.table.rope_offsets(), dtype=mx.int32)[:, None]
        positions = mx.broadcast_to((start + mx.arange(L, dtype=mx.int32)[None])[None], (3, B, L))
        return self.host(x, mask, _PerRowOffsets(cache), positions)


class _PerRowOffsets:
    """A cache as mlx-vlm's attention reads it beside explicit positions: ``offset`` per row, as an
    array (mlx-vlm only sizes the mask by it; oMLX's patched attention then takes the positions)."""

    def __init__(self, cache):
        self._cache = cache
        self.offset = mx.array(cache.table.lengths, dtype=mx.int32)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def _text_only_rope():
    """oMLX patches mlx-vlm's attention to probe each call's positions with host syncs unless told
    they are text tokens, which decode and verify forwards always are."""
    try:
        from omlx.patches.qwen3_5_attention import force_text_only_rope
    except ImportError:
        return contextlib.nullcontext()
    return force_text_only_rope()


def mlx_lm_text_over(vlm_text) -> qwen3_5.TextModel:
    """mlx-lm's text model holding mlx-vlm's arrays.  Its own initial weights are never evaluated
    (MLX is lazy), so this costs no memory; a tree that differs in any name or shape is refused."""
    config = vlm_text.args
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    text = qwen3_5.TextModel(qwen3_5.TextModelArgs.from_dict(values))
    quantized = {path: _quantization(module) for path, module in vlm_text.named_modules() if _quantization(module)}
    if quantized:
        nn.quantize(text, class_predicate=lambda path, _: quantized.get(path, False))
    # An MTP module a host attached to mlx-vlm's model (oMLX 0.4 on binds the head there) is not the trunk's.
    theirs = {k: v for k, v in tree_flatten(vlm_text.parameters()) if not k.startswith("mtp.")}
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
