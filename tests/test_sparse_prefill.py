"""oMLX's SpecPrefill followed by MTP: the kept prompt tokens prefilled at their true positions, the
host's RoPE wrapper on the shared model, then decoding — MTP must equal the host's own loop after
the same sparse prefill, token for token (float32, greedy), with the kept indices pinned.

The sparse prefill is oMLX 0.3.8's own (``omlx/patches/specprefill.py``, loaded from OMLX_SRC) where
the tree is at hand, else a stand-in that leaves the same state: each kept token prefilled at its
own position, then ``_OffsetAdjustedRoPE`` (matched by name, as the host's) on every attention layer
with the adjustment the scheduler sets (M - N - 1: the last prompt token is inserted on its own)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.hosts.omlx.sparse_prefill import SparsePrefill, _attention_modules
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.targets import wrap_target
from omlx_mtp.fixtures.tiny_qwen import TinyQwenSpec, write_qwen

from .conftest import prompts
from .test_batch_generator import mtp_generator, plain_generator, run, unreadable

SOURCE = os.environ.get("OMLX_SRC")
OMLX_MODULE = Path(SOURCE or "/nonexistent") / "omlx" / "patches" / "specprefill.py"


class _OffsetAdjustedRoPE:
    """The host's decode wrapper, as oMLX 0.3.8 defines it."""

    def __init__(self, original, adjustment):
        self._original, self._adjustment = original, adjustment

    def __call__(self, x, offset=0):
        return self._original(x, offset=offset + self._adjustment)


def _standin_sparse_prefill(model, tokens: list[int], kept: list[int], cache) -> None:
    """Each kept token (the last prompt token excluded) at its own position, then the wrapper."""
    attentions = _attention_modules(model)
    originals = [a.rope for a in attentions]
    for done, index in enumerate(kept):
        for attention, rope in zip(attentions, originals):
            attention.rope = _OffsetAdjustedRoPE(rope, index - done)
        model(mx.array([[tokens[index]]]), cache=cache)
    for attention, rope in zip(attentions, originals):
        attention.rope = _OffsetAdjustedRoPE(rope, len(tokens) - len(kept) - 1)


