"""The target's short forwards (a verify of K+1 positions, a plain step) as one compiled graph.

A decode forward of a small or mid-sized model is mostly op dispatch: dozens of small ops per
layer.  ``mx.compile`` fuses the element-wise ones, which makes such a forward about a third
cheaper on CPU.  A compiled graph bakes in every Python value it saw while tracing, so what
changes between rounds goes in as arrays of fixed shape: the positions (rope offsets), the slots
each row writes and an attention mask over the whole K/V buffer.  The graph is traced again only
when a shape changes: another number of positions (depth), another batch size, or a full-attention
buffer growing (rarely: buffers grow geometrically on this path).

mlx-lm's own Gemma 4 layers run inside unchanged; they see ``_TracedSlots`` as their cache.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import mlx.core as mx

from .cache import PositionalKVCache, pad_axis, tables_of


def compiled_forward_exact() -> bool:
    """Whether the target's forward is compiled by default.  From mlx 0.32 a compiled forward gives
    the op-by-op results bit for bit (float32, CPU, checked by the tests); mlx 0.31's CPU compiler fuses
    element-wise ops with other rounding (~1e-4 after a few layers), which in bf16 moves greedy output
    off plain decoding at more than near-ties.  Draft steps and acceptance are compiled everywhere:
    they do not decide what the target emits."""
    major, minor = (int(part) for part in mx.__version__.split(".")[:2])
    return (major, minor) >= (0, 32)


class _TracedSlots:
    """mlx-lm's cache protocol inside the traced graph: K/V buffers of fixed size, new K/V
    scattered to given slots, the mask and positions handed in."""

    def __init__(self, keys, values, slots, mask, offset):
        self.keys, self.values = keys, values
        self.slots, self.mask, self.offset = slots, mask, offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        index = self.slots[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(index, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(index, values.shape), values, axis=2)
        return self.keys, self.values


class TraceCache:
    """``mx.compile(fn)`` kept per input shape, a bounded number of them (a long-running server's
    batch and buffer sizes come and go; a dropped compiled function releases its trace).  ``made``
    counts the traces, so a caller can tell a round that paid for tracing from one that did not."""

    def __init__(self, fn, limit: int = 64):
        self.fn, self.limit = fn, limit
        self.made = 0
        self._by_shape: OrderedDict = OrderedDict()

    def __call__(self, *args: mx.array):
        key = tuple((a.shape, a.dtype) for a in args)
        compiled = self._by_shape.pop(key, None)
        if compiled is None:
            compiled = mx.compile(partial(self.fn))
            self.made += 1
            while len(self._by_shape) >= self.limit:
                self._by_shape.popitem(last=False)
        self._by_shape[key] = compiled
        return compiled(*args)

    def __len__(self) -> int:
        return len(self._by_shape)


class CompiledForward:
    """``forward(tokens, cache)`` for the target, compiled; same results as the plain call."""

    max_positions = 16  # longer forwards (prefill chunks) run uncompiled: one trace per length

    def __init__(self, target):
        self.target = target
        self.traces = TraceCache(self._graph)  # per shape: batch, positions, buffer sizes
        self._layout = None  # per cache layer: index of its SlotTable in the argument list

    def accepts(self, tokens: mx.array, cache: list) -> bool:
        return (
            tokens.shape[1] <= self.max_positions
            and all(isinstance(c, PositionalKVCache) and not c.empty() for c in cache)
        )

    def __call__(self, tokens: mx.array, cache: list[PositionalKVCache]):
        L = tokens.shape[1]
        tables = tables_of(cache)
        table_index = {id(t): i for i, t in enumerate(tables)}
        self._layout = [table_index[id(c.table)] for c in cache]
        per_table = []
        for table in tables:
            current = next(c.allocated() for c in cache if c.table is table)
            size = table.size_for(L, current, geometric=True)
            slots, positions = table.plan(L, size)
            per_table += [slots, table.mask_over(positions, L, size)]
            table.positions = positions
            for c in cache:
                if c.table is table and current < size:
                    c.keys, c.values = pad_axis(c.keys, size, 2, 0), pad_axis(c.values, size, 2, 0)
        offsets = mx.array(tables_of(cache)[0].rope_offsets(), dtype=mx.int32)
        buffers = [a for c in cache for a in (c.keys, c.values)]
        logits, hidden, *buffers = self.traces(tokens, offsets, *per_table, *buffers)
        for i, c in enumerate(cache):
            c.keys, c.values = buffers[2 * i], buffers[2 * i + 1]
        return logits, hidden

    def _graph(self, tokens, offsets, *arrays):
        n_tables = 1 + max(self._layout)
        per_table, buffers = arrays[: 2 * n_tables], arrays[2 * n_tables :]
        shims = []
        for layer, t in enumerate(self._layout):
            slots, mask = per_table[2 * t], per_table[2 * t + 1]
            shims.append(_TracedSlots(buffers[2 * layer], buffers[2 * layer + 1], slots, mask, offsets))
        hidden = self.target.hidden(tokens, shims)
        out = [self.target.head(hidden), hidden]
        for shim in shims:
            out += [shim.keys, shim.values]
        return out
