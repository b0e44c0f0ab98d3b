"""What the mlx-lm trunks made of attention layers only share (GLM-4.x MoE, DeepSeek-V3.x): a body
``model.model`` (``embed_tokens``, ``layers``, final ``norm``) and an ``lm_head``.  The family
modules say which mlx-lm models they wrap and how many K/V caches one layer keeps.

The forward is the host's own body, run on this package's K/V caches: it returns the final-normed
hidden state, which is what these families' MTP layers read (their reference modeling; vLLM's GLM
and DeepSeek-V3.2 acceptance rose when it switched to that state).

The built-in MTP layer these checkpoints ship ("nextn") is one more decoder layer of the trunk's own
kind, stored at index ``num_hidden_layers``.  The target builds that layer and converts its tensors
with the host model's own sanitizer, so a drafter never re-implements a family's decoder layer or its
checkpoint conventions (stacked experts, DeepSeek's split ``kv_b_proj``, fp8 blocks).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from ..decode import cache as caches
from .base import Target, stage_layers, whole_vocabulary


class AttentionStackTarget(Target):
    sliding_window = None
    cache_classes = (KVCache, RotatingKVCache)
    caches_per_layer = 1  # K/V caches one layer keeps (DeepSeek-V3.2: its MLA latents and its indexer's keys)
    model_classes: tuple = ()  # the mlx-lm ``Model`` classes a family module wraps

    def __init__(self, model, compiled: bool | None = None):
        if not isinstance(model, self.model_classes):
            raise TypeError(f"expected an mlx-lm {self.family} model, got {type(model).__name__}")
        self.text = model
        self.body = model.model
        self.args = model.args
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        super().__init__(model, compiled)

    @classmethod
    def matches(cls, model) -> bool:
        return isinstance(model, cls.model_classes)

    @property
    def dtype(self):
        return self.body.norm.weight.dtype

    @property
    def num_layers(self) -> int:
        return len(stage_layers(self.body))  # a pipeline stage's own, on a sharded trunk

    # -- the loop's target interface --------------------------------------------------------
    def make_cache(self, batch_size: int, slack: int) -> list:
        return caches.make_caches([None] * (self.num_layers * self.caches_per_layer), batch_size, slack)

    def layer_caches(self, cache: list) -> list:
        """A flat cache list as the host's layers take it: one cache each, or a list per layer."""
        n = self.caches_per_layer
        cache = cache[: self.num_layers * n]  # the loop keeps a drafter's own caches after the target's
        return cache if n == 1 else [cache[i : i + n] for i in range(0, len(cache), n)]

    def input_embedding(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        """The trunk's final-normed hidden states, [B, L, H]."""
        return self.body(tokens, cache=self.layer_caches(cache))

    def head(self, hidden: mx.array) -> mx.array:
        if getattr(self.args, "tie_word_embeddings", False):
            return self.body.embed_tokens.as_linear(hidden)
        return whole_vocabulary(self.text, self.text.lm_head(hidden))

    def kv_source(self, cache: list, layer_type: str):
        raise TypeError(f"{self.family} targets serve built-in MTP layers, which keep their own K/V")

    def plain_model(self):
        return self.model

    def host_cache_groups(self, host_caches: list) -> list:
        """The host's per-layer caches as the flat list this package keeps (mlx-lm's ``CacheList``
        holds several caches of one layer)."""
        flat = []
        for layer in host_caches:
            flat += list(layer.caches) if isinstance(layer, CacheList) else [layer]
        return flat

    def host_cache_layers(self, flat: list) -> list:
        """The inverse of ``host_cache_groups``: the host's own per-layer caches."""
        n = self.caches_per_layer
        return flat if n == 1 else [CacheList(*flat[i : i + n]) for i in range(0, len(flat), n)]

    # -- the built-in MTP layer ("nextn"), for the drafter that runs it ---------------------
    @property
    def mtp_layer_index(self) -> int:
        """Where checkpoints store the MTP layer: one past the trunk (by config, never a constant)."""
        return int(self.args.num_hidden_layers)

    def mtp_decoder_layer(self):
        """A fresh decoder layer of the trunk's own kind at the MTP layer's index (MoE where the
        index is past ``first_k_dense_replace``, as in every published checkpoint)."""
        return type(self.body.layers[-1])(self.args, self.mtp_layer_index)

    def sanitize_layer(self, weights: dict) -> dict:
        """One decoder layer's tensors (names relative to the layer) converted by the host model's
        own sanitizer, as it converts a trunk layer.  The layer is named as trunk layer 0 for the
        call: mlx-lm's sanitizers drop everything at or past ``num_hidden_layers`` (deepseek_v3's
        by a fixed ``model.layers.61``), and convert only the layers below.  Idempotent: already
        converted tensors (a quantized checkpoint's) pass unchanged."""
        prefix = "model.layers.0."
        converted = self.text.sanitize({prefix + name: value for name, value in weights.items()})
        return {name[len(prefix):]: value for name, value in converted.items() if name.startswith(prefix)}
