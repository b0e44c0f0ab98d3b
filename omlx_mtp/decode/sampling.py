"""Sampling parameters and the exact distributions that plain mlx-lm sampling draws from.

mlx-lm's sampler filters the temperature-1 log-probabilities (top-p, min-p, top-k, in that
order) and then draws from ``softmax(filtered / temp)``.  Rejection sampling is lossless only
against that very distribution, so it is rebuilt here with mlx-lm's own filter functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    logits_processors: Sequence[LogitsProcessor] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def distribution_key(self) -> tuple:
        """What the sampled distribution depends on (processors aside)."""
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.min_tokens_to_keep)

    def processors(self) -> list[LogitsProcessor]:
        made = make_logits_processors(None, self.repetition_penalty, self.repetition_context_size)
        return list(made) + list(self.logits_processors)

    def mlx_sampler(self):
        """The sampler plain mlx-lm decoding would use with these parameters."""
        return make_sampler(self.temperature, self.top_p, self.min_p, self.min_tokens_to_keep, self.top_k)

    def filter(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def target_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """[..., V] processed logits -> the probabilities plain sampling draws from (temp > 0)."""
    shape = logits.shape
    flat = params.filter(log_softmax(logits.reshape(-1, shape[-1])))
    return mx.softmax(flat / params.temperature, axis=-1).reshape(shape)


def draft_probs(logits: mx.array, temperature: float) -> mx.array:
    """The drafter's proposal distribution q (any q is lossless; a tempered one accepts more)."""
    return mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)
