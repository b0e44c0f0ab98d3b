"""Drafts from a known continuation: ``OracleDrafter`` proposes it at no cost, optionally corrupted
at a given rate (the loop's own overhead apart from draft quality, in benchmarks; every acceptance
length 0..K in lossless tests); ``ScriptedAccuracyDecoder`` pays a real drafter's cost and is right
at a chosen rate (realistic acceptance at real widths, where random weights accept nothing)."""

from __future__ import annotations

import random

import mlx.core as mx

from ..decode.loop import SpeculativeDecoder


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


class ScriptedAccuracyDecoder(SpeculativeDecoder):
    """Realistic acceptance at real scale, for benchmarks: the real drafter runs every draft step
    (its cost is paid, its graph evaluated with the round's), then its greedy drafts are replaced by
    the target's own continuation, each draft right with probability ``accuracy`` independently of
    the others — a round of K keeps n drafts with probability a^n (1 - a) (n < K): the first wrong
    draft ends what is kept.  A wrong draft is a token the target would not emit.  Rows that sample keep
    their drafter's drafts (a scripted token was not drawn from q, and acceptance needs it)."""

    def __init__(self, target, drafter, continuations: dict, accuracy: float, seed: int = 0, **kwargs):
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy {accuracy} is not a probability")
        super().__init__(target, drafter, **kwargs)
        self.continuations, self.accuracy = continuations, accuracy
        self.rng = random.Random(seed)

    def _draft(self, rows, cache, bonus, hidden, K: int, key):
        drafts, q = super()._draft(rows, cache, bonus, hidden, K, key)
        if K == 0:
            return drafts, q
        scripted = mx.array([self._script(row, K) for row in rows], dtype=mx.int32).reshape(len(rows), K)
        greedy = mx.array([row.request.params.greedy for row in rows])[:, None]
        # (drafts >= 0) always holds: it keeps the drafter's graph in the round's evaluation
        return mx.where(greedy & (drafts >= 0), scripted, drafts), q

    def _script(self, row, K: int) -> list[int]:
        reference = self.continuations.get(tuple(row.request.prompt))
        if reference is None:
            raise KeyError("ScriptedAccuracyDecoder: no continuation for this prompt (run it through plain "
                           "decoding first and pass the tokens in `continuations`)")
        done = len(row.generated)
        out = []
        for i in range(K):
            truth = reference[done + i] if done + i < len(reference) else 0
            out.append(truth if self.rng.random() < self.accuracy else (truth + 1) % self.target.vocab_size)
        return out
