"""The compiled short forward gives what mlx-lm's layers give uncompiled, round after round."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from omlx_mtp.decode import cache as caches
from omlx_mtp.decode.compiled_forward import compiled_forward_exact
from omlx_mtp.targets import wrap_target

from .conftest import prompts


def _prefilled(target, prompt_list, slack):
    """A batch cache holding each prompt (rows at different lengths)."""
    per_row = []
    for prompt in prompt_list:
        cache = target.make_cache(1, slack=max(slack, len(prompt)))
        target.hidden(mx.array([prompt]), cache)
        caches.advance(cache, len(prompt))
        caches.shrink_slack(cache, slack)
        per_row.append(cache)
    return caches.stack_caches(per_row) if len(per_row) > 1 else per_row[0]


def test_compiled_forward_matches_uncompiled_across_rollbacks_and_the_window(pair):
    plain = wrap_target(pair.model, compiled=False)
    compiled = wrap_target(pair.model, compiled=True)
    vocab = plain.vocab_size
    for batch in ([5], [9, 23]):  # one row; two rows at different lengths
        rows = prompts(len(batch), vocab, seed=3, lengths=batch)
        ref_cache, cache = _prefilled(plain, rows, 6), _prefilled(compiled, rows, 6)
        rng = np.random.default_rng(0)
        for step in range(30):  # well past the fixtures' 16-token sliding window
            L = int(rng.integers(1, 6))
            tokens = mx.array(rng.integers(3, vocab, (len(batch), L)), dtype=mx.int32)
            assert compiled.compiled.accepts(tokens, cache)
            want_logits, want_hidden = plain.forward(tokens, ref_cache)
            logits, hidden = compiled.forward(tokens, cache)
            # Bit-equal where the forward is compiled by default (mlx >= 0.32); mlx 0.31's compiler
            # fuses with other rounding (~1e-4 after a few random layers).
            tolerance = 0.0 if compiled_forward_exact() else 1e-3
            np.testing.assert_allclose(np.array(logits), np.array(want_logits), atol=tolerance, rtol=tolerance)
            np.testing.assert_allclose(np.array(hidden), np.array(want_hidden), atol=tolerance, rtol=tolerance)
            keep = [n + int(rng.integers(1, L + 1)) for n in ref_cache[0].lengths]
            caches.commit(ref_cache, keep)
            caches.commit(cache, keep)


def test_traces_are_reused_and_bounded(pair):
    target = wrap_target(pair.model, compiled=True)
    cache = _prefilled(target, prompts(1, target.vocab_size, lengths=[7]), 6)
    traces = target.compiled.traces
    for L in (1, 2, 1, 2, 1):
        target.forward(mx.zeros((1, L), dtype=mx.int32), cache)
        caches.commit(cache, [cache[0].lengths[0] + 1])
    assert len(traces) == traces.made == 2  # one per shape, reused
    traces.limit = 2
    target.forward(mx.zeros((1, 3), dtype=mx.int32), cache)
    assert len(traces) == 2 and traces.made == 3
    assert ((1, 3), mx.int32) in [key[0] for key in traces._by_shape]  # the newest is kept


def test_long_forwards_and_empty_caches_run_uncompiled(pair):
    target = wrap_target(pair.model, compiled=True)
    cache = target.make_cache(1, slack=32)
    assert not target.compiled.accepts(mx.zeros((1, 2), dtype=mx.int32), cache)  # nothing prefilled
    target.forward(mx.zeros((1, 20), dtype=mx.int32), cache)
    caches.advance(cache, 20)
    assert not target.compiled.accepts(mx.zeros((1, 20), dtype=mx.int32), cache)
    assert target.compiled.accepts(mx.zeros((1, 4), dtype=mx.int32), cache)


def test_full_attention_buffers_grow_geometrically_up_to_a_step():
    """Compiled forwards trace again per buffer size, so buffers grow a quarter ahead — but at long
    contexts by at most 512 slots, so MTP's K/V stays near plain decoding's."""
    table = caches.SlotTable(1, window=None)
    table.lengths = [1000]
    assert table.size_for(4, 1024) == 1024  # room left: no growth
    table.lengths = [1022]
    assert table.size_for(4, 1024) == 1280  # +256 rounding, the default
    assert table.size_for(4, 1024, geometric=True) == 1280  # a quarter of 1024 is 256
    table.lengths = [4094]
    assert table.size_for(4, 4096, geometric=True) == 4608  # a quarter would be 5120


def test_compiled_by_default_where_it_is_exact(pair):
    assert (wrap_target(pair.model).compiled is not None) == compiled_forward_exact()
