"""What the hybrid Qwen trunks share — Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next: layers
mostly Gated DeltaNet linear attention, with full attention every ``full_attention_interval``
layers.  ``HybridTarget`` is the walk; a family names its mlx-lm decoder layer (``decoder_layer``,
which the built-in MTP head is built from too) and says where the host keeps the text model.

The forward runs mlx-lm's own layers (``mlx_lm.models.qwen3_5`` or ``qwen3_next``, whose layers
take the same arguments and cache protocol).  The layer loop is walked here
rather than through the host's text model, for one reason: each linear-attention layer's input is
handed to its cache (``LinearStateCache.record``), so that a verify whose drafts are rejected can
take the layer's state back per row.  Full-attention layers run on this package's K/V caches; their
RoPE position is the cache's ``offset``: a row's length plus its shift (multimodal prompts, whose
image tokens take fewer positions than tokens).

The built-in MTP head reads the trunk's final-normed hidden state, as vLLM and mlx-vlm feed it
(later oMLX measured a few points more acceptance on Qwen3.6-27B than with the pre-norm state).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask

from ..decode.cache import SlotTable, PositionalKVCache
from ..decode.linear_state import LinearStateCache
from ..errors import CheckpointError
from .base import Target, pipelined, stage_layers, whole_vocabulary


class HybridTarget(Target):
    sliding_window = None
    decoder_layer: type  # the family's mlx-lm decoder layer class (args, layer_idx)

    def __init__(self, model, text):
        """text: mlx-lm's text model (``.model`` the body, ``.args``, ``.lm_head``)."""
        self.text = text
        self.body = text.model
        self.args = text.args
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.layers = stage_layers(self.body)  # a pipeline stage's own layers on a sharded trunk
        self.linear = [layer.is_linear for layer in self.layers]
        if all(self.linear):
            stages = getattr(self.body, "pipeline_size", 1)
            if stages == 1:
                raise TypeError(f"a {self.family} model without full-attention layers")
            # The loop counts a row's tokens in a full-attention layer's table; linear states
            # hold no count, and a host cache of them could not say where a request stands.
            raise CheckpointError(
                f"pipeline stage {self.body.pipeline_rank} of {stages} holds only linear-attention layers "
                f"({len(self.layers)} of them): MTP needs a full-attention layer on every stage (one in every "
                f"{self.args.full_attention_interval} layers); use fewer ranks")
        # The trunk's forwards mutate linear states in ways a compiled graph of K/V caches can't follow.
        super().__init__(model, compiled=False)

    @property
    def dtype(self):
        return self.body.norm.weight.dtype

    def make_cache(self, batch_size: int, slack: int) -> list:
        table = SlotTable(batch_size, window=None, slack=slack)
        return [LinearStateCache(layer, batch_size) if linear else PositionalKVCache(table)
                for layer, linear in zip(self.layers, self.linear)]

    def input_embedding(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def hidden(self, tokens: mx.array, cache: list, embeddings: mx.array | None = None) -> mx.array:
        """The trunk's final-normed hidden states, [B, L, H]."""
        h = self.body.embed_tokens(tokens) if embeddings is None else embeddings
        full = next((c for c, linear in zip(cache, self.linear) if not linear), None)  # a stage may have none
        mask = None if full is None else create_attention_mask(h, full)

        def run_layers(h):
            for layer, linear, c in zip(self.layers, self.linear, cache):
                if linear:
                    c.record(h)
                h = layer(h, mask=None if linear else mask, cache=c)
            return h

        return self.body.norm(pipelined(self.body, h, run_layers))

    def head(self, normed: mx.array) -> mx.array:
        """The LM head, which the MTP head shares."""
        if self.args.tie_word_embeddings:
            return self.body.embed_tokens.as_linear(normed)
        return whole_vocabulary(self.text, self.text.lm_head(normed))


class Qwen35Target(HybridTarget):
    decoder_layer = qwen3_5.DecoderLayer
