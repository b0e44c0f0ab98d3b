"""Qwen3.5 / Qwen3.6 with their built-in MTP heads: hybrid targets (Gated DeltaNet + full attention)
decoded through the same loop, lossless in float32, linear-attention state taken back per row."""

from __future__ import annotations

import importlib
import types

import mlx.core as mx
import numpy as np
import pytest

from omlx_mtp.decode import cache as caches
from omlx_mtp.decode.linear_state import LinearStateCache
from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.errors import CheckpointError
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.tools.session import run_plain
from omlx_mtp.targets import Qwen35MlxLmTarget, wrap_target
from omlx_mtp.fixtures.tiny_qwen import TinyQwenSpec, build, write_qwen

from .conftest import prompts
from .test_batch_generator import fresh, plain_generator, run
from .test_sampling_lossless import CASES, PROMPT, STEPS, VOCAB, MixtureDrafter, assert_samples_follow, exact_joint

mlx_generate = importlib.import_module("mlx_lm.generate")
MAX_TOKENS = 150


class Checkpoint:
    """A written checkpoint, its target and head, and plain decoding's tokens for 20 prompts;
    ``write`` makes the directory (tests/test_qwen3_next.py passes Qwen3-Next's)."""

    def __init__(self, directory, spec, write=write_qwen):
        self.spec = spec
        self.dir = write(directory, spec)
        self.model, self.tokenizer, _ = load_target(self.dir)
        self.target = wrap_target(self.model)
        self.head = load_merged_drafter(self.dir, self.target)
        batch = prompts(20, spec.vocab_size, seed=11)
        self.references = {tuple(p): run_plain(self.model, Request(p, max_tokens=MAX_TOKENS)).row.generated
                           for p in batch}


@pytest.fixture(scope="module", params=["dense", "moe"])
def qwen(request, tmp_path_factory):
    spec = TinyQwenSpec(moe=request.param == "moe", head_experts="per_expert")
    return Checkpoint(tmp_path_factory.mktemp(f"qwen-{request.param}"), spec)


def _generate(checkpoint, drafter, K):
    requests = [Request(list(p), max_tokens=MAX_TOKENS) for p in checkpoint.references]
    rows = SpeculativeDecoder(checkpoint.target, drafter, draft_tokens=K).generate(requests)
    mismatches = [r.prompt for r, row in zip(requests, rows) if row.generated != checkpoint.references[tuple(r.prompt)]]
    return rows, mismatches


def test_fixture_is_hybrid_and_wanders(qwen):
    assert isinstance(qwen.target, Qwen35MlxLmTarget)
    assert any(qwen.target.linear) and not all(qwen.target.linear)
    for tokens in qwen.references.values():
        assert len(set(tokens)) >= 40, tokens  # DESIGN §8: a repeating model proves nothing


@pytest.mark.parametrize("K", [1, 2, 4])
def test_built_in_head_greedy_equals_plain(qwen, K):
    rows, mismatches = _generate(qwen, qwen.head, K)
    assert not mismatches
    assert all(row.finish_reason == "length" for row in rows)
    assert sum(row.stats.drafted for row in rows) > 0


@pytest.mark.parametrize("K", [1, 2, 4])
def test_oracle_with_errors_rolls_back_every_round(qwen, K):
    oracle = OracleDrafter(qwen.references, qwen.spec.vocab_size, error_rate=0.25, seed=K)
    rows, mismatches = _generate(qwen, oracle, K)
    assert not mismatches
    rate = sum(r.stats.accepted for r in rows) / sum(r.stats.drafted for r in rows)
    assert 0.3 < rate < 0.95  # partial acceptance in most rounds: rows keep different n


def test_skipping_the_linear_state_rollback_breaks_losslessness(qwen, monkeypatch):
    """The mutation the rollback exists for: keep the state after every draft."""
    monkeypatch.setattr(LinearStateCache, "keep", lambda self, kept: None)
    oracle = OracleDrafter(qwen.references, qwen.spec.vocab_size, error_rate=0.25, seed=2)
    _, mismatches = _generate(qwen, oracle, 2)
    assert mismatches


