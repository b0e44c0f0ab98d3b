"""A K/V cache that can take back rejected draft positions, per row, at any length.

mlx-lm's ``RotatingKVCache`` overwrites slots once it wraps, so trimming it cannot bring back
what a rejected draft overwrote.  This cache records the absolute position held by every slot.
Full-attention layers grow linearly (slot == position); sliding layers use a ring with
``window + slack`` slots, where ``slack`` is at least the number of positions one forward writes,
so a write never evicts a position that any query of the same or a later forward can still see.
Masks are built from the recorded positions, so rows may sit at different lengths
(per-row acceptance) and rejected slots are invisible after ``commit``.

The class speaks mlx-lm's cache protocol (``offset``, ``update_and_fetch``, ``make_mask``,
``state``), so mlx-lm's own attention layers run on it unchanged.
"""

from __future__ import annotations

import mlx.core as mx

_GROW = 256


class PositionalKVCache:
    def __init__(self, batch_size: int = 1, window: int | None = None, slack: int = 64):
        self.batch_size = batch_size
        self.window = window
        self.capacity = None if window is None else window + slack
        self.keys = None
        self.values = None
        self.positions = mx.full((batch_size, 0), -1, dtype=mx.int32)
        self.lengths = [0] * batch_size  # committed tokens per row; host-side, known after acceptance

    # -- mlx-lm cache protocol -------------------------------------------------------------
    @property
    def offset(self):
        first = self.lengths[0]
        if all(n == first for n in self.lengths):
            return first
        return mx.array(self.lengths, dtype=mx.int32)

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        positions = self._positions_after_write(N)
        query = mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(N, dtype=mx.int32)[None]
        key = positions[:, None, :]
        query = query[:, :, None]
        mask = (key >= 0) & (key <= query)
        window = window_size or self.window
        if window is not None:
            mask = mask & (key > query - window)
        return mask[:, None]  # [B, 1, N, S]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, L, _ = keys.shape
        if self.keys is None:
            self.keys = mx.zeros((B, H, 0, keys.shape[-1]), keys.dtype)
            self.values = mx.zeros((B, H, 0, values.shape[-1]), values.dtype)
        self._ensure_size(self._buffer_size(L))
        self.positions = self._positions_after_write(L)
        slots = self._slots(L)
        self.keys = _scatter_rows(self.keys, slots, keys, self.lengths, self.capacity)
        self.values = _scatter_rows(self.values, slots, values, self.lengths, self.capacity)
        return self.keys, self.values

    # -- speculative decoding --------------------------------------------------------------
    def commit(self, lengths: list[int]):
        """Keep positions < lengths[r] in row r; everything written beyond becomes invisible."""
        self.lengths = list(lengths)
        limit = mx.array(self.lengths, dtype=mx.int32)[:, None]
        self.positions = mx.where(self.positions < limit, self.positions, -1)

    def advance(self, n: int):
        """Commit everything written by the last forward (prefill and plain steps)."""
        self.lengths = [length + n for length in self.lengths]

    def shrink_slack(self, slack: int):
        """After a long prefill, give back ring slots no longer needed (one gather)."""
        new_capacity = None if self.window is None else self.window + slack
        if self.keys is None or new_capacity is None or new_capacity >= self.capacity:
            return
        # New slot s holds the one position p in [length - new_capacity, length) with p = s mod new_capacity.
        base = mx.array(self.lengths, dtype=mx.int32)[:, None] - new_capacity
        wanted = base + mx.remainder(mx.arange(new_capacity, dtype=mx.int32)[None] - base, new_capacity)
        old_slots = mx.remainder(wanted, self.capacity)
        held = mx.take_along_axis(self.positions, old_slots, axis=1)
        self.positions = mx.where((wanted >= 0) & (held == wanted), wanted, -1)
        B, H, _, _ = self.keys.shape
        index = old_slots[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, mx.broadcast_to(index, (B, H, new_capacity, 1)), axis=2)
        self.values = mx.take_along_axis(self.values, mx.broadcast_to(index, (B, H, new_capacity, 1)), axis=2)
        self.capacity = new_capacity

    @classmethod
    def stack(cls, caches: list["PositionalKVCache"]) -> "PositionalKVCache":
        """Join single- or multi-row caches of one layer into one batch (rows may differ in length)."""
        first = caches[0]
        out = cls(sum(c.batch_size for c in caches), window=first.window, slack=0)
        out.capacity = first.capacity
        out.lengths = [n for c in caches for n in c.lengths]
        size = max(c.positions.shape[1] for c in caches)
        out.positions = mx.concatenate([_pad_axis(c.positions, size, 1, -1) for c in caches], axis=0)
        if first.keys is not None:
            out.keys = mx.concatenate([_pad_axis(c.keys, size, 2, 0) for c in caches], axis=0)
            out.values = mx.concatenate([_pad_axis(c.values, size, 2, 0) for c in caches], axis=0)
        return out

    def select(self, rows: list[int]) -> "PositionalKVCache":
        """The cache of the given rows only (finished requests leave the batch)."""
        index = mx.array(rows, dtype=mx.int32)
        out = PositionalKVCache(len(rows), window=self.window, slack=0)
        out.capacity = self.capacity
        out.lengths = [self.lengths[r] for r in rows]
        out.positions = self.positions[index]
        if self.keys is not None:
            out.keys, out.values = self.keys[index], self.values[index]
        return out

    def visible_positions(self, window: int | None) -> mx.array:
        """[B, S] mask of committed slots a drafter may read: all of them, or the last ``window``."""
        lengths = mx.array(self.lengths, dtype=mx.int32)[:, None]
        visible = (self.positions >= 0) & (self.positions < lengths)
        if window is not None:
            visible = visible & (self.positions >= lengths - window)
        return visible

    # -- internals ------------------------------------------------------------------------
    def _new_positions(self, L: int) -> mx.array:
        return mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None]

    def _slots(self, L: int) -> mx.array:
        if self.capacity is None:
            return self._new_positions(L)
        if L > self.capacity - self.window:
            raise ValueError(f"a forward of {L} tokens needs slack >= {L} in a sliding cache")
        return mx.remainder(self._new_positions(L), self.capacity)

    def _buffer_size(self, L: int) -> int:
        if self.capacity is not None:
            return self.capacity
        current = 0 if self.keys is None else self.keys.shape[2]
        needed = max(self.lengths) + L
        return current if needed <= current else ((needed + _GROW - 1) // _GROW) * _GROW

    def _positions_after_write(self, L: int) -> mx.array:
        size = self._buffer_size(L)
        positions = self.positions
        if positions.shape[1] < size:
            pad = mx.full((positions.shape[0], size - positions.shape[1]), -1, dtype=mx.int32)
            positions = mx.concatenate([positions, pad], axis=1)
        return mx.put_along_axis(positions, self._slots(L), self._new_positions(L), axis=1)

    def _ensure_size(self, size: int):
        current = self.keys.shape[2]
        if current >= size:
            return
        B, H, _, Dk = self.keys.shape
        extra_k = mx.zeros((B, H, size - current, Dk), self.keys.dtype)
        extra_v = mx.zeros((B, H, size - current, self.values.shape[-1]), self.values.dtype)
        self.keys = mx.concatenate([self.keys, extra_k], axis=2)
        self.values = mx.concatenate([self.values, extra_v], axis=2)


def _scatter_rows(buffer: mx.array, slots: mx.array, new: mx.array, lengths: list[int], capacity):
    """Write new[:, :, i] into buffer[:, :, slots[:, i]], each row at its own slots."""
    L = new.shape[2]
    first = lengths[0]
    if all(n == first for n in lengths):
        start = first if capacity is None else first % capacity
        if capacity is None or start + L <= capacity:
            buffer[:, :, start : start + L] = new
            return buffer
    index = mx.broadcast_to(slots[:, None, :, None], new.shape)
    return mx.put_along_axis(buffer, index, new, axis=2)


def _pad_axis(x: mx.array, size: int, axis: int, value) -> mx.array:
    if x.shape[axis] >= size:
        return x
    shape = list(x.shape)
    shape[axis] = size - x.shape[axis]
    return mx.concatenate([x, mx.full(shape, value, dtype=x.dtype)], axis=axis)
