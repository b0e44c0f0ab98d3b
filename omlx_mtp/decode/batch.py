"""A live batch: requests join (prefilled) and leave between rounds; each round drafts to the
deepest depth a row asked for, or runs a pipelined stretch of plain steps when no row drafts."""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import mlx.core as mx

from . import cache as caches
from .controller import AcceptanceMemory, DepthController, RoundCosts
from .processors import RowProcessors
from .requests import Request, RowState
from .sampling import SamplingParams


class RoundEngine(Protocol):
    """What a live batch asks of the decoder (``loop.SpeculativeDecoder``): the public round API.
    The batch owns its rows and policy state; the decoder owns the models and their caches."""

    drafter: Any
    target: Any
    max_draft_tokens: int
    min_acceptance: float
    batch_controllers: dict
    timeline: list | None

    @property
    def traces_made(self) -> int: ...

    def round_costs(self, batch_size: int, max_depth: int, context: int = 0) -> RoundCosts: ...

    def acceptance_memory(self, params: SamplingParams) -> AcceptanceMemory: ...

    def process_logits(self, rows, logits: mx.array, drafts: mx.array | None = None, caps=None) -> mx.array: ...

    def sample_rows(self, rows, logits: mx.array, key) -> mx.array: ...

    def run_round(self, rows, cache, bonus, hidden, K: int, key, caps: list[int] | None = None): ...

    def absorb_stretch(self, cache: list, fed: list) -> None: ...

    def cache_at(self, cache: list, pending: mx.array, length: int) -> list: ...


class Round(NamedTuple):
    """A round as a timeline keeps it: ``kind`` "plain" (a stretch of ``steps`` plain steps),
    "draft" (drafting that won on what was known) or "probe" (drafting to find out); its depth,
    rows, tokens emitted by all rows, wall seconds (host sync included) and whether it traced."""

    kind: str
    depth: int
    steps: int
    rows: int
    tokens: int
    seconds: float
    traced: bool

