"""The speculative loop for a batch of requests, each row accepting its own number of drafts.

State between rounds, per row: committed tokens in the target cache (``lengths``), the
*bonus* token (sampled by the target, not yet in the cache) and the target's final-normed
hidden state at the position that produced it.  One round:

1. the drafter proposes K tokens from (bonus, hidden), reading the target's committed K/V;
2. the target verifies [bonus, d1..dK] in one forward (K+1 positions), logits processors
   seeing the drafts before each position;
3. acceptance keeps n drafts per row and yields the next bonus;
4. caches keep the n+1 new positions; the hidden state at the last kept one is carried on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx

from .acceptance import accept_greedy, accept_sampled
from .adaptive import DepthController
from . import cache as caches
from .sampling import SamplingParams, draft_probs, log_softmax, target_probs
from .target import Gemma4Target

QUERY_AT_BONUS = 0  # drafter query at the bonus token's position N (HF transformers)
QUERY_AT_LAST = -1  # at N - 1, the position of the hidden state (vLLM, mlx-vlm)


@dataclass
class DecodeStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @classmethod
    def pooled(cls, many) -> "DecodeStats":
        """The stats of several requests (or runs) added together."""
        many = list(many)
        return cls(*(sum(getattr(s, f) for s in many) for f in ("rounds", "drafted", "accepted", "emitted")))

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
        }


@dataclass
class Request:
    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_tokens: frozenset = frozenset()


@dataclass
class RowState:
    request: Request
    processors: list
    history: mx.array  # prompt + emitted tokens (bonus included) for logits processors
    generated: list = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)

    def emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or max_tokens; return what was appended."""
        out = []
        for token in tokens:
            if token in self.request.stop_tokens:
                self.finish_reason = "stop"
                break
            out.append(token)
            if len(self.generated) + len(out) >= self.request.max_tokens:
                self.finish_reason = "length"
                break
        self.generated.extend(out)
        return out


