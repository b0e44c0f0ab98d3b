"""The one interface the decode loop, the drafters and the host glue use to drive a target model.

A family module (one per host model family: which library built the model, which architecture)
wraps the host's model object as it is — weights are never copied or loaded twice — and provides:

* ``hidden(tokens, cache)``: final-normed hidden states [B, L, H] of a forward that writes K/V into
  ``cache`` (this package's ``PositionalKVCache`` list or the traced stand-ins of the compiled forward);
* ``head(hidden)``: logits; ``input_embedding(tokens)``: what the first layer sees for tokens;
* ``make_cache(batch, slack)``, ``kv_source(cache, layer_type)``: caches, and the K/V a drafter reads;
* ``plain_model()``: a callable for mlx-lm's own decode loops (logits out), the reference MTP matches;
  it also takes a prompt's ``embeddings`` (images, audio), which only the host's own prefill sees
  (``prefill_on_host``), with the host's own masks, as oMLX prefills before it hands a request on;
* ``cache_classes``: the host's (full, sliding) cache types, for caches handed back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..decode.compiled_forward import CompiledForward, compiled_forward_exact


@dataclass
class PromptEmbeddings:
    """Input embeddings for a whole prompt ([1, L, H], as the host's vision/audio merge made them)
    and per-position extras of the same length L along axis 1 (e.g. Gemma 4's per-layer inputs)."""

    inputs_embeds: mx.array
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        length = self.inputs_embeds.shape[1]
        for name, value in self.extra.items():
            if value.shape[1] != length:
                raise ValueError(f"{name} covers {value.shape[1]} positions, the embeddings {length}")

    def __len__(self) -> int:
        return self.inputs_embeds.shape[1]

    def head(self, length: int) -> "PromptEmbeddings":
        return PromptEmbeddings(self.inputs_embeds[:, :length], {k: v[:, :length] for k, v in self.extra.items()})


def prefill_on_host(plain_model, prompt: list[int], embeddings: PromptEmbeddings) -> list:
    """The host's own caches after all but the last prompt token, fed with their embeddings in one
    forward (the host's masks apply: mlx-vlm 0.7 lets an image's tokens see each other) — what oMLX
    does before it inserts a request with its last token."""
    if len(embeddings) != len(prompt):
        raise ValueError(f"embeddings cover {len(embeddings)} positions, the prompt {len(prompt)}")
    cache = make_prompt_cache(plain_model)
    if len(prompt) > 1:
        plain_model(mx.array([prompt[:-1]], dtype=mx.int32), cache=cache, embeddings=embeddings.head(len(prompt) - 1))
        mx.eval([c.state for c in cache])
    return cache


class Target:
    family = "target"

    def __init__(self, model, compiled: bool | None = None):
        """compiled: run short forwards on this package's caches as one compiled graph (default:
        where this mlx's compiled graphs round exactly as its op-by-op ones)."""
        self.model = model
        if compiled is None:
            compiled = compiled_forward_exact()
        self.compiled = CompiledForward(self) if compiled else None

    @classmethod
    def matches(cls, model) -> bool:
        raise NotImplementedError

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [B, L] -> (logits [B, L, V], final-normed hidden [B, L, H])."""
        if self.compiled is not None and self.compiled.accepts(tokens, cache):
            return self.compiled(tokens, cache)
        hidden = self.hidden(tokens, cache)
        return self.head(hidden), hidden

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        raise NotImplementedError

    def head(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def plain_model(self):
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.family} ({type(self.model).__module__}.{type(self.model).__name__})"
