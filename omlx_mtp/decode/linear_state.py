"""The state of a linear-attention layer (Gated DeltaNet: a short causal-conv state and a recurrent
state), taken back to any number of the positions its last forward wrote, per row.

A recurrent state cannot be trimmed the way K/V can: the state after a verify of K+1 positions has
seen every draft.  So the cache keeps what it held before the forward and that forward's input;
when a row keeps fewer positions than were written, the host's own layer runs again from the kept
state over the kept inputs only.  mlx-lm's layer already takes per-row lengths (``lengths`` picks
the conv state after that many tokens, its mask freezes the recurrence past them), so one call
restores every row of the batch.  Only the layer's projections into the recurrence are computed
again: its output is never evaluated, so MLX never computes the rest.

The cache speaks mlx-lm's ``ArraysCache`` protocol (``cache[0]`` conv, ``cache[1]`` recurrent
state, ``lengths``, ``advance``, ``make_mask``), so mlx-lm's own layers run on it unchanged.
"""

from __future__ import annotations

import mlx.core as mx


class LinearStateCache:
    def __init__(self, layer, batch_size: int = 1):
        """layer: the host's decoder layer (its ``input_layernorm`` and ``linear_attn``)."""
        self.layer = layer
        self.batch_size = batch_size
        self.cache = [None, None]  # conv state [B, k-1, C], recurrent state [B, Hv, Dv, Dk]
        self.lengths = None  # read by mlx-lm's layer: None = every row keeps every position
        self._before = None  # the state before the last uncommitted forward
        self._inputs = None  # that forward's input to the layer [B, L, H]
        self._held = False  # recording a run of forwards (a plain stretch), not just the last one
        self.settled = 0  # positions of that run already counted in the committed lengths

    # -- mlx-lm cache protocol -------------------------------------------------------------
    def __getitem__(self, index):
        return self.cache[index]

    def __setitem__(self, index, value):
        self.cache[index] = value

    @property
    def state(self):
        return self.cache

    def empty(self) -> bool:
        return self.cache[0] is None

    def make_mask(self, N: int):
        return None  # every position of a forward is a real token for every row

    def advance(self, N: int) -> None:
        pass  # mlx-lm's layer calls this after a forward; positions are counted by the caller

    # -- speculative decoding --------------------------------------------------------------
    def record(self, inputs: mx.array) -> None:
        """Called before a forward: keep the state it starts from and its input (while held, the
        state the run started from and every input since)."""
        if self._held and self._inputs is not None:
            self._inputs = mx.concatenate([self._inputs, inputs], axis=1)
            return
        self._before = list(self.cache)
        self._inputs = inputs

    def hold(self) -> None:
        """Record the coming forwards as one run, so that a row can be taken back to any position
        inside it: a plain stretch steps every row, also one whose request ends mid-stretch."""
        self._held, self.settled = True, 0

    def settle(self, n: int) -> None:
        """The caller counted ``n`` more positions as committed (a prefill chunk, a plain step)."""
        if self._held:
            self.settled += n
        else:
            self.keep(None)

    def keep(self, kept: list[int] | None) -> None:
        """Keep ``kept[r]`` of the positions the last forward (or the held run) wrote in row r
        (None: all of them); the hold ends."""
        before, inputs = self._before, self._inputs
        self._before = self._inputs = None
        self._held, self.settled = False, 0
        if kept is None:
            return
        if before is None:
            if any(kept):
                raise ValueError("a linear-attention state can only be cut back within its last forward")
            return
        if all(k == inputs.shape[1] for k in kept):
            return
        if not any(kept):
            self.cache = before
            return
        longest = max(kept)
        lengths = mx.array(kept, dtype=mx.int32)
        replay = LinearStateCache(self.layer, self.batch_size)  # the kept state, per-row lengths
        replay.cache, replay.lengths = list(before), lengths
        mask = mx.arange(longest)[None] < lengths[:, None]
        self.layer.linear_attn(self.layer.input_layernorm(inputs[:, :longest]), mask, replay)
        self.cache = replay.cache

    def select(self, rows: list[int]) -> "LinearStateCache":
        out = LinearStateCache(self.layer, len(rows))
        index = mx.array(rows, dtype=mx.int32)
        out.cache = [None if c is None else c[index] for c in self.cache]
        return out

    @classmethod
    def stack(cls, caches: list["LinearStateCache"]) -> "LinearStateCache":
        out = cls(caches[0].layer, sum(c.batch_size for c in caches))
        if any(c.empty() for c in caches):
            raise ValueError("cannot stack a linear-attention cache that has seen no token")
        out.cache = [mx.concatenate([c.cache[i] for c in caches]) for i in range(2)]
        return out

