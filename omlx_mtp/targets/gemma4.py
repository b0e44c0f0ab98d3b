"""What every Gemma 4 host model shares: the layer layout (sliding and full attention, layers that
reuse an earlier layer's K/V), the caches built from it, and the K/V the assistant reads.  The
family modules say where the host keeps its text model and how it is called."""

from __future__ import annotations

import math

import mlx.core as mx

from ..decode.cache import PositionalKVCache, make_caches
from ..checkpoint.gemma4_config import SLIDING
from .base import Target


class Gemma4Target(Target):
    def __init__(self, model, text, args, compiled: bool | None = None):
        self.text = text  # the host's language model (body + head)
        self.body = text.model
        self.args = args
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.sliding_window = args.sliding_window
        self.embed_scale = math.sqrt(self.hidden_size)
        self.layer_types = list(args.layer_types)
        self.num_cached_layers = args.num_hidden_layers - (getattr(args, "num_kv_shared_layers", 0) or 0)
        # The drafter reads, per layer type, the last target layer of that type that owns K/V.
        self.kv_owner = {t: i for i, t in enumerate(self.layer_types[: self.num_cached_layers])}
        super().__init__(model, compiled)

    @property
    def dtype(self):
        return self.body.norm.weight.dtype

    def make_cache(self, batch_size: int, slack: int) -> list[PositionalKVCache]:
        windows = [self.sliding_window if t == SLIDING else None for t in self.layer_types[: self.num_cached_layers]]
        return make_caches(windows, batch_size, slack)

    def input_embedding(self, tokens: mx.array) -> mx.array:
        """The target's own (dense or quantized) embedding, scaled as its first layer sees it."""
        return self.body.embed_tokens(tokens) * self.embed_scale

    def kv_source(self, cache: list, layer_type: str) -> PositionalKVCache:
        return cache[self.kv_owner[layer_type]]