class SpeculativeDecoder:
    def __init__(
        self,
        target: Gemma4Target,
        drafter,
        draft_tokens: int | str = 3,
        query_offset: int = QUERY_AT_BONUS,
        prefill_step: int = 512,
        max_draft_tokens: int = 8,
        min_acceptance: float = 0.0,
    ):
        """draft_tokens: a fixed depth, or "auto" (chosen per round by a DepthController from the
        measured acceptance and round cost, up to max_draft_tokens; plain decoding when MTP would
        not gain, or when acceptance falls below min_acceptance)."""
        self.target = target
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens
        self.min_acceptance = min_acceptance
        self.query_offset = query_offset
        self.prefill_step = prefill_step
        self.drafter_kinds = sorted(set(getattr(drafter, "layer_types", [])))
        self._compiled_greedy = self._compiled_sampled = None

    # -- public ---------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], seed: int | None = None, draft_tokens: int | str | None = None):
        rows = None
        for rows, _ in self.stream(requests, seed=seed, draft_tokens=draft_tokens):
            pass
        return rows

    def stream(self, requests: Sequence[Request], seed: int | None = None,
               draft_tokens: int | str | None = None) -> Iterator:
        """Yield (rows, new tokens per row) after the first token and after every round."""
        depth = self.draft_tokens if draft_tokens is None else draft_tokens
        controller = None
        if depth == "auto":
            controller = DepthController(self.max_draft_tokens, self.min_acceptance)
            depth = self.max_draft_tokens
        K_max = 0 if self.drafter is None else int(depth)
        key = mx.random.key(seed if seed is not None else time.time_ns() % (2**31))
        rows = [
            RowState(r, r.params.processors(), mx.array(list(r.prompt), dtype=mx.int32)) for r in requests
        ]
        cache, hidden, logits = self._prefill([list(r.prompt) for r in requests], slack=K_max + 1)
        key, sub = mx.random.split(key)
        bonus = self._first_tokens(rows, logits, sub)
        first = bonus.tolist()
        new = []
        for row, token in zip(rows, first):
            row.history = mx.concatenate([row.history, mx.array([token], dtype=mx.int32)])
            new.append(row.emit([token]))
        yield rows, new
        active = [i for i, row in enumerate(rows) if row.finish_reason is None]
        bonus, hidden, cache = _select(active, len(rows), bonus, hidden, cache)
        while active:
            remaining = max(rows[i].request.max_tokens - len(rows[i].generated) for i in active)
            chosen = controller.choose() if controller is not None else K_max
            K = max(0, min(chosen, K_max, remaining - 1))
            key, sub = mx.random.split(key)
            live = [rows[i] for i in active]
            started = time.perf_counter()
            drafts, n, bonus, hidden = self._round(live, cache, bonus, hidden, K, sub)
            drafts_host, n_host, bonus_host = drafts.tolist(), n.tolist(), bonus.tolist()
            if controller is not None:
                controller.observe(K, n_host, time.perf_counter() - started)
            new = [[] for _ in rows]
            lengths = []
            for slot, (i, row) in enumerate(zip(active, live)):
                kept = drafts_host[slot][: n_host[slot]] + [bonus_host[slot]]
                row.stats.rounds += 1
                row.stats.drafted += K
                row.stats.accepted += n_host[slot]
                new[i] = row.emit(kept)
                row.stats.emitted += len(new[i])
                if row.processors:
                    row.history = mx.concatenate([row.history, mx.array(kept, dtype=mx.int32)])
                lengths.append(cache[0].lengths[slot] + n_host[slot] + 1)
            caches.commit(cache, lengths)
            yield rows, new
            still = [slot for slot, i in enumerate(active) if rows[i].finish_reason is None]
            if len(still) != len(active):
                bonus, hidden, cache = _select(still, len(active), bonus, hidden, cache)
                active = [active[slot] for slot in still]

    # -- steps ----------------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]], slack: int):
        """Prefill each distinct prompt once; rows with the same prompt share the result."""
        distinct: dict[tuple, int] = {}
        for prompt in prompts:
            distinct.setdefault(tuple(prompt), len(distinct))
        done = [self._prefill_one(list(p), slack) for p in distinct]
        pick = [distinct[tuple(p)] for p in prompts]
        cache = caches.stack_caches([done[j][0] for j in pick]) if len(pick) > 1 else done[0][0]
        hidden = mx.concatenate([done[j][1] for j in pick], axis=0)
        logits = mx.concatenate([done[j][2] for j in pick], axis=0)
        return cache, hidden, logits

    def _prefill_one(self, prompt: list[int], slack: int):
        if not prompt:
            raise ValueError("empty prompt")
        step = self.prefill_step
        cache = self.target.make_cache(1, slack=max(slack, step))
        tokens = mx.array(prompt, dtype=mx.int32)[None]
        for start in range(0, len(prompt), step):
            chunk = tokens[:, start : start + step]
            last = start + step >= len(prompt)
            hidden = self.target.body(chunk, cache=cache)
            caches.advance(cache, chunk.shape[1])
            if not last:
                mx.eval([c.state for c in cache])
        hidden = hidden[:, -1:]
        logits = self.target.head(hidden)
        caches.shrink_slack(cache, slack)
        mx.eval(hidden, logits, [c.state for c in cache])
        return cache, hidden, logits

    def _first_tokens(self, rows: list[RowState], logits: mx.array, key) -> mx.array:
        logits = logits[:, -1]
        logits = self._process(rows, logits[:, None], lambda r, i: rows[r].history)[:, 0]
        return self._sample_rows(rows, logits, key)

    def _sample_rows(self, rows, logits, key) -> mx.array:
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        sampled = [i for i, row in enumerate(rows) if not row.request.params.greedy]
        if sampled:
            probs = self._target_distribution(rows, logits[:, None])[:, 0]
            draws = mx.random.categorical(mx.log(probs), key=key).astype(mx.int32)
            is_sampled = mx.array([not row.request.params.greedy for row in rows])
            tokens = mx.where(is_sampled, draws, tokens)
        return tokens

    def _round(self, rows: list[RowState], cache, bonus, hidden, K: int, key):
        draft_key, accept_key = mx.random.split(key)
        if hasattr(self.drafter, "propose"):  # a drafter that brings its own proposal step
            drafts, q = self.drafter.propose(rows, K, draft_key)
        else:
            drafts, q = self._draft(rows, cache, bonus, hidden, K, draft_key)
        verify = mx.concatenate([bonus[:, None], drafts], axis=1)
        logits, verify_hidden = self.target.forward(verify, cache)
        logits = self._process(rows, logits, lambda r, i: mx.concatenate([rows[r].history, drafts[r, :i]]))
        greedy = [row.request.params.greedy for row in rows]
        if all(greedy):
            n, nxt = accept_greedy(drafts, mx.argmax(logits, axis=-1).astype(mx.int32))
        else:
            p = self._target_distribution(rows, logits)
            n, nxt = accept_sampled(drafts, q, p, accept_key)
            if any(greedy):
                n_g, nxt_g = accept_greedy(drafts, mx.argmax(logits, axis=-1).astype(mx.int32))
                is_greedy = mx.array(greedy)
                n, nxt = mx.where(is_greedy, n_g, n), mx.where(is_greedy, nxt_g, nxt)
        new_hidden = mx.take_along_axis(verify_hidden, n[:, None, None], axis=1)
        mx.eval(drafts, n, nxt, new_hidden)
        return drafts, n, nxt, new_hidden

    def _draft(self, rows, cache, bonus, hidden, K: int, key):
        B = bonus.shape[0]
        if K == 0:
            return mx.zeros((B, 0), dtype=mx.int32), mx.zeros((B, 0, self.target.vocab_size), dtype=mx.float32)
        shared_kv, masks = {}, {}
        for kind in self.drafter_kinds:
            source = self.target.kv_source(cache, kind)
            span = self.drafter.visible_span(kind, self.target.sliding_window)
            shared_kv[kind] = source.state
            masks[kind] = source.table.visible(span)[:, None, None, :]
        lengths = cache[0].lengths
        if all(n == lengths[0] for n in lengths):
            query_position = mx.array(lengths[0] + self.query_offset, dtype=mx.int32)
        else:
            query_position = mx.array(lengths, dtype=mx.int32) + self.query_offset
        temps = [row.request.params.temperature for row in rows]
        sampled = any(t > 0 for t in temps)
        temp = mx.array([t if t > 0 else 1.0 for t in temps], dtype=mx.float32)[:, None]
        is_greedy = mx.array([t <= 0 for t in temps])
        context = [a for kind in self.drafter_kinds for a in (*shared_kv[kind], masks[kind])]
        token, h = bonus[:, None], hidden
        drafts, qs = [], []
        for step_key in mx.random.split(key, K):
            if sampled:
                best, q, h = self._sampled_step(token, h, query_position, temp, is_greedy, step_key, *context)
                qs.append(q)
            else:
                best, h = self._greedy_step(token, h, query_position, *context)
            drafts.append(best)
            token = best[:, None]
        q = mx.stack(qs, axis=1) if sampled else None
        return mx.stack(drafts, axis=1), q

    # One draft step, compiled: a small drafter is dispatch-bound, and fusing its many small ops
    # roughly halves a step's cost.  Shapes change rarely (batch size, K/V length), so recompiles do too.
    def _drafter_logits(self, token, h, position, context):
        kinds = self.drafter_kinds
        shared_kv = {kind: (context[3 * i], context[3 * i + 1]) for i, kind in enumerate(kinds)}
        masks = {kind: context[3 * i + 2] for i, kind in enumerate(kinds)}
        logits, h = self.drafter(self.target.input_embedding(token), h, shared_kv, masks, position)
        return logits[:, -1], h

    @property
    def _greedy_step(self):
        if self._compiled_greedy is None:
            def step(token, h, position, *context):
                logits, h = self._drafter_logits(token, h, position, context)
                return mx.argmax(logits, axis=-1).astype(mx.int32), h

            self._compiled_greedy = mx.compile(step)
        return self._compiled_greedy

    @property
    def _sampled_step(self):
        if self._compiled_sampled is None:
            def step(token, h, position, temp, is_greedy, key, *context):
                logits, h = self._drafter_logits(token, h, position, context)
                q = draft_probs(logits, temp)
                draw = mx.random.categorical(mx.log(q), key=key).astype(mx.int32)
                return mx.where(is_greedy, mx.argmax(logits, axis=-1).astype(mx.int32), draw), q, h

            self._compiled_sampled = mx.compile(step)
        return self._compiled_sampled

    def _process(self, rows, logits: mx.array, history_at) -> mx.array:
        """Apply each row's logits processors at every position; history_at(row, i) is the
        token history position i's logits follow (mlx-lm's ``tokens`` argument)."""
        if not any(row.processors for row in rows):
            return logits
        out = []
        for r, row in enumerate(rows):
            if not row.processors:
                out.append(logits[r])
                continue
            positions = []
            for i in range(logits.shape[1]):
                value = logits[r, i][None]
                history = history_at(r, i)
                for processor in row.processors:
                    value = processor(history, value)
                positions.append(value[0])
            out.append(mx.stack(positions))
        return mx.stack(out)

    def _target_distribution(self, rows, logits: mx.array) -> mx.array:
        """[B, L, V] -> per-row target probabilities (temp > 0 rows; greedy rows get T=1)."""
        first = rows[0].request.params
        if not first.greedy and all(row.request.params == first for row in rows):
            return target_probs(logits, first)
        out = []
        for r, row in enumerate(rows):
            params = row.request.params
            if params.greedy:
                out.append(mx.softmax(log_softmax(logits[r]), axis=-1))
            else:
                out.append(target_probs(logits[r], params))
        return mx.stack(out)


def _select(keep: list[int], total: int, bonus, hidden, cache):
    if len(keep) == total:
        return bonus, hidden, cache
    index = mx.array(keep, dtype=mx.int32)
    return bonus[index], hidden[index], caches.select_rows(cache, keep)
