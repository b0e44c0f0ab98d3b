"""A wrapper around an mlx-lm Gemma 4 model that returns logits *and* the final-normed hidden
states from one forward, and exposes the K/V a drafter reads.  mlx-lm's model files are used
as they are: the text model already returns the normed hidden states; the head is applied here."""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models import gemma4_text

from ..gemma4_config import SLIDING
from .cache import PositionalKVCache, make_caches
from .compiled_forward import CompiledForward, compiled_forward_exact


class Gemma4Target:
    def __init__(self, model, compiled: bool | None = None):
        """compiled: run short forwards on this package's caches as one compiled graph (default:
        where this mlx's compiled graphs round exactly as its op-by-op ones)."""
        self.model = model
        self.text = getattr(model, "language_model", model)
        if not isinstance(self.text, gemma4_text.Model):
            raise TypeError(f"expected an mlx-lm Gemma 4 model, got {type(self.text).__name__}")
        self.body = self.text.model
        self.args = self.text.args
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.sliding_window = self.args.sliding_window
        self.embed_scale = math.sqrt(self.hidden_size)
        self.layer_types = list(self.args.layer_types)
        self.num_cached_layers = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        # The drafter reads, per layer type, the last target layer of that type that owns K/V.
        self.kv_owner = {t: i for i, t in enumerate(self.layer_types[: self.num_cached_layers])}
        if compiled is None:
            compiled = compiled_forward_exact()
        self.compiled = CompiledForward(self) if compiled else None

    @property
    def dtype(self):
        return self.body.norm.weight.dtype

    def make_cache(self, batch_size: int, slack: int) -> list[PositionalKVCache]:
        windows = [self.sliding_window if t == SLIDING else None for t in self.layer_types[: self.num_cached_layers]]
        return make_caches(windows, batch_size, slack)

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [B, L] -> (logits [B, L, V], final-normed hidden [B, L, H])."""
        if self.compiled is not None and self.compiled.accepts(tokens, cache):
            return self.compiled(tokens, cache)
        hidden = self.body(tokens, cache=cache)
        return self.head(hidden), hidden

    def head(self, hidden: mx.array) -> mx.array:
        if self.text.tie_word_embeddings:
            logits = self.body.embed_tokens.as_linear(hidden)
        else:
            logits = self.text.lm_head(hidden)
        if self.text.final_logit_softcapping is not None:
            logits = gemma4_text.logit_softcap(self.text.final_logit_softcapping, logits)
        return logits

    def input_embedding(self, tokens: mx.array) -> mx.array:
        """The target's own (dense or quantized) embedding, scaled as its first layer sees it."""
        return self.body.embed_tokens(tokens) * self.embed_scale

    def kv_source(self, cache: list, layer_type: str) -> PositionalKVCache:
        return cache[self.kv_owner[layer_type]]

