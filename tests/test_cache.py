"""PositionalKVCache: attention over it equals attention over the exact visible history."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from omlx_mtp.decode.cache import commit, make_caches, select_rows, shrink_slack, stack_caches

H, D, W = 2, 4, 8


def reference_visible(history_len: int, query_pos: int, window):
    lo = 0 if window is None else max(0, query_pos - window + 1)
    return list(range(lo, min(query_pos, history_len - 1) + 1))


def run_script(window, script, slack=5, seed=0):
    """script: list of (write L tokens, keep n of them). Checks masks against the true history."""
    rng = np.random.default_rng(seed)
    layers = make_caches([window], 1, slack)
    cache = layers[0]
    truth = []  # committed keys by position
    for L, keep in script:
        new = rng.normal(size=(1, H, L, D)).astype(np.float32)
        mask = np.array(cache.make_mask(L, return_array=True, window_size=window))[0, 0]
        keys, _ = cache.update_and_fetch(mx.array(new), mx.array(new))
        keys = np.array(keys)[0]
        positions = np.array(cache.table.positions)[0][: keys.shape[1]]
        assert mask.shape == (L, keys.shape[1])
        base = len(truth)
        for i in range(L):
            q = base + i
            seen = sorted(int(positions[s]) for s in np.nonzero(mask[i])[0])
            assert seen == reference_visible(base + L, q, window), (q, seen)
            for s in np.nonzero(mask[i])[0]:
                p = int(positions[s])
                expected = truth[p] if p < base else new[0, :, p - base]
                np.testing.assert_array_equal(keys[:, s], expected)
        truth.extend(new[0, :, j] for j in range(keep))
        commit(layers, [base + keep])
    return layers, truth


def test_sliding_ring_far_past_window_with_rollbacks():
    script = [(5, 5)] + [(5, k) for k in [1, 3, 5, 2, 1, 4, 5, 1] * 6]
    layers, truth = run_script(W, script)
    assert len(truth) > 10 * W
    assert layers[0].keys.shape[2] == W + 5  # bounded


def test_full_cache_with_rollbacks():
    run_script(None, [(7, 7)] + [(4, k) for k in [1, 4, 2, 3] * 5])


def test_shrink_slack_keeps_the_latest_positions():
    layers, truth = run_script(W, [(5, 5), (5, 5), (5, 3), (5, 5)], slack=5)
    shrink_slack(layers, 2)
    cache = layers[0]
    assert cache.table.capacity == W + 2
    kept = sorted(p for p in np.array(cache.table.positions)[0].tolist() if p >= 0)
    assert kept == list(range(len(truth) - (W + 2), len(truth)))
    keys = np.array(cache.keys)[0]
    for s, p in enumerate(np.array(cache.table.positions)[0].tolist()):
        if p >= 0:
            np.testing.assert_array_equal(keys[:, s], truth[p])
    # keeps working after the shrink
    cache.update_and_fetch(mx.zeros((1, H, 2, D)), mx.zeros((1, H, 2, D)))


def test_stack_and_select_rows_of_different_lengths():
    a, _ = run_script(W, [(3, 3)], seed=1)
    b, _ = run_script(W, [(5, 5), (5, 5), (5, 2)], seed=2)
    both = stack_caches([a, b])[0]
    assert both.lengths == [3, 12] and both.keys.shape[0] == 2
    assert isinstance(both.offset, mx.array)
    mask = np.array(both.make_mask(2, window_size=W))
    assert mask[0, 0, 0].sum() == 4 and mask[1, 0, 0].sum() == W  # row-wise windows
    only_b = select_rows([both], [1])[0]
    assert only_b.lengths == [12]
    np.testing.assert_array_equal(np.array(only_b.table.positions), np.array(both.table.positions)[1:2])

