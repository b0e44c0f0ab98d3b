"""MTP rounds behind the part of mlx-lm's ``BatchGenerator`` API that oMLX's scheduler drives.

The scheduler keeps doing what it does with plain decoding: prefill a request outside, then
``insert`` it with its cache, per-request sampler, logits processors and stop-sequence machine;
call ``next_generated()`` once per step; ``remove`` finished or aborted uids; ``extract_cache``.
Here a step runs one speculative round for every running request, so a request may get several
responses (tokens) from one step, each exactly what plain decoding would have produced.

Requests keep their own acceptance and depth (``draft_tokens: auto`` falls back to plain rounds
per request).  Grammars and oMLX's thinking budget draft like any request: their state follows
the drafts through a verify and back (``decode.processors``).  A request whose sampling this loop
cannot reproduce as a distribution (no ``sampling_params``, XTC) or whose logits processors keep
state that can't be undone still runs here, one token per round, drawn by its own sampler.  A
request whose cache cannot be read (another cache type) goes to the host's own plain
``BatchGenerator`` instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any

import mlx.core as mx

from ..decode.requests import DecodeStats, Request
from ..decode.loop import SpeculativeDecoder

from ..decode.sampling import SamplingParams, log_softmax
from ..errors import MTPError
from .omlx.sparse_prefill import SparsePrefill, take_sparse_prefill
from .stats import CACHE, LOGITS_PROCESSOR, SAMPLER, MTPCounters

log = logging.getLogger("omlx_mtp")


class MTPBatchGenerator:
    wants_sampling_params = True  # the host may pass sampling_params=[...] to insert()

    def __init__(self, decoder: SpeculativeDecoder, plain_factory, *, model=None, max_tokens: int = 128,
                 stop_tokens=None, sampler=None, logits_processors=None, completion_batch_size: int = 32,
                 snapshot_interval: int = 0, counters: MTPCounters | None = None, **plain_kwargs):
        """``snapshot_interval``: the host's paged-cache block size when it snapshots running
        requests' caches at block boundaries (0: it does not); rows end their rounds there.
        ``counters``: the strategy's MTP counters, which outlive this generator (a host may make another)."""
        from mlx_lm.generate import GenerationBatch

        self.decoder = decoder
        self.snapshot_interval = snapshot_interval
        self.max_tokens = max_tokens
        self.default_stops = [tuple(s) for s in (stop_tokens or [])]
        self.default_processors = list(logits_processors or [])
        self.completion_batch_size = completion_batch_size
        self._plain_args = dict(model=model, max_tokens=max_tokens, stop_tokens=stop_tokens, sampler=sampler,
                                logits_processors=logits_processors,
                                completion_batch_size=completion_batch_size, **plain_kwargs)
        self._plain_factory = plain_factory
        self._plain = None  # the host's own BatchGenerator, made when a request needs it
        self._to_plain: dict[int, int] = {}
        self._from_plain: dict[int, int] = {}
        self.batch = decoder.batch()
        self._pending: deque = deque()
        self._uid_count = 0
        self._rows: dict[int, Any] = {}  # uid -> RowState of requests running here
        self._matches: dict[int, deque] = {}  # uid -> its stop-sequence machine's word on each token, to report
        self.totals = DecodeStats()  # all finished MTP requests together
        self.counters = counters if counters is not None else MTPCounters()
        self._serial = self.counters.generator_started()
        self._response_type = GenerationBatch.Response
        self._response_fields = {f.name for f in dataclasses.fields(GenerationBatch.Response)}

    # -- BatchGenerator API --------------------------------------------------------------------
    def insert(self, prompts, max_tokens=None, caches=None, all_tokens=None, samplers=None,
               logits_processors=None, state_machines=None, stop_sequences=None, sampling_params=None):
        # oMLX inserts a request right after SpecPrefill prefilled it sparsely and wrapped the
        # model's RoPE for it: the wrappers are taken now, before any other request is admitted.
        sparse = take_sparse_prefill(self._plain_args["model"], len(prompts))
        uids = []
        for i, prompt in enumerate(prompts):
            stops = state_machines[i] if state_machines else stop_sequences[i] if stop_sequences else None
            self._pending.append(_Pending(
                uid=self._uid_count, prompt=list(prompt),
                max_tokens=max_tokens[i] if max_tokens else self.max_tokens,
                cache=caches[i] if caches else None,
                all_tokens=list(all_tokens[i]) if all_tokens else [],
                sampler=samplers[i] if samplers else None,
                processors=list(logits_processors[i]) if logits_processors else list(self.default_processors),
                stops=stops, params=sampling_params[i] if sampling_params else None, sparse=sparse))
            uids.append(self._uid_count)
            self._uid_count += 1
        return uids

    def next_generated(self) -> list:
        responses = []
        if self._to_plain:
            for response in self._plain.next_generated():
                response.uid = self._from_plain[response.uid]
                responses.append(response)
        if self.batch.rows:
            rows = list(self.batch.rows)
            before = _counted(rows)
            for slot, (row, tokens) in enumerate(zip(rows, self.batch.round())):
                responses += self._responses(row, tokens, self.batch.logits, slot)
            self.counters.add(_counted(rows).minus(before))  # as rounds run: counters move mid-request
            self._retire([row for row in rows if row.finish_reason is not None])
        while self._pending and len(self.batch.rows) < self.completion_batch_size:
            responses += self._admit(self._pending.popleft())
        return responses

    def next(self):
        return [], self.next_generated()

    def remove(self, uids, return_prompt_caches=False):
        uids = set(uids)
        out = self.extract_cache(uids) if return_prompt_caches else {}
        for uid in uids:
            self._matches.pop(uid, None)
        self._pending = deque(p for p in self._pending if p.uid not in uids)
        self._retire([self._rows[uid] for uid in uids if uid in self._rows])
        plain = [self._to_plain.pop(uid) for uid in uids if uid in self._to_plain]
        if plain:
            self._plain.remove(plain)
            for uid in plain:
                self._from_plain.pop(uid)
        return out

    def extract_cache(self, uids) -> dict:
        """Caches of waiting and plain-run requests, and of requests running MTP rounds that sit
        exactly on a snapshot boundary (rounds end there).  Any other running request is left
        out: its cache is not at a token count the host files snapshots under, and hosts read a
        missing entry as "no snapshot now"."""
        out = {p.uid: (p.cache, p.all_tokens) for p in self._pending if p.uid in uids}
        for uid in uids:
            row = self._rows.get(uid)
            if row is not None and row.at_snapshot:
                out[uid] = self._snapshot(row)
        plain = [self._to_plain[uid] for uid in uids if uid in self._to_plain]
        if plain:
            for uid, value in self._plain.extract_cache(plain).items():
                out[self._from_plain[uid]] = value
        return out

    def _snapshot(self, row) -> tuple[list, list[int]]:
        """(host caches, tokens) as mlx-lm's extract_cache gives them for a running request: a copy
        of the row's committed cache with its pending bonus token fed, holding the prompt and
        every emitted token.  That count, ``row.num_tokens`` (prompt_length: the cache after
        prefill, i.e. the host's cache of all but the last prompt token plus that token), is
        oMLX's ``request.num_tokens`` (prompt + output tokens) at the response that triggers the
        snapshot, so the snapshot is filed under the count it holds."""
        cache = self.batch.final_cache(row)
        return self.decoder.to_host(cache), row.all_tokens

    def close(self):
        if self._plain is not None:
            self._plain.close()

    # -- requests -------------------------------------------------------------------------------
    def _admit(self, p: "_Pending") -> list:
        decoder, batch, sparse = self.decoder, self.batch, p.sparse
        try:
            cache = p.ours if p.ours is not None else self.own_cache_for(p)
        except MTPError as exc:
            log.info("omlx-mtp: request uid %d decodes plain: %s", p.uid, exc)
            sparse.put_back()  # the host's own loop positions it through the wrappers
            return self._insert_plain(p)
        params, sampler = _distribution(p.params, p.sampler)
        if hasattr(p.stops, "make_state"):
            self._matches[p.uid] = deque()
        row = batch.new_row(Request(p.all_tokens + p.prompt, params, p.max_tokens), p.processors, sampler=sampler,
                            matcher=_matcher(p.stops, self.default_stops, self._matches.get(p.uid)),
                            snapshot_interval=self.snapshot_interval)
        row.uid = p.uid
        self._count_admission(row)
        if sparse:
            row.sparse = True  # its cache holds fewer tokens than the request: no boundary snapshots
            log.info("omlx-mtp: request uid %d was prefilled sparsely (SpecPrefill): RoPE positions "
                     "shifted by %d", p.uid, sparse.adjustment)
        if row.processors.opaque:
            log.info("omlx-mtp: request uid %d takes one token per round: logits processor %s keeps state "
                     "that can't be rolled back", p.uid, type(row.processors.opaque[0]).__name__)
        cache, hidden, logits = decoder.prefill_one(p.prompt, batch.max_depth + 1, cache=cache, previous=p.previous)
        tokens = batch.start([row], cache, hidden, logits)[0]
        out = self._responses(row, tokens, batch.first_logits, 0)
        if row.finish_reason is None:
            self._rows[p.uid] = row
        else:  # done at its first token: it never joined the batch
            self._count_finished(row)
            first = mx.array([row.generated[0] if row.generated else row.stop_token])
            self._attach_cache(out[-1], row, decoder.cache_at(cache, first, row.cache_length))
        return out

    def own_cache_for(self, p: "_Pending") -> list:
        """This loop's cache for a request about to prefill: its host cache (a prompt-cache hit)
        taken over, or a new one.  MTPError where this loop can't hold the host's cache."""
        slack = self.decoder.prefill_slack(self.batch.max_depth + 1)
        shift = _rope_delta(self._plain_args["model"], p.uid) + p.sparse.adjustment  # SpecPrefill's, its own
        return self.decoder.from_host(p.cache, slack, shift) if p.cache else self.decoder.make_cache(1, slack)

    def _insert_plain(self, p: "_Pending") -> list:
        self.counters.fell_back(CACHE)
        if self._plain is None:
            self._plain = self._plain_factory(**self._plain_args)
        kwargs = dict(max_tokens=[p.max_tokens], caches=[p.cache] if p.cache else None, all_tokens=[p.all_tokens],
                      samplers=[p.sampler], logits_processors=[p.processors])
        if p.stops is not None:
            kwargs["state_machines" if hasattr(p.stops, "make_state") else "stop_sequences"] = [p.stops]
        # The host's loop numbers this request as this loop does: oMLX 0.6.2 keeps each request's
        # sampler and processors by (model, uid) and realigns every step of mlx-lm's loop from that
        # table, so a uid of the host loop's own count would run another request's sampler.
        if isinstance(getattr(self._plain, "_uid_count", None), int):
            self._plain._uid_count = p.uid
        (plain_uid,) = self._plain.insert([p.prompt], **kwargs)
        self._to_plain[p.uid], self._from_plain[plain_uid] = plain_uid, p.uid
        return []

    def _retire(self, rows) -> None:
        for row in rows:
            if self._rows.pop(row.uid, None) is not None:
                self._count_finished(row)
        self.batch.retire(rows)

    # -- the strategy's counters ------------------------------------------------------------------
    def _count_admission(self, row) -> None:
        """An MTP request, or one that decodes plain here (one token per round) and why."""
        reason = SAMPLER if row.sampler is not None else LOGITS_PROCESSOR if row.processors.opaque else None
        row.counted = reason is None  # only MTP requests' rounds go into the counters
        if reason is None:
            self.counters.admitted(self._serial)
        else:
            self.counters.fell_back(reason)

    def _count_finished(self, row) -> None:
        if row.counted:
            self.counters.finished(self._serial)

    def _responses(self, row, tokens: list[int], logits, slot: int) -> list:
        emitted = list(tokens) + ([row.stop_token] if row.stop_token is not None else [])
        out = [self._response(row.uid, token, log_softmax(logits[slot, i]), None) for i, token in enumerate(emitted)]
        self._report_matches(row, out)
        if row.finish_reason is not None and out:
            out[-1].finish_reason = row.finish_reason
            if row in self.batch.rows:
                self._attach_cache(out[-1], row, self.batch.final_cache(row))
        return out

    def _report_matches(self, row, responses: list) -> None:
        """Each response's ``match_sequence`` / ``current_state``, as mlx-lm's loop reports them from
        the request's ``SequenceStateMachine``: hosts read them to hold back and strip a stop
        sequence's text (oMLX 0.6.x), and for reasoning and tool-call states (mlx-lm's server).
        The row's matcher ran the machine on each emitted token (the stop included) and kept what
        it said, one entry per response here."""
        said = self._matches.get(row.uid)
        if said is None:
            return
        for response in responses:
            response.match_sequence, response.current_state = said.popleft()
        if row.finish_reason is not None:
            del self._matches[row.uid]

    def _attach_cache(self, response, row, cache) -> None:
        response.prompt_cache = self.decoder.to_host(cache)
        self.totals = DecodeStats.pooled([self.totals, row.stats])
        if "all_tokens" in self._response_fields:
            response.all_tokens = row.all_tokens
        log.info("omlx-mtp: request uid %d finished (%s): %d tokens in %d rounds, %d of %d drafts accepted",
                 row.uid, row.finish_reason, len(row.generated), row.stats.rounds, row.stats.accepted,
                 row.stats.drafted)

    def _response(self, uid, token, logprobs, finish_reason):
        values = dict(uid=uid, token=token, logprobs=logprobs, finish_reason=finish_reason, prompt_cache=None,
                      all_tokens=None, current_state=None, match_sequence=None)
        return self._response_type(**{k: v for k, v in values.items() if k in self._response_fields})


