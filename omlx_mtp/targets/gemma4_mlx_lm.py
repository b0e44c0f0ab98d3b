"""Gemma 4 as mlx-lm builds it (``gemma4_text``, or ``gemma4`` holding one as ``language_model``):
the text checkpoints oMLX serves through its LLM engine.  mlx-lm's model runs unchanged; its text
model already returns the final-normed hidden states, and the head is applied here."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma4_text
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .gemma4 import Gemma4Target


class Gemma4MlxLmTarget(Gemma4Target):
    family = "Gemma 4 (mlx-lm)"
    cache_classes = (KVCache, RotatingKVCache)

    def __init__(self, model, compiled: bool | None = None):
        text = getattr(model, "language_model", model)
        if not isinstance(text, gemma4_text.Model):
            raise TypeError(f"expected an mlx-lm Gemma 4 model, got {type(text).__name__}")
        super().__init__(model, text, text.args, compiled)

    @classmethod
    def matches(cls, model) -> bool:
        return isinstance(getattr(model, "language_model", model), gemma4_text.Model)

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        return self.body(tokens, cache=cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.text.tie_word_embeddings:
            logits = self.body.embed_tokens.as_linear(hidden)
        else:
            logits = self.text.lm_head(hidden)
        if self.text.final_logit_softcapping is not None:
            logits = gemma4_text.logit_softcap(self.text.final_logit_softcapping, logits)
        return logits

    def plain_model(self):
        return self.model  # takes no image or audio embeddings: it has no towers
