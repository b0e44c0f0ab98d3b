"""Gemma 4 as mlx-vlm builds it: the multimodal checkpoints (``gemma4`` with a vision and maybe an
audio tower) that oMLX serves through its VLM engine.  The target is the model's language model;
the towers stay where they are and only ever run in the host's prefill of image or audio prompts.

mlx-vlm's layers run unchanged.  Its text model builds attention masks from the cache offsets with
a host sync (``.item()``) in some releases, which a compiled graph cannot do, so forwards on this
package's caches (decode and verify: text tokens only) take their masks from those caches, which know
every slot's position.  Image and audio prompts are prefilled by the host's own model and caches."""

from __future__ import annotations

import sys

import mlx.core as mx

from ..checkpoint.gemma4_config import SLIDING
from .base import LogitsOnly
from .gemma4 import Gemma4Target

_MODULE = "mlx_vlm.models.gemma4."  # the package's modules (not gemma4_* siblings)


class Gemma4MlxVlmTarget(Gemma4Target):
    family = "Gemma 4 (mlx-vlm)"

    def __init__(self, model, compiled: bool | None = None):
        text = getattr(model, "language_model", model)
        if not type(text).__module__.startswith(_MODULE):
            raise TypeError(f"expected an mlx-vlm Gemma 4 model, got {type(text).__name__}")
        self._host = sys.modules[type(text).__module__]  # mlx-vlm's gemma4 language module
        super().__init__(model, text, text.config, compiled)

    @classmethod
    def matches(cls, model) -> bool:
        return type(getattr(model, "language_model", model)).__module__.startswith(_MODULE)

    @property
    def cache_classes(self):
        return self._host.KVCache, self._host.RotatingKVCache

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        body = self.body
        body._make_masks = self._masks  # for this call only (an instance attribute shadows the method)
        try:
            return body(tokens, cache=cache)
        finally:
            del body._make_masks

    def _masks(self, h, cache, *_):
        """One mask per layer, from the first cache of each layer type (as mlx-vlm dedups them)."""
        N = h.shape[1]
        by_type: dict = {}
        out = []
        for layer, c in zip(self.body.layers, cache):
            kind = layer.layer_type
            if kind not in by_type:
                by_type[kind] = c.make_mask(N, window_size=self.sliding_window if kind == SLIDING else None)
            out.append(by_type[kind])
        return out

    def head(self, hidden: mx.array) -> mx.array:
        logits = self.body.embed_tokens.as_linear(hidden)
        softcap = getattr(self.text, "final_logit_softcapping", None)
        if softcap is not None:
            logits = self._host.logit_softcap(softcap, logits)
        return logits

    def plain_model(self):
        return LogitsOnly(self.text)