def _omlx_sparse_prefill(model, tokens: list[int], kept: list[int], cache) -> None:
    """oMLX 0.3.8's own: ``sparse_prefill``, then the scheduler's ``_adjustment -= 1``."""
    spec = importlib.util.spec_from_file_location("omlx_specprefill", OMLX_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.sparse_prefill(model, mx.array(tokens), mx.array(kept), cache, step_size=32)
    for attention in _attention_modules(model):
        if isinstance(attention.rope, module._OffsetAdjustedRoPE):
            attention.rope._adjustment -= 1


PREFILLS = {"stand-in": _standin_sparse_prefill, "omlx": _omlx_sparse_prefill}


@contextlib.contextmanager
def restored_ropes(model):
    """Whatever a test leaves on the shared model's attention layers is undone afterwards."""
    attentions = _attention_modules(model)
    originals = [a.rope for a in attentions]
    try:
        yield
    finally:
        for attention, rope in zip(attentions, originals):
            attention.rope = rope


def kept_indices(length: int) -> list[int]:
    """A SpecPrefill-like selection: the start, every third token of the middle, a tail longer than
    the fixtures' sliding window; the last prompt token is left to the insert."""
    return sorted({*range(6), *range(6, length - 24, 3), *range(length - 24, length - 1)})


def sparse_request(model, prompt, prefill) -> dict:
    """A request as oMLX's scheduler inserts a sparse-prefilled one: its last token, and a cache
    holding the kept tokens, made right before the insert; the wrappers stay on the model."""

    def sparse_cache():
        cache = make_prompt_cache(model)
        prefill(model, prompt, kept_indices(len(prompt)), cache)
        mx.eval([c.state for c in cache])
        return cache

    return {"prompt": prompt, "cache": sparse_cache}


def long_prompt(vocab: int, seed: int) -> list[int]:
    return prompts(1, vocab, seed=seed, lengths=(90,))[0]


def decode(generator_of, model, prompt, prefill, others=()):
    """Tokens of the sparse request (and of the plain ones running beside it, inserted first)."""
    with restored_ropes(model):
        requests = [{"prompt": p} for p in others] + [sparse_request(model, prompt, prefill)]
        return [tokens for tokens, _, _ in run(generator_of(), model, requests, insert_at={len(others): 2})]


def reference(model, prompt, prefill) -> list[int]:
    """The host's own loop after the sparse prefill, the request alone (oMLX runs it alone)."""
    return decode(lambda: plain_generator(model), model, prompt, prefill)[-1]


@pytest.mark.parametrize("K", [3, "auto"])
def test_mtp_after_a_sparse_prefill_equals_plain(pair, K):
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    expected = reference(pair.model, prompt, _standin_sparse_prefill)
    assert len(set(expected)) > 10  # DESIGN §8: a repeating model proves nothing
    oracle = OracleDrafter({tuple(prompt): expected}, pair.spec.vocab_size, error_rate=0.25, seed=2)
    for drafter in (pair.drafter, oracle):
        got = decode(lambda: mtp_generator(pair, drafter, K=K), pair.model, prompt, _standin_sparse_prefill)
        assert got[-1] == expected


def test_the_shift_matters(pair_31b, monkeypatch):
    """Mutant: the wrappers come off but their adjustment is dropped — the output must change."""
    pair = pair_31b
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    expected = reference(pair.model, prompt, _standin_sparse_prefill)
    monkeypatch.setattr(SparsePrefill, "adjustment", property(lambda self: 0))
    got = decode(lambda: mtp_generator(pair, pair.drafter), pair.model, prompt, _standin_sparse_prefill)
    assert got[-1] != expected


def test_other_rows_keep_their_positions(pair_31b):
    """A request already running when a sparse one joins keeps its own positions (the host's own
    loop would shift it too: oMLX wraps the shared model), and the sparse one gets its shift."""
    pair = pair_31b
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    other = prompts(1, pair.spec.vocab_size, seed=4, lengths=(30,))[0]
    unshifted_other = run(plain_generator(pair.model), pair.model, [{"prompt": other}])[0][0]
    expected = reference(pair.model, prompt, _standin_sparse_prefill)
    got = decode(lambda: mtp_generator(pair, pair.drafter), pair.model, prompt, _standin_sparse_prefill,
                 others=[other])
    assert got == [unshifted_other, expected]


def test_wrappers_go_back_when_the_host_loop_takes_the_request(pair_31b):
    """A sparse request whose cache MTP can't read runs in the host's loop, with its wrappers."""
    pair = pair_31b
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    expected = reference(pair.model, prompt, _standin_sparse_prefill)
    with restored_ropes(pair.model):
        request = sparse_request(pair.model, prompt, _standin_sparse_prefill)
        sparse_cache = request["cache"]
        request["cache"] = lambda: unreadable(sparse_cache())
        tokens = run(mtp_generator(pair, pair.drafter), pair.model, [request])[0][0]
        wrappers = {type(a.rope).__name__ for a in _attention_modules(pair.model)}
    assert tokens == expected
    assert wrappers == {"_OffsetAdjustedRoPE"}


@pytest.mark.skipif(not OMLX_MODULE.is_file(), reason="OMLX_SRC does not point at an oMLX tree")
@pytest.mark.parametrize("K", [3, "auto"])
def test_after_omlx_own_sparse_prefill(pair, K):
    """oMLX 0.3.8's own module: its chunked position-mapped prefill, and the last prompt token
    prefilled again where it merges a sliding window's tail (as the scheduler calls it)."""
    prompt = long_prompt(pair.spec.vocab_size, seed=23)
    expected = reference(pair.model, prompt, _omlx_sparse_prefill)
    assert len(set(expected)) > 10
    got = decode(lambda: mtp_generator(pair, pair.drafter, K=K), pair.model, prompt, _omlx_sparse_prefill)
    assert got[-1] == expected



class _Qwen:
    """Qwen3.5 dense, hybrid: RoPE only on its full-attention layers, a built-in MTP head."""

    def __init__(self, directory):
        self.spec = TinyQwenSpec(moe=False, head_experts="per_expert")
        path = write_qwen(directory, self.spec)
        self.model, _, _ = load_target(path)
        self.target = wrap_target(self.model)
        self.drafter = load_merged_drafter(path, self.target)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _Qwen(tmp_path_factory.mktemp("qwen-sparse"))


@pytest.mark.parametrize("prefill", list(PREFILLS))
def test_hybrid_with_its_head_after_a_sparse_prefill(qwen, prefill):
    if prefill == "omlx" and not OMLX_MODULE.is_file():
        pytest.skip("OMLX_SRC does not point at an oMLX tree")
    prompt = long_prompt(qwen.spec.vocab_size, seed=25)
    expected = reference(qwen.model, prompt, PREFILLS[prefill])
    assert len(set(expected)) > 10
    for K in (3, "auto"):
        got = decode(lambda: mtp_generator(qwen, qwen.drafter, K=K), qwen.model, prompt, PREFILLS[prefill])
        assert got[-1] == expected


def _drain(generator, prompts_, caches_, max_tokens=20) -> list[list[int]]:
    uids = generator.insert([p[-1:] for p in prompts_], caches=caches_, max_tokens=[max_tokens] * len(prompts_))
    tokens = {uid: [] for uid in uids}
    done = set()
    while len(done) < len(uids):
        for response in generator.next_generated():
            tokens[response.uid].append(response.token)
            if response.finish_reason is not None:
                done.add(response.uid)
    return [tokens[uid] for uid in uids]


def test_several_requests_inserted_with_the_wrappers_run_in_the_host_loop(pair_31b):
    """oMLX inserts a sparse request alone; inserted with another, which one the wrappers belong to is
    unknown, so both run in the host's loop with the wrappers on — exactly as the host would run them."""
    pair = pair_31b
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    other = prompts(1, pair.spec.vocab_size, seed=4, lengths=(30,))[0]
    results = []
    for make in (lambda: plain_generator(pair.model), lambda: mtp_generator(pair, pair.drafter)):
        with restored_ropes(pair.model):
            caches_ = [sparse_request(pair.model, prompt, _standin_sparse_prefill)["cache"](),
                       make_prompt_cache(pair.model)]
            pair.model(mx.array(other[:-1])[None], cache=caches_[1])
            generator = make()
            results.append(_drain(generator, [prompt, other], caches_))
            wrappers = {type(a.rope).__name__ for a in _attention_modules(pair.model)}
        assert wrappers == {"_OffsetAdjustedRoPE"}
    assert results[1] == results[0]
    assert set(generator._to_plain) == {0, 1}  # neither ran MTP rounds


def test_a_sparse_request_takes_no_boundary_snapshots(pair_31b):
    """Its cache holds fewer tokens than the request: the host would file a snapshot under the wrong
    count, so its rounds are not cut at boundaries and extract_cache hands nothing back."""
    pair = pair_31b
    prompt = long_prompt(pair.spec.vocab_size, seed=21)
    expected = reference(pair.model, prompt, _standin_sparse_prefill)
    with restored_ropes(pair.model):
        generator = mtp_generator(pair, pair.drafter, snapshot_interval=8)
        cache = sparse_request(pair.model, prompt, _standin_sparse_prefill)["cache"]()
        (uid,) = generator.insert([prompt[-1:]], caches=[cache], max_tokens=[len(expected)])
        tokens, snapshots = [], []
        while not tokens or generator._rows.get(uid) is not None:
            for response in generator.next_generated():
                tokens.append(response.token)
            row = generator._rows.get(uid)
            if row is not None:
                assert row.sparse and row.until_snapshot == float("inf")
                snapshots.append(generator.extract_cache([uid]))
    assert tokens == expected
    assert snapshots and not any(snapshots)
