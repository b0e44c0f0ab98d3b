"""Keeping the ranks of a sharded target in step (``mx.distributed``: every rank runs the same loop
over its share of the target, and every rank holds the same final hidden state and logits).

Every rank's loop reaches the same decisions when its inputs are the same: the random state, the
logits (identical after the pipeline's gather or tensor parallelism's all-sum) and what the depth
controllers observe.  Only the last differs by nature — each rank reads its own clock — so rank 0's
round time is the one every rank observes, and the controllers on every rank then choose the same
depths.  One small collective per round carries it, together with a digest of what each rank
decided (its rows, depths, accepted counts and tokens): a rank whose digest differs from rank 0's
stops the run with an error instead of reaching a collective the others never join (a hang).

A collective that does not return in ``timeout`` seconds (a rank died, or is stuck) ends the
process with one clear error: the survivors of a lost rank exit instead of waiting forever.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
import time
from contextlib import contextmanager

import mlx.core as mx

from ..errors import MTPError


class RanksDisagree(MTPError):
    """Ranks reached different decisions: their next collectives would not match."""


class RankGroup:
    def __init__(self, group=None, timeout: float | None = None):
        """timeout: seconds a collective may take (default ``OMLX_MTP_COLLECTIVE_TIMEOUT`` or 60)."""
        self.group = group if group is not None else mx.distributed.init()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.timeout = timeout if timeout is not None else float(os.environ.get("OMLX_MTP_COLLECTIVE_TIMEOUT", "60"))
        self.rounds = 0  # collectives made by ``settle``
        self.seconds = 0.0  # spent in them (the rank check's share of a round, for benchmarks)
        self._since = None  # when the work being watched began (None: none is)
        self._monitor = None

    def _gather(self, values: mx.array) -> mx.array:
        """all_gather on the CPU stream: [size, *values.shape].  Work still running on other
        streams (mlx-lm's generation stream pipelines its next step) is waited for first: a ring
        carries one collective at a time, and two in flight would interleave."""
        from mlx_lm.generate import generation_stream

        with self.watch():
            mx.synchronize(generation_stream)
            mx.synchronize()
            out = mx.distributed.all_gather(values[None], group=self.group, stream=mx.cpu)
            mx.eval(out)
        return out

    @contextmanager
    def watch(self):
        """Work that must finish within ``timeout`` (a round: its forwards' collectives too).  A
        rank that waits longer on another (dead or stuck) ends its process with one error line:
        some backends report a lost peer, others wait for it forever."""
        outermost = self._since is None
        if outermost:
            self._since = time.monotonic()
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, daemon=True)
            self._monitor.start()
        try:
            yield
        finally:
            if outermost:
                self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                print(f"omlx-mtp: error: rank {self.rank} of {self.size}: a round did not complete in "
                      f"{self.timeout:.0f} s (another rank died or stopped); exiting", file=sys.stderr, flush=True)
                os._exit(3)

    def agree_seed(self, seed: int) -> int:
        """Rank 0's seed, for every rank's random state."""
        return int(self._gather(mx.array([seed % (2**31)], dtype=mx.int32))[0, 0].item())

    def settle(self, seconds: float | None, decided: list[int], traced: bool = False) -> tuple[float | None, bool]:
        """Check that every rank ``decided`` the same and return rank 0's round time (None: not
        timed) and whether its round traced a graph."""
        digest = hashlib.blake2b(repr(decided).encode(), digest_size=6).digest()
        words = [int.from_bytes(digest[i : i + 2], "little") for i in range(0, 6, 2)]  # exact in float32
        mine = mx.array([math.nan if seconds is None else seconds, float(traced), *words], dtype=mx.float32)
        started = time.perf_counter()
        rows = self._gather(mine).tolist()
        self.seconds += time.perf_counter() - started
        self.rounds += 1
        theirs = [r for r, row in enumerate(rows) if row[2:] != rows[0][2:]]
        if theirs:
            raise RanksDisagree(f"rank {self.rank}: ranks {theirs} decided otherwise than rank 0 in round "
                                f"{self.rounds} (rows, depths, accepted drafts or tokens differ); stopping before "
                                "their collectives diverge")
        first = rows[0][0]
        return (None if math.isnan(first) else float(first)), bool(rows[0][1])
