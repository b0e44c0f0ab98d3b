"""Greedy MTP output must equal plain mlx-lm greedy decoding token for token in float32."""

from __future__ import annotations

import pytest

from omlx_mtp.decode.loop import QUERY_AT_BONUS, QUERY_AT_LAST, SpeculativeDecoder
from omlx_mtp.decode.requests import Request
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.tools.session import run_plain

from .conftest import prompts

MAX_TOKENS = 56  # > 3x the fixtures' sliding window of 16


@pytest.fixture(scope="module")
def references(pair_31b, pair_e2b):
    """Plain greedy continuations from mlx-lm's own loop and caches, per fixture."""
    out = {}
    for name, pair in (("31b", pair_31b), ("e2b", pair_e2b)):
        batch = prompts(20, pair.spec.vocab_size, seed=len(name))
        out[name] = {tuple(p): run_plain(pair.model, Request(p, max_tokens=MAX_TOKENS)).row.generated for p in batch}
    return out


def test_fixture_paths_wander(references):
    # A lossless test on a model that repeats one token proves nothing (DESIGN §8).
    for continuations in references.values():
        for tokens in continuations.values():
            assert len(set(tokens)) >= 20, tokens


def _check(decoder, continuations):
    requests = [Request(list(p), max_tokens=MAX_TOKENS) for p in continuations]
    rows = decoder.generate(requests)
    for request, row in zip(requests, rows):
        assert row.generated == continuations[tuple(request.prompt)]
        assert row.finish_reason == "length"
    return rows


@pytest.mark.parametrize("K", [1, 2, 4, 7])
def test_assistant_drafter_batched(pair, references, K):
    """20 prompts of different lengths in one batch: per-row offsets in every round."""
    continuations = references[pair.spec.layout]
    rows = _check(SpeculativeDecoder(pair.target, pair.drafter, draft_tokens=K), continuations)
    assert sum(r.stats.drafted for r in rows) > 0


@pytest.mark.parametrize("K", [1, 2, 4, 7])
def test_oracle_with_errors_exercises_every_acceptance_length(pair, references, K):
    continuations = references[pair.spec.layout]
    oracle = OracleDrafter(continuations, pair.spec.vocab_size, error_rate=0.25, seed=K)
    rows = _check(SpeculativeDecoder(pair.target, oracle, draft_tokens=K), continuations)
    accepted = sum(r.stats.accepted for r in rows)
    drafted = sum(r.stats.drafted for r in rows)
    assert 0.3 < accepted / drafted < 0.95  # both full and partial acceptance happened


@pytest.mark.parametrize("query_offset", [QUERY_AT_BONUS, QUERY_AT_LAST])
def test_single_request_each_query_position(pair, references, query_offset):
    continuations = references[pair.spec.layout]
    decoder = SpeculativeDecoder(pair.target, pair.drafter, draft_tokens=3, query_offset=query_offset)
    for prompt in list(continuations)[:4]:
        row = decoder.generate([Request(list(prompt), max_tokens=MAX_TOKENS)])[0]
        assert row.generated == continuations[prompt]


def test_stop_token_ends_like_plain_decoding(pair, references):
    continuations = references[pair.spec.layout]
    prompt, tokens = next(iter(continuations.items()))
    stop = tokens[len(tokens) // 2]
    expected = tokens[: tokens.index(stop)]
    oracle = OracleDrafter(continuations, pair.spec.vocab_size)  # accepts everything: stop lands mid-round
    decoder = SpeculativeDecoder(pair.target, oracle, draft_tokens=4)
    row = decoder.generate([Request(list(prompt), max_tokens=MAX_TOKENS, stop_tokens=frozenset({stop}))])[0]
    plain = run_plain(pair.model, Request(list(prompt), max_tokens=MAX_TOKENS, stop_tokens=frozenset({stop}))).row
    assert row.generated == plain.generated == expected
    assert row.finish_reason == plain.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_exact(pair, references, max_tokens):
    continuations = references[pair.spec.layout]
    prompt = next(iter(continuations))
    decoder = SpeculativeDecoder(pair.target, OracleDrafter(continuations, pair.spec.vocab_size), draft_tokens=4)
    row = decoder.generate([Request(list(prompt), max_tokens=max_tokens)])[0]
    assert row.generated == continuations[prompt][:max_tokens]


@pytest.mark.parametrize("length", [1024, 1300])
def test_long_prompt_chunked_prefill(pair, length):
    """Prompts of several prefill chunks (512), far past the 16-token window, then the ring shrinks."""
    prompt = prompts(1, pair.spec.vocab_size, seed=length, lengths=(length,))[0]
    expected = run_plain(pair.model, Request(prompt, max_tokens=40)).row.generated
    decoder = SpeculativeDecoder(pair.target, OracleDrafter({tuple(prompt): expected}, pair.spec.vocab_size,
                                                            error_rate=0.3), draft_tokens=3)
    row = decoder.generate([Request(prompt, max_tokens=40)])[0]
    assert row.generated == expected
    assistant = SpeculativeDecoder(pair.target, pair.drafter, draft_tokens=2).generate([Request(prompt, max_tokens=40)])
    assert assistant[0].generated == expected


@pytest.mark.parametrize("max_tokens", [1, 6, 29])
def test_plain_stretches_match_plain_decoding(pair, references, max_tokens):
    """No drafter: every round is a pipelined stretch of plain steps.  A repetition penalty (the
    history grows on the device inside a stretch), stop tokens found after the stretch, and
    max_tokens that is no multiple of the stretch length must all end like mlx-lm's loop."""
    from omlx_mtp.decode.sampling import SamplingParams

    continuations = references[pair.spec.layout]
    decoder = SpeculativeDecoder(pair.target, None)
    params = SamplingParams(repetition_penalty=1.5, repetition_context_size=8)
    batch = list(continuations)[:4]
    stops = [frozenset({continuations[p][9]}) if i % 2 else frozenset() for i, p in enumerate(batch)]
    requests = [Request(list(p), params, max_tokens, stop) for p, stop in zip(batch, stops)]
    rows = decoder.generate(requests)
    for request, row in zip(requests, rows):
        plain = run_plain(pair.model, request).row
        assert row.generated == plain.generated and row.finish_reason == plain.finish_reason
        assert row.stats.drafted == 0
