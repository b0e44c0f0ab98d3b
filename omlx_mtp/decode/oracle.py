"""A drafter that proposes a known continuation, optionally corrupted at a given rate.

It isolates the loop's own overhead from draft quality (benchmarks) and drives every
acceptance length 0..K in lossless tests."""

from __future__ import annotations

import random

import mlx.core as mx


class OracleDrafter:
    layer_types: list = []

    def __init__(self, continuations: dict, vocab_size: int, error_rate: float = 0.0, seed: int = 0):
        self.continuations = continuations  # prompt tuple -> the target's own continuation
        self.vocab_size = vocab_size
        self.error_rate = error_rate
        self.rng = random.Random(seed)

    def propose(self, rows, K: int, key):
        drafts = []
        for row in rows:
            reference = self.continuations.get(tuple(row.request.prompt), [])
            done = len(row.generated)
            proposal = list(reference[done : done + K]) + [0] * K
            proposal = [
                self.rng.randrange(self.vocab_size) if self.rng.random() < self.error_rate else t
                for t in proposal[:K]
            ]
            drafts.append(proposal)
        drafts = mx.array(drafts, dtype=mx.int32).reshape(len(rows), K)
        q = mx.zeros((len(rows), K, self.vocab_size), dtype=mx.float32)
        q = mx.put_along_axis(q, drafts[..., None], mx.array(1.0), axis=-1)  # one-hot proposals
        return drafts, q
