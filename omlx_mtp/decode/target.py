"""What the decode loop needs of a target model, and of a prompt that brings its own embeddings.

The loop owns this interface; ``omlx_mtp.targets`` implements it once per host model family
(mlx-lm or mlx-vlm, one architecture each), wrapping the host's model object without copying it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


class TargetModel(Protocol):
    """A target as the loop drives it.  ``hidden`` writes K/V into ``cache`` (this package's
    ``PositionalKVCache`` list, or the compiled forward's traced stand-ins) and returns the
    final-normed hidden states [B, L, H]; ``head`` turns them into logits; ``forward`` is both (a
    compiled graph where ``compiled`` is set).  ``kv_source`` names the K/V a drafter layer of a
    kind reads; ``plain_model`` is a callable for mlx-lm's own decode loops (the reference MTP
    matches), which also takes a prompt's ``embeddings``; ``cache_classes`` are the host's
    (full, sliding) cache types for caches handed back to it.  A target whose host layers keep
    several caches each may also have ``host_cache_groups`` (the host's per-layer caches -> the flat
    list ``make_cache`` lays out) and ``host_cache_layers`` (the reverse)."""

    vocab_size: int
    sliding_window: int | None
    compiled: object | None
    cache_classes: tuple

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]: ...

    def hidden(self, tokens: mx.array, cache: list) -> mx.array: ...

    def head(self, hidden: mx.array) -> mx.array: ...

    def input_embedding(self, tokens: mx.array) -> mx.array: ...

    def make_cache(self, batch: int, slack: int) -> list: ...

    def kv_source(self, cache: list, layer_type: str): ...

    def plain_model(self): ...


@dataclass
class PromptEmbeddings:
    """Input embeddings for a whole prompt ([1, L, H], as the host's vision/audio merge made them),
    per-position extras of the same length L along axis 1 (e.g. Gemma 4's per-layer inputs), and
    the prompt's multimodal RoPE positions ([3, 1, L]) where the model has them (Qwen3.5)."""

    inputs_embeds: mx.array
    extra: dict = field(default_factory=dict)
    position_ids: mx.array | None = None

    def __post_init__(self):
        length = self.inputs_embeds.shape[1]
        for name, value in [*self.extra.items(), ("position_ids", self.position_ids)]:
            covered = None if value is None else value.shape[-1 if name == "position_ids" else 1]
            if covered is not None and covered != length:
                raise ValueError(f"{name} covers {covered} positions, the embeddings {length}")

    def __len__(self) -> int:
        return self.inputs_embeds.shape[1]

    def head(self, length: int) -> "PromptEmbeddings":
        positions = None if self.position_ids is None else self.position_ids[..., :length]
        return PromptEmbeddings(self.inputs_embeds[:, :length], {k: v[:, :length] for k, v in self.extra.items()},
                                positions)

    @property
    def rope_shift(self) -> int:
        """The RoPE position of the token after the prompt minus the prompt's length (an image's
        tokens take fewer mRoPE positions than tokens); 0 without multimodal positions."""
        if self.position_ids is None:
            return 0
        return int(self.position_ids.max().item()) + 1 - len(self)

    def host_kwargs(self) -> dict:
        """What the host's language model takes beside the token ids for this prompt."""
        kwargs = {"inputs_embeds": self.inputs_embeds, **self.extra}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids
        return kwargs


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
