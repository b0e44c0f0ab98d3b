"""A K/V cache that can take back rejected draft positions, per row, at any length.

mlx-lm's ``RotatingKVCache`` overwrites slots once it wraps, so trimming it cannot bring back
what a rejected draft overwrote.  Here every slot's absolute position is recorded.  Full-attention
layers grow linearly (slot == position); sliding layers use a ring of ``window + slack`` slots,
where ``slack`` is at least the number of positions one forward writes, so a write never evicts a
position that any query of the same or a later forward can still see.  Masks come from the
recorded positions, so rows may sit at different lengths (per-row acceptance) and rejected slots
are invisible after ``commit``.

All layers of one attention type move in lockstep, so their bookkeeping (lengths, positions,
masks) lives in one shared ``SlotTable``; each layer's cache holds only its keys and values.
The cache speaks mlx-lm's protocol (``offset``, ``update_and_fetch``, ``make_mask``, ``state``),
so mlx-lm's own attention layers run on it unchanged.
"""

from __future__ import annotations

import mlx.core as mx

from .linear_state import LinearStateCache

_GROW = 256
_GEOMETRIC_STEP = 512  # at most one re-trace per 512 tokens


class SlotTable:
    def __init__(self, batch_size: int = 1, window: int | None = None, slack: int = 64):
        self.window = window
        self.capacity = None if window is None else window + slack
        self.positions = mx.full((batch_size, 0), -1, dtype=mx.int32)
        self.lengths = [0] * batch_size  # committed tokens per row; host-side, known after acceptance
        self.shifts = [0] * batch_size  # RoPE position minus token count per row (multimodal RoPE)
        self.complete = True  # every position below a row's length is held (none forgotten)
        self._plan = None

    @property
    def uniform(self) -> bool:
        return all(n == self.lengths[0] for n in self.lengths)

    def rope_offsets(self) -> list[int]:
        """The RoPE position of each row's next token."""
        return [n + s for n, s in zip(self.lengths, self.shifts)]

    @property
    def offset(self):
        """What mlx-lm's attention layers read as the next position: an int when rows agree."""
        offsets = self.rope_offsets()
        return offsets[0] if all(o == offsets[0] for o in offsets) else mx.array(offsets, dtype=mx.int32)

    def size_for(self, L: int, current: int, geometric: bool = False) -> int:
        """Slots a buffer needs before a forward of L tokens.  ``geometric``: grow by a quarter, at
        most ``_GEOMETRIC_STEP`` slots ahead, so that a compiled forward (traced again per buffer
        size) rarely sees a new one while long contexts hold little more K/V than plain decoding."""
        if self.capacity is not None:
            return self.capacity
        needed = max(self.lengths) + L
        if needed <= current:
            return current
        if geometric:
            needed = max(needed, current + min(current // 4, _GEOMETRIC_STEP))
        return ((needed + _GROW - 1) // _GROW) * _GROW

    def plan(self, L: int, current: int):
        """(slots written, positions after the write) for a forward of L tokens — computed once
        per forward and shared by every layer of this type."""
        key = (L, current, tuple(self.lengths))
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        if self.capacity is not None and L > self.capacity - self.window:
            raise ValueError(f"a forward of {L} tokens needs slack >= {L} in a sliding cache")
        positions = pad_axis(self.positions, self.size_for(L, current), 1, -1)
        start = self.contiguous_start(L)
        if start is not None:  # every row writes the same run of slots: a slice, few ops per step
            n = self.lengths[0]
            slots = mx.broadcast_to(mx.arange(start, start + L, dtype=mx.int32), (len(self.lengths), L))
            positions[:, start : start + L] = mx.arange(n, n + L, dtype=mx.int32)
        else:
            new_positions = mx.array(self.lengths, dtype=mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None]
            slots = new_positions if self.capacity is None else mx.remainder(new_positions, self.capacity)
            positions = mx.put_along_axis(positions, slots, new_positions, axis=1)
        self._plan = (key, (slots, positions))
        return slots, positions

    def contiguous_start(self, L: int) -> int | None:
        """The first slot a forward of L tokens writes when all rows write the same contiguous
        slots (equal lengths, no wrap inside the write); None otherwise."""
        if not self.uniform:
            return None
        start = self.lengths[0] if self.capacity is None else self.lengths[0] % self.capacity
        return start if self.capacity is None or start + L <= self.capacity else None

    def fetch_size(self, L: int, current: int) -> int:
        """How many slots attention reads after a forward of L tokens: just the written prefix
        while every slot there holds its own position (equal lengths, ring not wrapped)."""
        if self.uniform and self.complete and (self.capacity is None or self.lengths[0] + L <= self.capacity):
            return self.lengths[0] + L
        return max(self.lengths) + L if self.capacity is None else self.capacity

    def make_mask(self, N: int, current: int, window_size: int | None = None, as_array: bool = False):
        window = window_size or self.window
        size = self.fetch_size(N, current)
        prefix = self.uniform and self.complete and size == self.lengths[0] + N
        if prefix and not as_array and (window is None or size <= window):
            return None if N == 1 else "causal"
        _, positions = self.plan(N, current)
        return self.mask_over(positions, N, size, window)

    def mask_over(self, positions: mx.array, N: int, size: int, window: int | None = None) -> mx.array:
        """[B, 1, N, size] boolean mask of a forward of N tokens over the first ``size`` slots,
        given the slots' positions after its write (``plan``)."""
        window = window or self.window
        query = mx.array(self.lengths, dtype=mx.int32)[:, None, None] + mx.arange(N, dtype=mx.int32)[None, :, None]
        key = positions[:, None, :size]
        mask = (key >= 0) & (key <= query)
        if window is not None:
            mask = mask & (key > query - window)
        return mask[:, None]

    def commit(self, lengths: list[int]):
        """Keep positions < lengths[r] in row r; everything written beyond becomes invisible."""
        self.lengths = list(lengths)
        limit = mx.array(self.lengths, dtype=mx.int32)[:, None]
        self.positions = mx.where(self.positions < limit, self.positions, -1)

    def forget(self, position: int):
        """Make one position invisible in every row (an entry written without its input)."""
        self.positions = mx.where(self.positions == position, -1, self.positions)
        self.complete = False

    def start_at(self, lengths: list[int]):
        """Rows that begin at these lengths with nothing before them visible."""
        self.lengths = list(lengths)
        self.complete = False

    def advance(self, n: int):
        """Commit everything the last forward wrote (prefill)."""
        self.lengths = [length + n for length in self.lengths]

    def shrink_slack(self, slack: int):
        """Returns the slot gather index for a smaller ring (or None when nothing changes)."""
        new_capacity = None if self.window is None else self.window + slack
        if new_capacity is None or new_capacity >= self.capacity:
            return None
        # New slot s holds the one position p in [length - new_capacity, length) with p = s mod new_capacity.
        base = mx.array(self.lengths, dtype=mx.int32)[:, None] - new_capacity
        wanted = base + mx.remainder(mx.arange(new_capacity, dtype=mx.int32)[None] - base, new_capacity)
        old_slots = mx.remainder(wanted, self.capacity)
        held = mx.take_along_axis(pad_axis(self.positions, self.capacity, 1, -1), old_slots, axis=1)
        self.positions = mx.where((wanted >= 0) & (held == wanted), wanted, -1)
        self.capacity = new_capacity
        return old_slots

    def visible(self, span: int | None) -> mx.array:
        """[B, S] committed slots a drafter may read: all of them, or the latest ``span``."""
        lengths = mx.array(self.lengths, dtype=mx.int32)[:, None]
        visible = (self.positions >= 0) & (self.positions < lengths)
        if span is not None:
            visible = visible & (self.positions >= lengths - span)
        return visible

    @classmethod
    def stack(cls, tables: list["SlotTable"]) -> "SlotTable":
        out = cls(1, window=tables[0].window, slack=0)
        out.capacity = tables[0].capacity
        out.lengths = [n for t in tables for n in t.lengths]
        out.shifts = [n for t in tables for n in t.shifts]
        out.complete = all(t.complete for t in tables)
        size = max(t.positions.shape[1] for t in tables)
        out.positions = mx.concatenate([pad_axis(t.positions, size, 1, -1) for t in tables], axis=0)
        return out

    def select(self, rows: list[int]) -> "SlotTable":
        out = SlotTable(1, window=self.window, slack=0)
        out.capacity = self.capacity
        out.lengths = [self.lengths[r] for r in rows]
        out.shifts = [self.shifts[r] for r in rows]
        out.complete = self.complete
        out.positions = self.positions[mx.array(rows, dtype=mx.int32)]
        return out


class PositionalKVCache:
    def __init__(self, table: SlotTable):
        self.table = table
        self.keys = None
        self.values = None

    # -- mlx-lm cache protocol -------------------------------------------------------------
    @property
    def offset(self):
        return self.table.offset

    @property
    def lengths(self) -> list[int]:
        return self.table.lengths

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    def allocated(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self.table.make_mask(N, self.allocated(), window_size, as_array=return_array)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, L, _ = keys.shape
        if self.keys is None:
            self.keys = mx.zeros((B, H, 0, keys.shape[-1]), keys.dtype)
            self.values = mx.zeros((B, H, 0, values.shape[-1]), values.dtype)
        table = self.table
        current = self.allocated()
        slots, positions = table.plan(L, current)
        end = table.fetch_size(L, current)
        table.positions = positions  # the same for every layer of this type in this forward
        size = table.size_for(L, current)
        self.keys = _scatter_rows(pad_axis(self.keys, size, 2, 0), slots, keys, table)
        self.values = _scatter_rows(pad_axis(self.values, size, 2, 0), slots, values, table)
        if end == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[:, :, :end], self.values[:, :, :end]

    # -- speculative decoding --------------------------------------------------------------
    def shrink(self, old_slots: mx.array):
        B, H = self.keys.shape[:2]
        index = mx.broadcast_to(old_slots[:, None, :, None], (B, H, old_slots.shape[1], 1))
        self.keys = mx.take_along_axis(self.keys, index, axis=2)
        self.values = mx.take_along_axis(self.values, index, axis=2)


# -- a model's list of caches ----------------------------------------------------------------
# A list may mix these K/V caches with linear-attention states (``LinearStateCache``, hybrid
# models): the states follow the committed lengths of the K/V tables.
def make_caches(layer_windows: list[int | None], batch_size: int, slack: int) -> list[PositionalKVCache]:
    """One cache per layer; layers with the same window share one SlotTable."""
    tables: dict = {}
    out = []
    for window in layer_windows:
        if window not in tables:
            tables[window] = SlotTable(batch_size, window=window, slack=slack)
        out.append(PositionalKVCache(tables[window]))
    return out


def tables_of(caches: list) -> list[SlotTable]:
    seen = {}
    for cache in caches:
        if isinstance(cache, PositionalKVCache):
            seen.setdefault(id(cache.table), cache.table)
    return list(seen.values())


def lengths_of(caches: list) -> list[int]:
    """Committed tokens per row."""
    return tables_of(caches)[0].lengths


def _states(caches: list) -> list[LinearStateCache]:
    return [c for c in caches if isinstance(c, LinearStateCache)]


def commit(caches: list, lengths: list[int]) -> None:
    states = _states(caches)
    if states:  # the last forward (or held run) wrote from the committed lengths on (less what it settled)
        for state in states:
            state.keep([new - old + state.settled for new, old in zip(lengths, lengths_of(caches))])
    for table in tables_of(caches):
        table.commit(lengths)


def hold(caches: list) -> None:
    """Record the coming forwards of linear-attention states as one run (``LinearStateCache.hold``)."""
    for state in _states(caches):
        state.hold()


def advance(caches: list, n: int) -> None:
    for state in _states(caches):
        state.settle(n)
    for table in tables_of(caches):
        table.advance(n)


def shrink_slack(caches: list, slack: int) -> None:
    for table in tables_of(caches):
        old_slots = table.shrink_slack(slack)
        if old_slots is not None:
            for cache in caches:
                if getattr(cache, "table", None) is table and cache.keys is not None:
                    cache.shrink(old_slots)


def stack_caches(per_row: list[list]) -> list:
    """Join the cache lists of several (single- or multi-row) batches into one batch."""
    tables: dict = {}
    out = []
    for layer, cache in enumerate(per_row[0]):
        if isinstance(cache, LinearStateCache):
            out.append(LinearStateCache.stack([caches[layer] for caches in per_row]))
            continue
        if id(cache.table) not in tables:
            tables[id(cache.table)] = SlotTable.stack([caches[layer].table for caches in per_row])
        merged = PositionalKVCache(tables[id(cache.table)])
        if cache.keys is not None:
            size = max(caches[layer].allocated() for caches in per_row)
            merged.keys = mx.concatenate([pad_axis(c[layer].keys, size, 2, 0) for c in per_row], axis=0)
            merged.values = mx.concatenate([pad_axis(c[layer].values, size, 2, 0) for c in per_row], axis=0)
        out.append(merged)
    return out


def select_rows(caches: list, rows: list[int]) -> list:
    """The caches of the given rows only (finished requests leave the batch)."""
    index = mx.array(rows, dtype=mx.int32)
    tables = {id(t): t.select(rows) for t in tables_of(caches)}
    out = []
    for cache in caches:
        if isinstance(cache, LinearStateCache):
            out.append(cache.select(rows))
            continue
        picked = PositionalKVCache(tables[id(cache.table)])
        if cache.keys is not None:
            picked.keys, picked.values = cache.keys[index], cache.values[index]
        out.append(picked)
    return out


def _scatter_rows(buffer: mx.array, slots: mx.array, new: mx.array, table: SlotTable):
    """Write new[:, :, i] into buffer[:, :, slots[:, i]], each row at its own slots."""
    L = new.shape[2]
    start = table.contiguous_start(L)
    if start is not None:
        buffer[:, :, start : start + L] = new
        return buffer
    index = mx.broadcast_to(slots[:, None, :, None], new.shape)
    return mx.put_along_axis(buffer, index, new, axis=2)


def pad_axis(x: mx.array, size: int, axis: int, value) -> mx.array:
    if x.shape[axis] >= size:
        return x
    shape = list(x.shape)
    shape[axis] = size - x.shape[axis]
    return mx.concatenate([x, mx.full(shape, value, dtype=x.dtype)], axis=axis)