@pytest.mark.parametrize("with_plain_stretches", [False, True], ids=["drafting", "plain stretches between"])
def test_head_reads_exactly_the_committed_pairs(qwen, with_plain_stretches, monkeypatch):
    """Every first draft equals the head run from scratch over the true (hidden, next token) pairs
    of everything committed: the head's own K/V holds the verified pairs, never a draft's — also
    the pairs of plain stretches, which reach it in one forward per stretch."""
    head, target = qwen.head, qwen.target
    seen = []
    original = head.step
    if with_plain_stretches:  # every other round a plain stretch of a few steps
        from omlx_mtp.decode.batch import LiveBatch

        calls = iter(range(10**6))
        monkeypatch.setattr(LiveBatch, "max_plain_stretch", 3)
        monkeypatch.setattr(LiveBatch, "_depths", lambda self, rows: [next(calls) % 2] * len(rows))

    def recording(target_, token, h, cache):
        logits, out = original(target_, token, h, cache)
        seen.append((list(caches.lengths_of(cache)), token[:, 0].tolist(), mx.argmax(logits, axis=-1).tolist()))
        return logits, out

    head.step = recording
    try:
        batch = list(qwen.references)[:3]
        rows = SpeculativeDecoder(target, head, draft_tokens=1).generate([Request(list(p), max_tokens=30) for p in batch])
    finally:
        del head.step
    checked = 0
    for lengths, tokens, drafts in seen[:: 2 if with_plain_stretches else 4]:  # a sample keeps the test short
        for r, (N, token, draft) in enumerate(zip(lengths, tokens, drafts)):
            sequence = list(batch[r]) + rows[r].generated
            if N >= len(sequence) or sequence[N] != token:
                continue  # a finished row's slot
            assert draft == draft_from_scratch(qwen.target, qwen.head, sequence[: N + 1])
            checked += 1
    assert checked >= 10


def draft_from_scratch(target, head, sequence):
    """The head's first draft after ``sequence``, run over all its true pairs in one forward."""
    cache = target.make_cache(1, slack=len(sequence))
    hidden = target.hidden(mx.array([sequence[:-1]]), cache)  # T_0 .. T_{N-1}
    own = head.make_cache(1, slack=len(sequence))
    for table in caches.tables_of(own):
        table.start_at([1])  # position 0 has no pair
    logits, _ = head.step(target, mx.array([sequence[1:]]), hidden, own)
    return int(mx.argmax(logits, axis=-1).item())


def test_rows_joining_late_through_the_host_api(qwen):
    """oMLX's path: prefilled outside, inserted with mlx-lm caches (ArraysCache for linear layers),
    rows joining while others run; finished caches go back as the host's classes."""
    pair = types.SimpleNamespace(model=qwen.model, target=qwen.target)
    requests = [{"prompt": list(p), "max_tokens": 60} for p in list(qwen.references)[:5]]
    plain = run(plain_generator(qwen.model), qwen.model, fresh(requests))
    decoder = SpeculativeDecoder(pair.target, qwen.head, draft_tokens=3)
    generator = MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=qwen.model, max_tokens=60)
    ours = run(generator, qwen.model, fresh(requests), insert_at={2: 3, 3: 3, 4: 7})
    assert_same_as_plain(ours, plain)
    assert generator.totals.drafted > 0


def assert_same_as_plain(ours, plain):
    """Tokens, finish reasons and the caches handed back equal mlx-lm's own generator's (the
    linear states plain decoding left, to float tolerance)."""
    for (tokens, reason, cache), (ref_tokens, ref_reason, ref_cache) in zip(ours, plain):
        assert tokens == ref_tokens and reason == ref_reason
        assert [type(c).__name__ for c in cache] == [type(c).__name__ for c in ref_cache]
        for mine, theirs in zip(cache, ref_cache):
            if type(mine).__name__ == "ArraysCache":
                assert all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(mine.cache, theirs.cache))


def test_rows_ending_inside_a_plain_stretch(qwen, monkeypatch):
    """A plain stretch steps every row of the batch; a row whose request ends inside it (its
    max_tokens, a stop token) is taken back to its own length — linear-attention states included —
    and hands back the cache plain decoding leaves (it raised before: a state could only be cut
    back within its last forward)."""
    from omlx_mtp.decode.batch import LiveBatch

    monkeypatch.setattr(LiveBatch, "_depths", lambda self, rows: [0] * len(rows))  # plain stretches only
    batch = list(qwen.references)[:3]
    requests = [{"prompt": list(p), "max_tokens": m} for p, m in zip(batch, (13, 37, 60))]
    requests[2]["stops"] = [[qwen.references[batch[2]][21]]]  # a stop token in the middle of a stretch
    plain = run(plain_generator(qwen.model), qwen.model, fresh(requests))
    assert len(plain[2][0]) < 60  # the stop ended it
    decoder = SpeculativeDecoder(qwen.target, qwen.head, draft_tokens=3)
    generator = MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=qwen.model, max_tokens=60)
    assert_same_as_plain(run(generator, qwen.model, fresh(requests)), plain)


def test_far_past_a_prefill_chunk_with_a_small_prefill_step(qwen):
    prompt = prompts(1, qwen.spec.vocab_size, seed=5, lengths=(300,))[0]
    expected = run_plain(qwen.model, Request(prompt, max_tokens=40)).row.generated
    decoder = SpeculativeDecoder(qwen.target, qwen.head, draft_tokens=2, prefill_step=64)
    assert decoder.generate([Request(prompt, max_tokens=40)])[0].generated == expected


