"""Deciding how many drafts each row keeps — vectorised over rows and positions, no host sync.

Greedy rows keep drafts while they equal the target's argmax and then emit the target's own
token.  Sampled rows use rejection sampling: keep draft d with probability min(1, p(d)/q(d));
at the first rejection draw from normalize(max(p - q, 0)); after K accepted drafts draw the
bonus from p.  The emitted sequence then has exactly the target's distribution.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import SamplingParams, target_probs


def leading_true(flags: mx.array) -> mx.array:
    """[B, K] bool -> [B] count of leading True values."""
    B, K = flags.shape
    if K == 0:
        return mx.zeros((B,), dtype=mx.int32)
    # The index of the first False (K when there is none).  A min, not a cumprod: mlx 0.31's
    # CPU integer scan crashes on some inputs.
    return mx.min(mx.where(flags, K, mx.arange(K, dtype=mx.int32)), axis=1).astype(mx.int32)


def accept_greedy(drafts: mx.array, target_tokens: mx.array, allowed: mx.array | None = None):
    """drafts [B, K], target argmax [B, K+1] -> (accepted count [B], next token [B]).
    ``allowed`` [B, K]: drafts a row may keep at all (a row capped below K rejects the rest)."""
    K = drafts.shape[1]
    match = drafts == target_tokens[:, :K]
    n = leading_true(match if allowed is None else match & allowed)
    return n, mx.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]


def accept_sampled(drafts: mx.array, q: mx.array, p: mx.array, key: mx.array, allowed: mx.array | None = None):
    """drafts [B, K] drawn from q [B, K, V]; p [B, K+1, V] target -> (accepted [B], next token [B]).
    A draft that is not ``allowed`` counts as proposed with q = 0: rejected, and the residual
    there is p itself, so the row's next token is a plain draw from p at that position."""
    K = drafts.shape[1]
    accept_key, draw_key = mx.random.split(key)
    if allowed is not None:
        q = mx.where(allowed[..., None], q, 0.0)
    index = drafts[..., None]
    p_draft = mx.take_along_axis(p[:, :K], index, axis=-1)[..., 0]
    q_draft = mx.take_along_axis(q, index, axis=-1)[..., 0]
    u = mx.random.uniform(shape=p_draft.shape, key=accept_key)
    flags = u * q_draft < p_draft  # u < p/q without dividing
    n = leading_true(flags if allowed is None else flags & allowed)
    residual = mx.maximum(p[:, :K] - q, 0.0)
    candidates = mx.concatenate([residual, p[:, K:]], axis=1)  # [B, K+1, V]
    chosen = mx.take_along_axis(candidates, n[:, None, None], axis=1)[:, 0]
    fallback = mx.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    # p == q up to rounding leaves no residual mass; p itself is then the exact answer.
    chosen = mx.where(chosen.sum(axis=-1, keepdims=True) > 0, chosen, fallback)
    token = mx.random.categorical(mx.log(chosen), key=draw_key)
    return n, token.astype(drafts.dtype)


def allowed_drafts(K: int, caps: mx.array) -> mx.array:
    """[B, K] mask of the drafts each row may keep, from ``caps`` [B]."""
    return mx.arange(K)[None] < caps[:, None]


def kept_hidden(hidden: mx.array, n: mx.array) -> mx.array:
    """The verify hidden state [B, 1, H] at each row's last kept position (n accepted drafts)."""
    return mx.take_along_axis(hidden, n[:, None, None], axis=1)


# The two common cases as whole graphs (compiled by the loop): every row greedy, or every row
# sampling from the same distribution.  ``caps`` [B]: drafts each row may keep; ``hidden``
# [B, K+1, H]: verify hidden states.
def accept_greedy_graph(drafts, logits, hidden, caps):
    allowed = allowed_drafts(drafts.shape[1], caps)
    n, token = accept_greedy(drafts, mx.argmax(logits, axis=-1).astype(mx.int32), allowed)
    return n, token, kept_hidden(hidden, n)


def accept_sampled_graph(params: SamplingParams, drafts, q, logits, hidden, key, caps):
    allowed = allowed_drafts(drafts.shape[1], caps)
    n, token = accept_sampled(drafts, q, target_probs(logits, params), key, allowed)
    return n, token, kept_hidden(hidden, n)