@dataclasses.dataclass
class _Pending:
    uid: int
    prompt: list
    max_tokens: int
    cache: Any
    all_tokens: list
    sampler: Any
    processors: list
    stops: Any
    params: Any
    sparse: SparsePrefill  # SpecPrefill's RoPE adjustment for this request (empty: none)
    ours: Any = None  # this loop's cache, already holding ``all_tokens`` (a prompt prefilled in segments)
    previous: Any = None  # ... and the hidden state at its last position


def _counted(rows) -> DecodeStats:
    """The pooled stats of the rows whose rounds go into the host's MTP counters."""
    return DecodeStats.pooled(row.stats for row in rows if row.counted)


def _distribution(host_params, sampler):
    """(our SamplingParams, None) when the host's sampling parameters name a distribution this
    loop can rebuild (temperature, top-p, min-p, top-k); else (greedy placeholder, the sampler)."""
    if host_params is None or getattr(host_params, "xtc_probability", 0.0) > 0:
        return SamplingParams(), sampler
    params = SamplingParams(temperature=float(host_params.temperature or 0.0),
                            top_p=float(getattr(host_params, "top_p", 0.0) or 0.0),
                            top_k=int(getattr(host_params, "top_k", 0) or 0),
                            min_p=float(getattr(host_params, "min_p", 0.0) or 0.0))
    return params, None