def test_fused_head_experts_load_like_per_expert(tmp_path):
    """Qwen3.6 ships the head's MoE experts fused, Qwen3.5 per expert: both give the same head."""
    from mlx.utils import tree_flatten

    spec = TinyQwenSpec(moe=True, head_experts="fused")
    directory = write_qwen(tmp_path / "fused", spec)
    model, _, _ = load_target(directory, with_tokenizer=False)
    loaded = load_merged_drafter(directory, wrap_target(model))
    _, built = build(spec)
    expected = dict(tree_flatten(built.parameters()))
    got = dict(tree_flatten(loaded.parameters()))
    assert expected.keys() == got.keys()
    assert all(mx.array_equal(expected[k], got[k]).item() for k in expected)


def test_checkpoint_without_head_tensors_is_refused(tmp_path):
    directory = write_qwen(tmp_path / "nohead", TinyQwenSpec(), with_head=False)
    model, _, _ = load_target(directory, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="no mtp"):
        load_merged_drafter(directory, wrap_target(model))


def test_head_that_does_not_fit_is_refused(tmp_path):
    directory = write_qwen(tmp_path / "misfit", TinyQwenSpec())
    other = write_qwen(tmp_path / "wide", TinyQwenSpec(hidden_size=96))
    tensors = {k: v for k, v in mx.load(str(other / "model.safetensors")).items() if k.startswith("mtp.")}
    mx.save_safetensors(str(directory / "mtp.safetensors"), tensors)  # found before the trunk's shards
    model, _, _ = load_target(directory, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_merged_drafter(directory, wrap_target(model))


@pytest.fixture(scope="module")
def small_qwen():
    spec = TinyQwenSpec(vocab_size=VOCAB, embed_std=0.15)
    model, head = build(spec, seed=3)
    return model, wrap_target(model), head


@pytest.mark.parametrize("drafter_kind", ["head", "mixture"])
@pytest.mark.parametrize("params", CASES, ids=["T1", "T0.7", "T1-top_p", "T0.7-top_p-rep"])
def test_sampling_matches_exact_distribution(small_qwen, params, drafter_kind):
    model, target, head = small_qwen
    joint = exact_joint(model, params)
    drafter = head if drafter_kind == "head" else MixtureDrafter(joint)
    rows = SpeculativeDecoder(target, drafter, draft_tokens=2).generate(
        [Request(PROMPT, params, max_tokens=STEPS) for _ in range(2000)], seed=99)
    samples = np.array([r.generated for r in rows])
    accepted = sum(r.stats.accepted for r in rows)
    assert 0 < accepted < sum(r.stats.drafted for r in rows)
    assert_samples_follow(samples, joint)


def test_plugin_loads_the_built_in_head_for_omlx(qwen, tmp_path, caplog):
    """What oMLX's patched engine asks for: settings with mtp_enabled -> the head -> a strategy."""
    from omlx_mtp.hosts.omlx import plugin

    settings = {"mtp_enabled": True, "mtp_draft_tokens": 2}
    drafter = plugin.omlx_load_drafter(model_id="q", model_path=str(qwen.dir), model=qwen.model, settings=settings)
    assert drafter is not None and hasattr(drafter, "make_cache")
    assert plugin.omlx_decode_strategy(model_id="q", model=qwen.model, drafter=drafter, settings=settings) is not None
    bare = write_qwen(tmp_path / "bare", qwen.spec, with_head=False)
    model, _, _ = load_target(bare, with_tokenizer=False)
    with caplog.at_level("WARNING", logger="omlx_mtp"):
        assert plugin.omlx_load_drafter(model_id="bare", model_path=str(bare), model=model, settings=settings) is None
    assert "MTP disabled for bare" in caplog.text and "mtp" in caplog.text


def test_a_pipeline_stage_without_full_attention_is_refused_saying_why():
    """A stage whose layers are all linear attention holds no table of row lengths (and a host cache
    of it could not say where a request stands): wrapping it is one clear error, not an IndexError
    at the first request.  The stage is set up as mlx-lm's ``pipeline()`` leaves it on rank 1."""
    model, _ = build(TinyQwenSpec())
    body = model.language_model.model
    if not hasattr(body, "pipeline"):
        pytest.skip("this mlx-lm has no pipeline sharding for Qwen3.5 (0.32 adds it)")
    first_linear = next(i for i, layer in enumerate(body.layers) if layer.is_linear)
    body.pipeline_rank, body.pipeline_size = 1, 2
    body.start_idx, body.end_idx = first_linear, first_linear + 1  # as pipeline() sets them
    with pytest.raises(CheckpointError, match="pipeline stage 1 of 2 holds only linear-attention layers"):
        wrap_target(model)
    body.start_idx, body.end_idx = 0, None  # a stage with a full-attention layer wraps
    assert any(not linear for linear in wrap_target(model).linear)
