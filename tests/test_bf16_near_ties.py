"""In bf16 and with a quantized target, greedy MTP may leave plain decoding only at near-ties.

Verifying K+1 positions in one forward adds the same numbers in another order than decoding
them one by one, so in bf16 a top-2 tie can break the other way.  Every first divergence of a
row must sit at such a tie: the plain run's log-probabilities of the two tokens differ by at
most a few bf16 ulps of the top logit.  The agreement rate is reported."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step

from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.targets import wrap_target
from omlx_mtp.drafters import load_drafter
from omlx_mtp.checkpoint.loading import load_target

from .conftest import SPEC_31B, SPEC_E2B, Pair, prompts

MAX_TOKENS = 48
ULPS = 4


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def plain_with_logprobs(model, prompt):
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS):
        tokens.append(int(token))
        logprobs.append(lp.astype(mx.float32))
    return tokens, logprobs


@pytest.fixture(scope="module", params=["31b", "e2b"])
def spread_pair(request, tmp_path_factory):
    """Wider logits than the float32 fixtures (embed std 0.1), so bf16 ties are the exception
    and a few-ulp tolerance is small next to the logit spread."""
    spec = {"31b": SPEC_31B, "e2b": SPEC_E2B}[request.param]
    spec = type(spec)(**{**vars(spec), "embed_std": 0.1})
    return Pair(tmp_path_factory.mktemp("spread" + request.param), spec)


def lowered(pair_dir, drafter_dir, quantize: bool):
    model, _, _ = load_target(pair_dir, with_tokenizer=False)
    model.set_dtype(mx.bfloat16)
    if quantize:
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    target = wrap_target(model)
    drafter = load_drafter(drafter_dir, target)
    drafter.set_dtype(mx.bfloat16)
    return model, target, drafter


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [False, True], ids=["bf16", "bf16-q4"])
def test_divergences_only_at_near_ties(spread_pair, quantize):
    pair = spread_pair
    model, target, drafter = lowered(pair.target_dir, pair.drafter_dir, quantize)
    batch = prompts(8, pair.spec.vocab_size, seed=5)
    references = {tuple(p): plain_with_logprobs(model, p) for p in batch}
    continuations = {p: tokens for p, (tokens, _) in references.items()}
    agreed = total = divergent = 0
    for drafter_used in (drafter, OracleDrafter(continuations, pair.spec.vocab_size, error_rate=0.25)):
        decoder = SpeculativeDecoder(target, drafter_used, draft_tokens=4)
        rows = decoder.generate([Request(list(p), max_tokens=MAX_TOKENS) for p in batch])
        for prompt, row in zip(batch, rows):
            tokens, logprobs = references[tuple(prompt)]
            first = next((i for i, (a, b) in enumerate(zip(tokens, row.generated)) if a != b), None)
            total += len(tokens)
            if first is None:
                assert row.generated == tokens
                agreed += len(tokens)
                continue
            divergent += 1
            agreed += first
            lp = logprobs[first]
            gap = float(lp[tokens[first]] - lp[row.generated[first]])
            top = float(mx.max(lp))
            assert 0 <= gap <= ULPS * bf16_ulp(top) + 1e-6, (first, gap, bf16_ulp(top))
    print(f"\n{pair.spec.layout} {'bf16+q4' if quantize else 'bf16'}: greedy agreement {agreed}/{total} "
          f"tokens ({agreed / total:.1%}), {divergent} rows diverged, all at near-ties")
    assert total == 2 * len(batch) * MAX_TOKENS
    assert len({t for tokens in continuations.values() for t in tokens}) > 50  # paths wander