class LiveBatch:
    """The rows decoding together.  Rows join (prefilled) and leave at round boundaries; each
    round drafts to the deepest depth any row asked for, and each row keeps at most its own.

    When no row drafts, a round is a short stretch of plain steps pipelined as mlx-lm's own loop
    is: each step's graph is built while the previous one computes, with no host sync between
    them (positions advance by one per step, so the caches need no host knowledge), and stop
    tokens are found on the host afterwards."""

    max_plain_stretch = 8  # plain steps per round: one host sync per stretch; a controller may end it early

    def __init__(self, decoder: RoundEngine, draft_tokens: int | str, seed: int | None = None):
        self.decoder = decoder
        self.auto = draft_tokens == "auto"
        depth = decoder.max_draft_tokens if self.auto else int(draft_tokens)
        self.max_depth = 0 if decoder.drafter is None else depth
        seed = seed if seed is not None else time.time_ns() % (2**31)
        self.ranks = getattr(decoder, "ranks", None)  # a sharded target's ranks, kept in step (None: one process)
        if self.ranks is not None:
            seed = self.ranks.agree_seed(seed)
        self.key = mx.random.key(seed)
        self._unchecked: list[int] = []  # first tokens sampled since the ranks last compared decisions
        self.rows: list[RowState] = []
        self.cache = self.bonus = self.hidden = None
        self.logits = None  # processed verify logits of the last round [B, K+1, V] (for logprobs)
        self.first_logits = None  # processed logits of the last rows started [B, 1, V]
        self._batch_pending: int | None = None

    def new_row(self, request: Request, processors: list | None = None, **extra) -> RowState:
        """A row for ``request``; processors default to those its sampling parameters make."""
        controller = None
        if self.max_depth and (self.auto or self.decoder.min_acceptance > 0):
            # auto: depth per round; a fixed depth: only the fall back to plain below min_acceptance
            controller = DepthController(self.max_depth, self.decoder.min_acceptance, fixed=not self.auto,
                                         costs=self.decoder.round_costs(1, self.max_depth),
                                         memory=self.decoder.acceptance_memory(request.params))
        history = mx.array(list(request.prompt), dtype=mx.int32)
        if processors is None:
            processors = request.params.processors()
        return RowState(request, RowProcessors(processors), history, controller=controller, **extra)

    def _split_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def start(self, rows: list[RowState], cache, hidden, logits) -> list[list[int]]:
        """Rows whose prompts are in ``cache``: sample each one's first token from ``logits``
        (the last prompt position), then let the unfinished ones join the batch."""
        for row, length in zip(rows, caches.lengths_of(cache)):
            row.prompt_length = length
        logits = self.decoder.process_logits(rows, logits[:, -1:])
        bonus = self.decoder.sample_rows(rows, logits[:, 0], self._split_key())
        first = bonus.tolist()
        new = []
        for row, token in zip(rows, first):
            row.processors.settle(1)
            row.history = mx.concatenate([row.history, mx.array([token], dtype=mx.int32)])
            new.append(row.emit([token]))
        self.first_logits = logits
        self._unchecked += [len(rows), *first]
        live = [i for i, row in enumerate(rows) if row.finish_reason is None]
        if live:
            self._join([rows[i] for i in live], *_select(live, len(rows), bonus, hidden[:, -1:], cache))
        return new

    def _join(self, rows, bonus, hidden, cache):
        if not self.rows:
            self.rows, self.bonus, self.hidden, self.cache = list(rows), bonus, hidden, cache
            return
        self.rows += rows
        self.bonus = mx.concatenate([self.bonus, bonus])
        self.hidden = mx.concatenate([self.hidden, hidden])
        self.cache = caches.stack_caches([self.cache, cache])

    def retire(self, rows: list[RowState]) -> None:
        """Remove rows (finished or aborted) from the batch."""
        gone = {id(row) for row in rows}
        keep = [i for i, row in enumerate(self.rows) if id(row) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.bonus, self.hidden = [], None, None, None
            return
        self.bonus, self.hidden, self.cache = _select(keep, len(self.rows), self.bonus, self.hidden, self.cache)
        self.rows = [self.rows[i] for i in keep]

    def _batch_controller(self) -> DepthController | None:
        """With ``auto`` and several rows, one depth serves the batch: a round's cost is the whole
        batch's, so the depth that maximises tokens per second summed over rows is chosen from the
        rows' pooled acceptance and round times measured at this batch size (plain included).
        The controllers live on the decoder, so what they learnt outlasts a batch."""
        if not self.auto or not self.max_depth or len(self.rows) < 2:
            return None
        by_size = self.decoder.batch_controllers
        key = (len(self.rows), self.max_depth)
        if key not in by_size:  # its acceptance prior: what requests like its first row's accepted
            by_size[key] = DepthController(self.max_depth, self.decoder.min_acceptance,
                                           costs=self.decoder.round_costs(*key),
                                           memory=self.decoder.acceptance_memory(self.rows[0].request.params))
        return by_size[key]

    def _follow_context(self, batch: DepthController | None) -> None:
        """Point auto's controllers at the costs of their context length (``batch``, the batch's
        controller: its longest row's)."""
        if not self.auto:
            return
        lengths = caches.lengths_of(self.cache)
        if batch is not None:
            batch.costs = self.decoder.round_costs(len(self.rows), self.max_depth, max(lengths))
            return
        for row, length in zip(self.rows, lengths):
            if row.controller is not None:
                row.controller.costs = self.decoder.round_costs(1, self.max_depth, length)

    def _depths(self, rows: list[RowState]) -> list[int]:
        """The depth each row wants for the next round."""
        batch = self._batch_controller()
        self._follow_context(batch)
        if batch is None:
            return [self._wanted(row) for row in rows]
        depth, self._batch_pending = self._batch_pending, None
        if depth is None:
            depth = batch.choose(max(_left(row) for row in rows))
        return [0 if row.one_token_per_round else depth for row in rows]

    def _observe(self, caps: list[int], accepted: list[int], seconds: float | None, traced: bool) -> None:
        batch = self._batch_controller()
        if batch is not None:
            # Rows held to fewer drafts (a snapshot boundary, max_tokens) say nothing of depth K.
            K = max(caps)
            drafting = [n for cap, n in zip(caps, accepted) if cap and cap == K]
            batch.observe(K, drafting, seconds, traced)
            seconds = None  # a row's own times are for when it decodes alone
        for row, cap, n in zip(self.rows, caps, accepted):
            if row.controller is not None:
                row.controller.observe(cap, [n] if cap else [0], seconds, traced)

    def _probing(self, row: RowState) -> bool:
        """Whether the row's depth this round was a probe (plain had won; drafting was tried to find out)."""
        controller = self._batch_controller() or row.controller
        return controller is not None and controller.probing

    def _wanted(self, row: RowState) -> int:
        if row.one_token_per_round:
            return 0
        if row.pending_depth is not None:
            depth, row.pending_depth = row.pending_depth, None
            return depth
        return row.controller.choose(_left(row)) if row.controller is not None else self.max_depth

    def round(self) -> list[list[int]]:
        """One round for every row; returns the tokens each row emitted (in ``self.rows`` order).
        With a sharded target the round is watched: a rank lost meanwhile ends this one."""
        if self.ranks is None:
            return self._round()
        with self.ranks.watch():
            return self._round()

    def _round(self) -> list[list[int]]:
        rows = self.rows
        wanted = self._depths(rows)
        remaining = max(row.request.max_tokens - len(row.generated) for row in rows)
        K = max(0, min(max(wanted), self.max_depth, remaining - 1))
        # Each row's round ends at the latest on its next snapshot boundary (without snapshots
        # caps are min(w, K) and K stays as it is).
        caps = [min(w, K, row.until_snapshot - 1) for w, row in zip(wanted, rows)]
        K = max(caps)
        if K == 0 and not any(row.processors.stateful for row in rows):
            return self._plain_stretch(min(self.max_plain_stretch, remaining, *(row.until_snapshot for row in rows)))
        started, traces = time.perf_counter(), self.decoder.traces_made
        drafts, n, bonus, hidden, self.logits = self.decoder.run_round(
            rows, self.cache, self.bonus, self.hidden, K, self._split_key(), caps)
        drafts_host, n_host, bonus_host = drafts.tolist(), n.tolist(), bonus.tolist()
        seconds, traced = self._settle(*self._timing(started, traces), [len(rows), *caps, *n_host, *bonus_host])
        probes = [self._probing(row) for row in rows]
        self._record("probe" if any(probes) else "draft", K, 1, sum(n_host) + len(rows), started, traces)
        self._observe(caps, n_host, seconds, traced)
        new, lengths = [], []
        for slot, row in enumerate(rows):
            kept = drafts_host[slot][: n_host[slot]] + [bonus_host[slot]]
            row.processors.settle(len(kept))
            row.stats.count_round(caps[slot], n_host[slot], probe=probes[slot])
            emitted = row.emit(kept)
            row.stats.emitted += len(emitted)
            new.append(emitted)
            if row.processors:
                row.history = mx.concatenate([row.history, mx.array(kept, dtype=mx.int32)])
            lengths.append(min(caches.lengths_of(self.cache)[slot] + n_host[slot] + 1, row.cache_length))
        caches.commit(self.cache, lengths)
        self.bonus, self.hidden = bonus, hidden
        return new

    def _plain_stretch(self, limit: int) -> list[list[int]]:
        """Up to ``limit`` plain steps without a host sync; stops early when a controller wants to
        draft again (that depth is kept for the next round)."""
        rows, decoder = self.rows, self.decoder
        started, traces = time.perf_counter(), decoder.traces_made
        steps, fed, bonus, hidden = [], [], self.bonus, self.hidden
        caches.hold(self.cache)  # a row whose request ends mid-stretch is taken back below
        while True:
            fed.append((bonus[:, None], hidden))  # (token, hidden state before it), for a drafter's own cache
            logits, hidden = decoder.target.forward(bonus[:, None], self.cache)
            caches.advance(self.cache, 1)
            logits = decoder.process_logits(rows, logits)
            bonus = decoder.sample_rows(rows, logits[:, 0], self._split_key())
            mx.async_eval(bonus, hidden)
            steps.append((bonus, logits))
            for r, row in enumerate(rows):
                if row.processors:
                    row.history = mx.concatenate([row.history, bonus[r : r + 1]])
            if len(steps) == limit or not self._still_plain():
                break
        decoder.absorb_stretch(self.cache, fed)
        tokens = mx.stack([b for b, _ in steps], axis=1).tolist()
        self.logits = mx.concatenate([l for _, l in steps], axis=1)
        seconds, traced = self._settle(*self._timing(started, traces, len(steps)),
                                       [len(rows), len(steps), *(t for row_tokens in tokens for t in row_tokens)])
        self._record("plain", 0, len(steps), len(steps) * len(rows), started, traces)
        for _ in steps:
            self._observe([0] * len(rows), [0] * len(rows), seconds, traced)
        new = []
        for row, row_tokens in zip(rows, tokens):
            emitted = row.emit(row_tokens)
            row.stats.rounds += len(steps)
            row.stats.plain_steps += len(steps)
            row.stats.emitted += len(emitted)
            new.append(emitted)
        # Every row stepped the whole stretch: one that ended inside it (max_tokens, a stop) keeps
        # only its own positions, as a verify round's commit does (linear-attention states can be
        # taken back only while the stretch is held).
        caches.commit(self.cache, [min(n, row.cache_length) for n, row in zip(caches.lengths_of(self.cache), rows)])
        self.bonus, self.hidden = bonus, hidden
        return new

    def _record(self, kind: str, depth: int, steps: int, tokens: int, started: float, traces: int) -> None:
        """One round into the decoder's timeline, when one is kept (``SpeculativeDecoder.timeline``)."""
        if self.decoder.timeline is not None:
            self.decoder.timeline.append(Round(kind, depth, steps, len(self.rows), tokens,
                                               time.perf_counter() - started, self.decoder.traces_made != traces))

    def _settle(self, seconds: float, traced: bool, decided: list[int]) -> tuple[float | None, bool]:
        """With a sharded target: check the ranks decided alike, and take rank 0's time (what every
        rank's controllers then observe, so that they choose alike)."""
        if self.ranks is None:
            return seconds, traced
        decided, self._unchecked = self._unchecked + decided, []
        return self.ranks.settle(seconds, decided, traced)

    def _timing(self, started: float, traces: int, steps: int = 1) -> tuple[float, bool]:
        """Seconds per step since ``started``, and whether a graph was traced meanwhile (then the
        time tells what tracing costs, not what the round does)."""
        return (time.perf_counter() - started) / steps, self.decoder.traces_made != traces

    def _still_plain(self) -> bool:
        """Ask the controllers for the next depth; any wish to draft ends the stretch."""
        batch = self._batch_controller()
        if batch is not None:
            if self._batch_pending is None:
                self._batch_pending = batch.choose(max(_left(row) for row in self.rows)) or None
            return self._batch_pending is None
        go_on = True
        for row in self.rows:
            if row.controller is not None and row.pending_depth is None:
                depth = row.controller.choose(_left(row))
                if depth:
                    row.pending_depth, go_on = depth, False
        return go_on

    def final_cache(self, row: RowState) -> list:
        """A one-row copy of the row's cache holding exactly its prompt and every token it
        emitted, a stop token included — the cache mlx-lm's BatchGenerator hands back when a
        request finishes (or extracts from a running one).  Accepted drafts past a stop are cut;
        a pending bonus is fed.  The batch's own cache is left as it is."""
        slot = next(i for i, r in enumerate(self.rows) if r is row)
        cache = caches.select_rows(self.cache, [slot])
        return self.decoder.cache_at(cache, self.bonus[slot : slot + 1], row.cache_length)


def _left(row: RowState) -> int:
    """Tokens the row may still emit (its max_tokens; a stop may come sooner)."""
    return row.request.max_tokens - len(row.generated)


def _select(keep: list[int], total: int, bonus, hidden, cache):
    if len(keep) == total:
        return bonus, hidden, cache
    index = mx.array(keep, dtype=mx.int32)
    return bonus[index], hidden[index], caches.select_rows(cache, keep)