def _rope_delta(model, uid: int) -> int:
    """A request's mRoPE delta, as oMLX's VLM adapter keeps them by uid (registered after insert,
    so known by the time a request is admitted here); 0 for other hosts and models."""
    deltas = getattr(model, "_uid_rope_deltas", None) or {}
    return int(deltas.get(uid) or 0)


def _matcher(stops, default_stops, said: deque | None = None):
    """token -> True when a stop sequence just completed, for either mlx-lm's
    SequenceStateMachine (0.31) or StopSequences (0.32), or a list of token sequences.  ``said``:
    where a state machine's (match_sequence, current_state) for each token goes, for reporting."""
    if stops is None:
        sequences = [list(s) for s in default_stops]
        tail: list[int] = []
        longest = max((len(s) for s in sequences), default=0)

        def matches(token: int) -> bool:
            tail.append(token)
            del tail[:-longest or None]
            return any(tail[len(tail) - len(s):] == s for s in sequences if len(s) <= len(tail))

        return matches
    if hasattr(stops, "make_state"):
        state = [stops.make_state()]

        def matches(token: int) -> bool:
            state[0], sequence, current = stops.match(state[0], token)
            if said is not None:
                said.append((sequence, current))
            return sequence is not None and current is None

        return matches
    return stops.matcher().advance
