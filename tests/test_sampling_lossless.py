"""Sampled MTP output must have exactly the distribution of plain mlx-lm sampling.

The exact distribution of the first four generated tokens is computed by enumerating every
prefix with the target itself (small vocabulary), then thousands of independent MTP rows —
one batch — are compared with it by chi-square tests on each position's marginal and on a
pair of positions.  Rows accept different numbers of drafts, so residual draws, bonus draws
and second rounds are all in the sample."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.sampling import SamplingParams, log_softmax, target_probs
from omlx_mtp.targets import wrap_target
from omlx_mtp.drafters import load_drafter
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.fixtures.tiny import TinySpec, write_pair

from .stats import chi_square_p_value

VOCAB = 12
STEPS = 4
ROWS = 3000
PROMPT = [3, 7, 1, 9, 4]
SPEC = TinySpec(vocab_size=VOCAB, hidden_size=64, num_layers=3, embed_std=0.15, drafter_hidden=32)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    target_dir, drafter_dir = write_pair(tmp_path_factory.mktemp("small"), SPEC)
    model, _, _ = load_target(target_dir, with_tokenizer=False)
    target = wrap_target(model)
    return model, target, load_drafter(drafter_dir, target)


def exact_joint(model, params: SamplingParams) -> np.ndarray:
    """P(t0..t3) for plain sampling, from every prefix, with processors and filters applied."""
    processors = params.processors()
    joint = np.array(1.0)
    for step in range(STEPS):
        prefixes = list(itertools.product(range(VOCAB), repeat=step))
        tokens = mx.array([PROMPT + list(p) for p in prefixes], dtype=mx.int32)
        logits = model(tokens)[:, -1, :]
        rows = []
        for i, prefix in enumerate(prefixes):
            row = logits[i : i + 1]
            for processor in processors:
                row = processor(mx.array(PROMPT + list(prefix), dtype=mx.int32), row)
            rows.append(row)
        probs = np.array(target_probs(mx.concatenate(rows), params))
        joint = joint[..., None] * probs.reshape([VOCAB] * step + [VOCAB])
    return joint


class MixtureDrafter:
    """Draws each draft from q = half the target's true conditional, half a fixed random
    distribution: high but imperfect acceptance, and a q that is neither one-hot nor p."""

    layer_types: list = []

    def __init__(self, joint: np.ndarray, seed: int = 0):
        self.joint = joint
        rng = np.random.default_rng(seed)
        self.noise = rng.dirichlet(np.ones(VOCAB), size=STEPS + 4)
        self.rng = rng

    def conditional(self, prefix: tuple) -> np.ndarray:
        if len(prefix) >= STEPS:
            return np.full(VOCAB, 1 / VOCAB)
        marginal = self.joint.sum(axis=tuple(range(len(prefix) + 1, STEPS)))[prefix]
        total = marginal.sum()
        return marginal / total if total > 0 else np.full(VOCAB, 1 / VOCAB)  # prefix filtered out

    def propose(self, rows, K: int, key):
        drafts = np.zeros((len(rows), K), dtype=np.int32)
        q = np.zeros((len(rows), K, VOCAB), dtype=np.float32)
        for r, row in enumerate(rows):
            prefix = tuple(row.generated)
            for j in range(K):
                dist = 0.5 * self.conditional(prefix) + 0.5 * self.noise[len(prefix)]
                q[r, j] = dist
                drafts[r, j] = self.rng.choice(VOCAB, p=dist / dist.sum())
                prefix = prefix + (int(drafts[r, j]),)
        return mx.array(drafts), mx.array(q)


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.5, repetition_context_size=8),
]


@pytest.mark.parametrize("drafter_kind", ["assistant", "mixture", "none"])
@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.7", "T1-top_p", "T0.7-top_p-rep"])
def test_mtp_sampling_matches_exact_distribution(small, params, drafter_kind):
    model, target, assistant = small
    joint = exact_joint(model, params)
    # "none": no drafter, so every round is a pipelined stretch of plain steps
    drafter = {"assistant": assistant, "mixture": MixtureDrafter(joint), "none": None}[drafter_kind]
    decoder = SpeculativeDecoder(target, drafter, draft_tokens=2)
    rows = decoder.generate([Request(PROMPT, params, max_tokens=STEPS) for _ in range(ROWS)], seed=1234)
    samples = np.array([r.generated for r in rows])
    assert samples.shape == (ROWS, STEPS)
    drafted = sum(r.stats.drafted for r in rows)
    accepted = sum(r.stats.accepted for r in rows)
    if drafter_kind == "mixture":
        assert 0.3 < accepted / drafted < 0.95, "both acceptances and rejections must be in the sample"
    elif drafter_kind == "assistant":
        assert accepted > 0
    else:
        assert drafted == 0
    assert_samples_follow(samples, joint)


def assert_samples_follow(samples: np.ndarray, joint: np.ndarray) -> None:
    """Chi-square tests of sampled rows [N, STEPS] against the exact joint: each position's
    marginal, and the pair of tokens 1 and 2 (both decided inside the same round)."""
    axes = tuple(range(STEPS))
    for position in range(STEPS):
        marginal = joint.sum(axis=tuple(a for a in axes if a != position))
        counts = np.bincount(samples[:, position], minlength=VOCAB)
        p_value = chi_square_p_value(counts, marginal)
        assert p_value > 1e-3, (position, p_value, counts, np.round(marginal * len(samples)))
    pair = joint.sum(axis=(0, 3))
    counts = np.bincount(samples[:, 1] * VOCAB + samples[:, 2], minlength=VOCAB * VOCAB)
    assert chi_square_p_value(counts, pair) > 1e-3


def test_exact_distribution_is_what_mlx_lm_samples_from():
    """Our p (filters on T=1 log-probs, then temperature) equals mlx-lm's sampler empirically."""
    logits = mx.array(np.random.default_rng(0).normal(0, 1.5, (1, VOCAB)).astype(np.float32))
    for params in (SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3, top_k=5, min_p=0.05)):
        expected = np.array(target_probs(logits, params))[0]
        mx.random.seed(7)
        draws = params.mlx_sampler()(mx.broadcast_to(log_softmax(logits), (20000, VOCAB)))
        counts = np.bincount(np.array(draws), minlength=VOCAB)
        assert chi_square_p_value(counts, expected) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    probs = np.full(VOCAB, 1 / VOCAB)
    skewed = probs.copy()
    skewed[0] += 0.03
    skewed[1] -= 0.03
    counts = np.bincount(rng.choice(VOCAB, size=ROWS, p=skewed), minlength=VOCAB)
    assert chi_square_p_value(counts, probs) < 1e-3 or chi_square_p_value(
        np.bincount(rng.choice(VOCAB, size=10 * ROWS, p=skewed), minlength=VOCAB), probs
    ) < 1e-3
