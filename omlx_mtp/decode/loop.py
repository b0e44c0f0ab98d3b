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

from collections import OrderedDict
from contextlib import nullcontext
from functools import partial
from typing import Iterator, Sequence

import mlx.core as mx

from .acceptance import (accept_greedy, accept_greedy_graph, accept_sampled, accept_sampled_graph, allowed_drafts,
                         kept_hidden)
from .controller import AcceptanceMemory, RoundCosts, context_bucket
from .compiled_forward import TraceCache
from . import cache as caches
from .sampling import SamplingParams, draft_probs, log_softmax, target_probs
from .target import PromptEmbeddings, TargetModel, prefill_on_host
from .mlx_lm_caches import from_mlx_lm, to_mlx_lm
from .batch import LiveBatch
from .requests import Request, RowState

QUERY_AT_BONUS = 0  # drafter query at the bonus token's position N (HF transformers)
QUERY_AT_LAST = -1  # at N - 1, the position of the hidden state (vLLM, mlx-vlm)


class SpeculativeDecoder:
    def __init__(
        self,
        target: TargetModel,
        drafter,
        draft_tokens: int | str = 3,
        query_offset: int = QUERY_AT_BONUS,
        prefill_step: int = 512,
        max_draft_tokens: int = 8,
        min_acceptance: float = 0.0,
        ranks=None,
    ):
        """draft_tokens: a fixed depth, or "auto" (chosen per request and round by a DepthController
        from the measured acceptance and round cost, up to max_draft_tokens; plain decoding when MTP
        would not gain, or when acceptance falls below min_acceptance).  ranks: a ``RankGroup``
        when the target is sharded over ``mx.distributed``: every round's decisions are compared
        across ranks, and rank 0's round times are the ones every rank's controllers observe."""
        self.ranks = ranks
        self.target = target
        self.drafter = drafter
        self.draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens
        self.min_acceptance = min_acceptance
        self.query_offset = query_offset
        self.prefill_step = prefill_step
        self.drafter_kinds = sorted(set(getattr(drafter, "layer_types", [])))
        # A drafter with its own K/V (a built-in MTP head) keeps it after the target's caches in
        # one list, at the same lengths, so joins, leaves and commits move both together.
        self.own_cache = drafter is not None and hasattr(drafter, "make_cache")
        self.target_caches = len(target.make_cache(1, slack=1))
        self._trace_caches: OrderedDict = OrderedDict()  # name -> TraceCache (draft steps, acceptance)
        self._retired_traces = 0
        self.batch_controllers: dict = {}  # (batch size, max depth) -> DepthController, for auto
        self._round_costs: dict = {}  # (batch size, max depth, context bucket) -> RoundCosts
        self._acceptance: dict = {}  # sampling kind -> AcceptanceMemory, shared by its requests
        self.mask_drafts = True  # rows under a grammar draft only what it allows
        self.timeline: list | None = None  # a list to keep every round in (``batch.Round``), for profiling

    # -- public ---------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], seed: int | None = None, draft_tokens: int | str | None = None):
        rows = None
        for rows, _ in self.stream(requests, seed=seed, draft_tokens=draft_tokens):
            pass
        return rows

    def stream(self, requests: Sequence[Request], seed: int | None = None,
               draft_tokens: int | str | None = None) -> Iterator:
        """Yield (rows, new tokens per row) after the first token and after every round."""
        batch = self.batch(draft_tokens, seed)
        rows = [batch.new_row(r) for r in requests]
        cache, hidden, logits = self._prefill(requests, slack=batch.max_depth + 1)
        yield rows, batch.start(rows, cache, hidden, logits)
        index = {id(row): i for i, row in enumerate(rows)}
        while batch.rows:
            new = [[] for _ in rows]
            for row, tokens in zip(batch.rows, batch.round()):
                new[index[id(row)]] = tokens
            yield rows, new
            batch.retire([row for row in batch.rows if row.finish_reason is not None])

    def batch(self, draft_tokens: int | str | None = None, seed: int | None = None) -> LiveBatch:
        """An empty batch that rows can join; draft_tokens defaults to the decoder's."""
        return LiveBatch(self, self.draft_tokens if draft_tokens is None else draft_tokens, seed)

    def round_costs(self, batch_size: int, max_depth: int, context: int = 0) -> RoundCosts:
        """What rounds cost at this batch size and context length (tokens; ``context_bucket``), as
        measured so far: a property of the model and the machine, so every request (and its
        controller) shares it.  A batch size or length not seen yet starts from the nearest one
        measured (a batch whose rows finish one by one passes through every smaller size)."""
        key = (batch_size, max_depth, context_bucket(context))
        costs = self._round_costs.get(key)
        if costs is None:
            near = [k for k in self._round_costs if k[1] == max_depth]
            nearest = min(near, key=lambda k: (abs(k[0] - batch_size), abs(k[2] - key[2])), default=None)
            costs = self._round_costs[nearest].carried() if nearest else RoundCosts()
            self._round_costs[key] = costs
        return costs

    def acceptance_memory(self, params: SamplingParams) -> AcceptanceMemory:
        """Recent acceptance of requests drawn like ``params`` (greedy, or one sampled distribution):
        a new request's controller starts from it."""
        kind = "greedy" if params.greedy else params.distribution_key
        return self._acceptance.setdefault(kind, AcceptanceMemory())

    # -- steps ----------------------------------------------------------------------------
    def _prefill(self, requests: Sequence[Request], slack: int):
        """Prefill each distinct prompt once; rows with the same prompt (and embeddings) share the result."""
        keys = [(tuple(r.prompt), id(r.embeddings)) for r in requests]
        firsts: dict[tuple, Request] = {}
        for key, request in zip(keys, requests):
            firsts.setdefault(key, request)
        index = {key: i for i, key in enumerate(firsts)}
        done = [self.prefill_one(list(r.prompt), slack, embeddings=r.embeddings) for r in firsts.values()]
        pick = [index[key] for key in keys]
        cache = caches.stack_caches([done[j][0] for j in pick]) if len(pick) > 1 else done[0][0]
        hidden = mx.concatenate([done[j][1] for j in pick], axis=0)
        logits = mx.concatenate([done[j][2] for j in pick], axis=0)
        return cache, hidden, logits

    def prefill_one(self, prompt: list[int], slack: int, cache=None, embeddings: PromptEmbeddings | None = None,
                     previous: mx.array | None = None):
        """Run the prompt through the target (into ``cache`` when given, which must have room for
        a chunk: ``prefill_slack``); returns the cache with ``slack``, last hidden and logits.
        ``previous``: the hidden state before the prompt, where an earlier ``prefill_part`` left
        it.  A prompt with ``embeddings`` (images, audio) is prefilled by the host's own model, as
        oMLX does, and its caches are taken over before the last token."""
        if not prompt:
            raise ValueError("empty prompt")
        if embeddings is not None:
            host = prefill_on_host(self.target.plain_model(), prompt, embeddings)
            cache, prompt = self.from_host(host, self.prefill_slack(slack), embeddings.rope_shift), prompt[-1:]
        if cache is None:
            cache = self.make_cache(1, slack=self.prefill_slack(slack))
        hidden = self.prefill_part(prompt, cache, previous)
        logits = self.target.head(hidden)
        caches.shrink_slack(cache, slack)
        with self._watched():
            mx.eval(hidden, logits, [c.state for c in cache])
        return cache, hidden, logits

    def prefill_part(self, tokens: list[int], cache: list, previous: mx.array | None = None,
                     settle: bool = False) -> mx.array:
        """Part of a prompt into ``cache`` (room for a chunk: ``prefill_slack``), chunk by chunk;
        returns the hidden state at its last position, the ``previous`` of the part after it.  A
        drafter with its own K/V is handed (hidden at t - 1, token at t) for every position, the
        first one's hidden state being ``previous`` (unknown where None: that entry is hidden).
        ``settle``: evaluate the last chunk too (the caller reads the cache next)."""
        step = self.prefill_step
        tokens = mx.array(tokens, dtype=mx.int32)[None]
        length = tokens.shape[1]
        for start in range(0, length, step):
            chunk = tokens[:, start : start + step]
            hidden = self.target.hidden(chunk, cache)
            if self.own_cache:
                before = hidden[:, :1] if previous is None else previous  # a stand-in when unknown
                self._absorb(cache, chunk, mx.concatenate([before, hidden[:, :-1]], axis=1), previous is None)
            previous = hidden[:, -1:]
            caches.advance(cache, chunk.shape[1])
            if start + step < length or settle:
                with self._watched():  # chunk by chunk: a lost rank ends this one, a long prompt does not
                    mx.eval(previous, [c.state for c in cache])
        return previous

    def _watched(self):
        """With a sharded target, work whose collectives a lost rank would leave waiting forever
        ends the process instead (``RankGroup.watch``); on one process, nothing."""
        return self.ranks.watch() if self.ranks is not None else nullcontext()

    def make_cache(self, batch_size: int, slack: int) -> list:
        cache = self.target.make_cache(batch_size, slack=slack)
        return cache + self.drafter.make_cache(batch_size, slack) if self.own_cache else cache

    def from_host(self, host_caches: list, slack: int, rope_shift: int = 0) -> list:
        """One request's host (mlx-lm) caches -> ours; a drafter's own cache starts at the same
        length with nothing in it (the host's prefill left no hidden states to fill it from).
        ``rope_shift``: the request's next RoPE position minus its token count (mRoPE after images)."""
        cache = from_mlx_lm(self.target, host_caches, slack)
        for table in caches.tables_of(cache):
            table.shifts = [rope_shift]
        if self.own_cache:
            own = self.drafter.make_cache(1, slack)
            for table in caches.tables_of(own):
                table.start_at(caches.lengths_of(cache))
            cache += own
        return cache

    def to_host(self, cache: list, row: int = 0) -> list:
        return to_mlx_lm(self.target, cache[: self.target_caches], row)

    def _absorb(self, cache: list, tokens: mx.array, hidden: mx.array, first_unknown: bool = False) -> None:
        """Hand the drafter the pairs (hidden[:, i] at t - 1, tokens[:, i] at t) for the positions
        the target writes in this forward (tokens [B, L], hidden [B, L, H]).  ``first_unknown``: the
        first pair's hidden state is a stand-in (the host prefilled what came before); its entry
        is made invisible."""
        if not self.own_cache:
            return
        own = cache[self.target_caches :]
        start = caches.lengths_of(own)[0]
        self.drafter.absorb(self.target, own, tokens, hidden)
        if first_unknown:
            for table in caches.tables_of(own):
                table.forget(start)

    def absorb_stretch(self, cache: list, fed: list) -> None:
        """A plain stretch's (token, hidden) pairs into the drafter's own cache in one forward, not
        one per step: a head's K/V at a position depend on that position's input alone, so one
        forward of the stretch writes what the steps would have, for the cost of about one step.
        Its tables are taken back to where the stretch began, then written and advanced a chunk at
        a time (a ring takes at most its slack in one forward)."""
        if not self.own_cache:
            return
        own = cache[self.target_caches :]
        tables = caches.tables_of(own)
        chunk = min((t.capacity - t.window for t in tables if t.capacity is not None), default=len(fed))
        caches.commit(own, [n - len(fed) for n in caches.lengths_of(own)])
        for start in range(0, len(fed), chunk):
            pairs = fed[start : start + chunk]
            self._absorb(cache, mx.concatenate([t for t, _ in pairs], axis=1),
                         mx.concatenate([h for _, h in pairs], axis=1))
            caches.advance(own, len(pairs))

    def cache_at(self, cache: list, pending: mx.array, length: int) -> list:
        """A one-row cache cut back to ``length`` tokens, or grown by feeding ``pending`` [1]
        (the token that follows its committed ones) when ``length`` is one more."""
        have = caches.lengths_of(cache)[0]
        fed = []
        if length == have + 1:
            fed.append(self.target.hidden(pending[:, None], cache))
            caches.advance(cache, 1)
        elif length <= have:
            caches.commit(cache, [length])
        else:
            raise ValueError(f"a cache of {have} tokens cannot reach {length}")
        # The hidden state too: a pipeline stage sends its output on, and gathers the last one, only
        # when that output is evaluated (its caches alone would leave the next stage waiting).
        with self._watched():
            mx.eval(fed, [c.state for c in cache])
        return cache

    def prefill_slack(self, slack: int) -> int:
        return max(slack, self.prefill_step)

    def sample_rows(self, rows, logits, key) -> mx.array:
        """[B, V] processed logits -> one token per row, as plain decoding would draw it."""
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        sampled = [i for i, row in enumerate(rows) if not row.request.params.greedy]
        if sampled:
            probs = self._target_distribution(rows, logits[:, None])[:, 0]
            draws = mx.random.categorical(mx.log(probs), key=key).astype(mx.int32)
            is_sampled = mx.array([not row.request.params.greedy for row in rows])
            tokens = mx.where(is_sampled, draws, tokens)
        return self._host_sampled(rows, logits, tokens)

    def _host_sampled(self, rows, logits, tokens) -> mx.array:
        """Rows with a host sampler take that sampler's draw (logits [B, V])."""
        own = [r for r, row in enumerate(rows) if row.sampler is not None]
        if not own:
            return tokens
        draws = {r: rows[r].sampler(log_softmax(logits[r : r + 1])).reshape(-1).astype(mx.int32) for r in own}
        return mx.concatenate([draws[r] if r in draws else tokens[r : r + 1] for r in range(len(rows))])

    def run_round(self, rows: list[RowState], cache, bonus, hidden, K: int, key, caps: list[int] | None = None):
        """One round at depth K; row r keeps at most caps[r] drafts.  Returns drafts, accepted
        counts, next bonus tokens, the hidden state at the last kept position, processed logits."""
        draft_key, accept_key = mx.random.split(key)
        if hasattr(self.drafter, "propose"):  # a drafter that brings its own proposal step
            drafts, q = self.drafter.propose(rows, K, draft_key)
        else:
            drafts, q = self._draft(rows, cache, bonus, hidden, K, draft_key)
        verify = mx.concatenate([bonus[:, None], drafts], axis=1)
        logits, verify_hidden = self.target.forward(verify, cache)
        self._absorb(cache, verify, mx.concatenate([hidden, verify_hidden[:, :-1]], axis=1))
        logits = self.process_logits(rows, logits, drafts, caps)
        n, nxt, new_hidden = self._accept(rows, drafts, q, logits, verify_hidden, accept_key,
                                          caps if caps is not None else [K] * len(rows))
        nxt = self._host_sampled(rows, logits[:, 0], nxt)  # such rows keep no drafts (caps 0)
        mx.eval(drafts, n, nxt, new_hidden)
        return drafts, n, nxt, new_hidden, logits

    def _accept(self, rows, drafts, q, logits, verify_hidden, key, caps: list[int]):
        """(accepted drafts [B], next token [B], verify hidden state at the last kept position)."""
        K = drafts.shape[1]
        params = [row.request.params for row in rows]
        caps_array = mx.array(caps, dtype=mx.int32)
        if K and all(p.greedy for p in params):
            graph = self._traced("accept-greedy", accept_greedy_graph)
            return graph(drafts, logits, verify_hidden, caps_array)
        first = params[0].distribution_key
        if K and not any(p.greedy for p in params) and all(p.distribution_key == first for p in params):
            graph = self._traced(("accept-sampled", first), partial(accept_sampled_graph, params[0]))
            return graph(drafts, q, logits, verify_hidden, key, caps_array)
        allowed = allowed_drafts(K, caps_array)
        greedy = [p.greedy for p in params]
        if all(greedy):  # K == 0
            n, nxt = accept_greedy(drafts, mx.argmax(logits, axis=-1).astype(mx.int32), allowed)
        else:
            n, nxt = accept_sampled(drafts, q, self._target_distribution(rows, logits), key, allowed)
            if any(greedy):
                n_g, nxt_g = accept_greedy(drafts, mx.argmax(logits, axis=-1).astype(mx.int32), allowed)
                is_greedy = mx.array(greedy)
                n, nxt = mx.where(is_greedy, n_g, n), mx.where(is_greedy, nxt_g, nxt)
        return n, nxt, kept_hidden(verify_hidden, n)

    def _draft(self, rows, cache, bonus, hidden, K: int, key):
        B = bonus.shape[0]
        if K == 0:
            return mx.zeros((B, 0), dtype=mx.int32), mx.zeros((B, 0, self.target.vocab_size), dtype=mx.float32)
        temps = [row.request.params.temperature for row in rows]
        sampled = any(t > 0 for t in temps)
        temp = mx.array([t if t > 0 else 1.0 for t in temps], dtype=mx.float32)[:, None]
        is_greedy = mx.array([t <= 0 for t in temps])
        # Rows under a grammar draft only what it allows: each step's mask follows the drafts
        # before it, so the step's draft is read back (one host sync per step).
        masked = self.mask_drafts and any(row.processors.grammars for row in rows)
        if self.own_cache:
            own = cache[self.target_caches :]
            start = list(caches.lengths_of(own))

            def step(token, h, step_key, mask):
                logits, h = self.drafter.step(self.target, token, h, own)
                caches.advance(own, 1)
                if mask is not None:
                    logits = masked_logits(logits, mask)
                if not sampled:
                    return mx.argmax(logits, axis=-1).astype(mx.int32), None, h
                return (*draw_draft(logits, temp, is_greedy, step_key), h)
        else:
            query_position, context = self.draft_context(cache)

            def step(token, h, step_key, mask):
                extra = () if mask is None else (mask,)
                if sampled:
                    return self.sampled_step(mask is not None)(
                        token, h, query_position, temp, is_greedy, step_key, *extra, *context)
                best, h = self.greedy_step(mask is not None)(token, h, query_position, *extra, *context)
                return best, None, h
        token, h = bonus[:, None], hidden
        drafts, qs, drafted = [], [], [[] for _ in rows]
        for step_key in mx.random.split(key, K):
            mask = self._draft_masks(rows, drafted) if masked else None
            best, q, h = step(token, h, step_key, mask)
            qs.append(q)
            drafts.append(best)
            token = best[:, None]
            if masked:
                for row_drafts, t in zip(drafted, best.tolist()):
                    row_drafts.append(t)
        if self.own_cache:
            caches.commit(own, start)  # what the draft steps wrote is taken back; the round writes the true pairs
        q = mx.stack(qs, axis=1) if sampled else None
        return mx.stack(drafts, axis=1), q

    def _draft_masks(self, rows, drafted: list[list[int]]) -> mx.array:
        """[B, V] additive masks for the next draft step: each grammar row's allowed tokens."""
        vocab = self.target.vocab_size
        masks = [row.processors.draft_mask(done, vocab) for row, done in zip(rows, drafted)]
        return mx.stack([m if m is not None else mx.zeros((vocab,)) for m in masks])

    def draft_context(self, cache) -> tuple[mx.array, list]:
        """What every draft step of a round reads: the query position, and per drafter layer
        type the target's K/V with the mask of the committed slots it may see."""
        context = []
        for kind in self.drafter_kinds:
            source = self.target.kv_source(cache, kind)
            span = self.drafter.visible_span(kind, self.target.sliding_window)
            context += [*source.state, source.table.visible(span)[:, None, None, :]]
        # a scalar while every row is at the same length, else one position per row
        query_position = mx.array(caches.tables_of(cache)[0].offset, dtype=mx.int32) + self.query_offset
        return query_position, context

    # One draft step, compiled: a small drafter is dispatch-bound, and fusing its many small ops
    # roughly halves a step's cost.  Shapes change rarely (batch size, K/V length), so recompiles do too.
    def _drafter_logits(self, token, h, position, context):
        kinds = self.drafter_kinds
        shared_kv = {kind: (context[3 * i], context[3 * i + 1]) for i, kind in enumerate(kinds)}
        masks = {kind: context[3 * i + 2] for i, kind in enumerate(kinds)}
        logits, h = self.drafter(self.target.input_embedding(token), h, shared_kv, masks, position)
        return logits[:, -1], h

    def greedy_step(self, masked: bool):
        def step(token, h, position, *context):
            mask, context = (context[0], context[1:]) if masked else (None, context)
            logits, h = self._drafter_logits(token, h, position, context)
            if mask is not None:
                logits = masked_logits(logits, mask)
            return mx.argmax(logits, axis=-1).astype(mx.int32), h

        return self._traced(("greedy-step", masked), step)

    def sampled_step(self, masked: bool):
        def step(token, h, position, temp, is_greedy, key, *context):
            mask, context = (context[0], context[1:]) if masked else (None, context)
            logits, h = self._drafter_logits(token, h, position, context)
            if mask is not None:
                logits = masked_logits(logits, mask)
            return (*draw_draft(logits, temp, is_greedy, key), h)

        return self._traced(("sampled-step", masked), step)

    max_trace_caches = 16  # draft steps, acceptance graphs (one per sampling distribution)

    def _traced(self, name, fn) -> TraceCache:
        """The decoder's compiled graph called ``name`` (``fn`` is compiled the first time only)."""
        cache = self._trace_caches.pop(name, None)
        if cache is None:
            cache = TraceCache(fn)
            while len(self._trace_caches) >= self.max_trace_caches:
                self._retired_traces += self._trace_caches.popitem(last=False)[1].made
        self._trace_caches[name] = cache
        return cache

    @property
    def traces_made(self) -> int:
        """Compiled graphs traced so far (target forwards, draft steps, acceptance): a round in
        which this grew paid for tracing, and its time says nothing about its depth."""
        forward = self.target.compiled.traces.made if self.target.compiled is not None else 0
        return forward + self._retired_traces + sum(c.made for c in self._trace_caches.values())

    def process_logits(self, rows, logits: mx.array, drafts: mx.array | None = None, caps=None) -> mx.array:
        """Apply each row's logits processors at every position it may keep (logits [B, L, V];
        position i follows the row's history and its first i drafts)."""
        if not any(row.processors for row in rows):
            return logits
        out = []
        for r, row in enumerate(rows):
            if not row.processors:
                out.append(logits[r])
                continue
            # A row held to one token per round keeps no draft: only its first position counts,
            # and processors must not see drafts that will be thrown away.
            keep = 1 if row.one_token_per_round else logits.shape[1] if caps is None else caps[r] + 1
            row_drafts = drafts[r] if drafts is not None else mx.zeros((0,), dtype=mx.int32)
            processed = row.processors.verify(row.history, row_drafts, logits[r, :keep])
            out.append(mx.concatenate([processed, logits[r, keep:]]) if keep < logits.shape[1] else processed)
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


def masked_logits(logits: mx.array, mask: mx.array) -> mx.array:
    """Drafter logits [B, V] plus a grammar's additive mask; a row left with nothing (a head that
    scores only some tokens, none of them allowed) keeps its own logits."""
    masked = logits + mask.astype(logits.dtype)
    empty = mx.max(masked, axis=-1, keepdims=True) == -mx.inf
    return mx.where(empty, logits, masked)


def draw_draft(logits: mx.array, temp: mx.array, is_greedy: mx.array, key) -> tuple[mx.array, mx.array]:
    """A draft per row from the drafter's logits [B, V] (argmax for greedy rows), and the
    distribution q it was drawn from."""
    q = draft_probs(logits, temp)
    draw = mx.random.categorical(mx.log(q), key=key).astype(mx.int32)
    return mx.where(is_greedy, mx.argmax(logits, axis=-1).astype(mx.int32), draw), q


