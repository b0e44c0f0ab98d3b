"""``omlx-mtp bench``: plain decoding vs MTP vs an oracle drafter, in one process, same weights.

Method (DESIGN §7): warm-up first, then runs alternate plain / MTP / oracle per repeat and the
median tokens/s of each is reported with its ratio to plain.  Component costs (one plain step,
one verify of K+1 positions, one draft step) give the speedup bound
E[tokens per round] / (t_verify(K+1) / t_decode + K * t_draft / t_decode) and achieved/bound.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from ..decode import cache as caches
from ..decode.linear_state import LinearStateCache
from ..decode.requests import DecodeStats, Request
from ..decode.loop import SpeculativeDecoder
from ..decode.sampling import SamplingParams
from ..drafters.oracle import OracleDrafter, ScriptedAccuracyDecoder
from .session import NO_DRAFT, Session, placed, regime, rotated, run_mtp, run_plain


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def component_costs(session: Session, prompt: list[int], K: int, batch: int = 1, temp: float = 0.0,
                    repeats: int = 20) -> dict:
    """Milliseconds for one verify of K+1 positions and one draft step, for ``batch`` rows; the
    draft step the loop runs at ``temp`` (an assistant's sampled step draws from, and returns, its
    distribution; a head with its own cache is timed by its one step, whatever the temperature)."""
    target = session.target
    cache = target.make_cache(batch, slack=max(len(prompt), K + 1))
    hidden = target.hidden(mx.array([prompt] * batch), cache)
    caches.advance(cache, len(prompt))
    mx.eval(hidden)
    length = caches.lengths_of(cache)[0]

    def forward(n):
        def run():
            logits, h = target.forward(mx.zeros((batch, n), dtype=mx.int32), cache)
            mx.eval(logits, h)
            caches.commit(cache, [length] * batch)
        return run

    costs = {"verify_ms": _median_ms(forward(K + 1), repeats)}
    decoder = session.decoder
    if session.drafter is not None and hasattr(session.drafter, "visible_span"):
        position, context = decoder.draft_context(cache)
        token, h_prev = mx.zeros((batch, 1), dtype=mx.int32), hidden[:, -1:]

        if temp > 0:
            sampling = (mx.full((batch, 1), temp, dtype=mx.float32), mx.zeros((batch,), dtype=mx.bool_),
                        mx.random.key(0))

            def draft():  # one sampled draft step, compiled as the loop runs it
                mx.eval(*decoder.sampled_step(False)(token, h_prev, position, *sampling, *context))
        else:
            def draft():  # one greedy draft step, compiled as the loop runs it
                mx.eval(*decoder.greedy_step(False)(token, h_prev, position, *context))

        costs["draft_ms"] = _median_ms(draft, repeats)
    elif session.drafter is not None and hasattr(session.drafter, "make_cache"):  # a head with its own K/V
        own = session.drafter.make_cache(batch, slack=len(prompt) + K + 1)
        for table in caches.tables_of(own):
            table.start_at([length] * batch)
        token, h_prev = mx.zeros((batch, 1), dtype=mx.int32), hidden[:, -1:]

        def draft():  # one draft step, taken back
            mx.eval(*session.drafter.step(target, token, h_prev, own))
            caches.commit(own, [length] * batch)

        costs["draft_ms"] = _median_ms(draft, repeats)
    if any(isinstance(c, LinearStateCache) for c in cache):
        def verify_and_take_back():  # the worst case: one of K + 1 positions kept
            logits, h = target.forward(mx.zeros((batch, K + 1), dtype=mx.int32), cache)
            mx.eval(logits, h)
            saved = [list(c.cache) if isinstance(c, LinearStateCache) else None for c in cache]
            caches.commit(cache, [length + 1] * batch)
            mx.eval([c.state for c in cache])
            for c, state in zip(cache, saved):
                if state is not None:
                    c.cache = state
            for table in caches.tables_of(cache):
                table.commit([length] * batch)

        costs["rollback_ms"] = max(_median_ms(verify_and_take_back, repeats) - costs["verify_ms"], 0.0)
    return costs


def speedup_bound(tokens_per_round: float, K: int, costs: dict, draft_ms: float) -> float:
    return tokens_per_round / (costs["verify_ms"] / costs["decode_ms"] + K * draft_ms / costs["decode_ms"])


def benchmark(session: Session, prompts: list[list[int]], draft_tokens: list, max_tokens: int = 128,
              repeats: int = 3, temps=(0.0,), say=print, batches=(1,), peer=None, accuracies=()) -> list[dict]:
    """``peer``: a loaded mlx-vlm pair (``omlx_mtp.peer``) to run beside ours at batch 1, fixed depths.
    ``accuracies``: also run the drafter with its drafts right at each of these rates
    (``ScriptedAccuracyDecoder``; greedy rows), engines named ``drafts@a``."""
    results = []
    stop = session.stop_tokens()
    continuation = {}
    for prompt in prompts:  # warm-up, and the oracle's (greedy) continuation
        continuation[tuple(prompt)] = run_plain(session.model, Request(prompt, max_tokens=max_tokens,
                                                                       stop_tokens=stop)).row.generated
    for temp in temps:
        requests = [Request(p, SamplingParams(temperature=temp), max_tokens, stop) for p in prompts]
        for K in draft_tokens:
            for batch in batches:
                scripted = {f"drafts@{a:g}": a for a in accuracies} if temp == 0 and session.drafter else {}
                if batch == 1:
                    results += _bench_depth(session, requests, K, temp, continuation, repeats, say,
                                            peer if K != "auto" else None, scripted)
                else:
                    rows = [requests[i % len(requests)] for i in range(batch)]
                    results += _bench_batch(session, rows, K, temp, continuation, repeats, say, scripted)
    return results


def _decoders(session: Session, K, continuation: dict, scripted: dict) -> dict:
    """The drafting engines: name -> decoder (each kept for all repeats, so its compiled draft
    steps are reused as a server's are)."""
    kwargs = dict(draft_tokens=K, query_offset=session.decoder.query_offset,
                  max_draft_tokens=session.decoder.max_draft_tokens, ranks=session.ranks)
    out = {"mtp": SpeculativeDecoder(session.target, session.drafter, **kwargs),
           "oracle": SpeculativeDecoder(session.target, OracleDrafter(continuation, session.target.vocab_size),
                                        draft_tokens=K, ranks=session.ranks)}
    for name, accuracy in scripted.items():
        out[name] = ScriptedAccuracyDecoder(session.target, session.drafter, continuation, accuracy, **kwargs)
    return out


def _paired_ratio(values: list[float], baseline: list[float]) -> float:
    """The median over repeats of an engine's speed over the baseline's in the same pass: runs of
    one pass sit seconds apart, so a machine whose speed wanders (other work, clocks) moves both."""
    return statistics.median(v / b if b else 0.0 for v, b in zip(values, baseline))


def _with_bounds(entries: list[dict], costs: dict, K, samples: dict) -> None:
    """Ratios to plain and to no-draft for every entry, from paired runs (``samples``: engine ->
    tokens per second per pass); the speedup bound and achieved/bound for drafting engines at a
    fixed depth (an oracle's drafts cost nothing; every other engine pays the drafter's)."""
    for entry in entries:
        runs = samples[entry["engine"]]
        entry["speedup_vs_plain"] = _paired_ratio(runs, samples["plain"])
        entry["speedup_vs_no_draft"] = _paired_ratio(runs, samples[NO_DRAFT])
        if K == "auto" or entry["engine"] in (*BASELINES, PEER) or "tokens_per_round" not in entry:
            continue
        if entry["speedup_vs_no_draft"] > 0:
            # What a round at this depth costs in the no-draft loop's plain steps: the t(k) that
            # auto weighs against a round's tokens.
            entry["round_plain_steps"] = entry["tokens_per_round"] / entry["speedup_vs_no_draft"]
        if not costs.get("decode_ms"):  # no decode time: every request ended at its first token
            continue
        draft_ms = 0.0 if entry["engine"] == "oracle" else costs.get("draft_ms", 0.0)
        bound = speedup_bound(entry["tokens_per_round"], K, costs, draft_ms)
        entry.update(speedup_bound=bound, achieved_over_bound=entry["speedup_vs_plain"] / bound)


PEER = "mlx-vlm"
BASELINES = ("plain", NO_DRAFT)  # engines that never draft


def _entry(name: str, temp: float, K, batch: int, tps: float) -> dict:
    """One result, as the JSON's ``results`` list carries it (ratios: ``_with_bounds``)."""
    return {"engine": name, "temp": temp, "draft_tokens": 0 if name in BASELINES else K, "batch": batch,
            "tokens_per_second": tps}


def _run_peer(peer, request, temp, K, seed) -> dict:
    from .peer import peer_generate

    return peer_generate(peer, list(request.prompt), request.max_tokens, temp, K, seed,
                         stop_tokens=request.stop_tokens)


def _peer_rates(runs: list[dict]) -> dict:
    """mlx-vlm's acceptance and tokens per round over all its runs, counted like DecodeStats.pooled."""
    stats = DecodeStats(rounds=sum(r["rounds"] for r in runs), drafted=sum(r["drafted"] for r in runs),
                        accepted=sum(r["accepted"] for r in runs),
                        emitted=sum(len(r["tokens"]) - 1 for r in runs if r["rounds"]))
    return {"acceptance_rate": stats.acceptance_rate, "tokens_per_round": stats.tokens_per_round}


def _bench_batch(session, requests, K, temp, continuation, repeats, say, scripted=None) -> list[dict]:
    """Several requests at once, the way a server runs them: mlx-lm's own BatchGenerator (plain)
    against MTP behind the same API (omlx_mtp.host.batch_generator).  Decode speed: the tokens
    after every request's first, over the time after it (prefill is the same work for all)."""
    import importlib

    from ..hosts.batch_generator import MTPBatchGenerator

    mlx_generate = importlib.import_module("mlx_lm.generate")
    stops = [[t] for t in session.stop_tokens()] or None

    def plain():
        return mlx_generate.BatchGenerator(session.model, stop_tokens=stops, completion_batch_size=len(requests))

    def mtp(decoder):
        def make():
            return MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=session.model, stop_tokens=stops,
                                     completion_batch_size=len(requests))
        return make

    factories = {"plain": plain, NO_DRAFT: mtp(SpeculativeDecoder(session.target, None, draft_tokens=0))}
    factories.update({name: mtp(d) for name, d in _decoders(session, K, continuation, scripted or {}).items()})
    speeds = {name: [] for name in factories}
    outputs, stats = {}, {}
    for repeat in range(repeats + 1):  # the first pass warms up
        for name, factory in rotated(list(factories.items()), repeat):
            mx.random.seed(repeat)
            tokens, tps, generator = _drive(factory(), requests)
            if repeat:
                speeds[name].append(tps)
            outputs[name] = tokens
            if isinstance(generator, MTPBatchGenerator):
                stats[name] = generator.totals
        if temp == 0:
            assert all(out == outputs["plain"] for out in outputs.values()), "greedy MTP left plain decoding"
    plain_tps = statistics.median(speeds["plain"])
    results = []
    for name, values in speeds.items():
        entry = _entry(name, temp, K, len(requests), statistics.median(values))
        if name in stats and name not in BASELINES:
            entry.update(_what_it_did(stats[name]))
        results.append(entry)
    costs = component_costs(session, list(requests[0].prompt), K, len(requests), temp) if K != "auto" else {}
    costs["decode_ms"] = 1000 * len(requests) / plain_tps if plain_tps else 0.0  # one step of the batch, mlx-lm's
    _with_bounds(results, costs, K, speeds)
    for entry in results:
        entry.update(costs)
        say(_row(entry))
    return results


def _drive(generator, requests):
    """All requests inserted at once, stepped to the end: (tokens per request, decode tokens per
    second after every request's first token, generator)."""
    from ..hosts.batch_generator import MTPBatchGenerator

    kwargs = dict(max_tokens=[r.max_tokens for r in requests])
    if isinstance(generator, MTPBatchGenerator):
        kwargs["sampling_params"] = [r.params for r in requests]
    else:
        kwargs["samplers"] = [r.params.mlx_sampler() for r in requests]
    uids = generator.insert([list(r.prompt) for r in requests], **kwargs)
    tokens = {uid: [] for uid in uids}
    done, started, before = set(), None, 0
    while len(done) < len(uids):
        for response in generator.next_generated():
            if response.finish_reason == "stop":
                done.add(response.uid)
            else:
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    done.add(response.uid)
        if started is None and all(tokens[u] or u in done for u in uids):
            started, before = time.perf_counter(), sum(len(t) for t in tokens.values())
    seconds = time.perf_counter() - started if started is not None else 0.0
    after = sum(len(t) for t in tokens.values()) - before
    return [tokens[u] for u in uids], after / seconds if seconds > 0 else 0.0, generator


def _bench_depth(session, requests, K, temp, continuation, repeats, say, peer=None, scripted=None) -> list[dict]:
    # "no-draft": this package's own loop with no drafts (compiled forward, pipelined plain steps),
    # which tells the gain of compiling apart from the gain of drafting.
    drafting = _decoders(session, K, continuation, scripted or {})
    engines = {"plain": [], NO_DRAFT: [], **{name: [] for name in drafting}}
    stats = {name: [] for name in drafting}
    if peer is not None:
        engines[PEER], peer_stats = [], []
    runs = [(NO_DRAFT, session.decoder, 0)] + [(name, decoder, K) for name, decoder in drafting.items()]
    for index, request in enumerate(requests):
        for _, decoder, depth in runs:  # warm-up at this depth
            run_mtp(decoder, request, seed=0, draft_tokens=depth)
        if peer is not None:
            _run_peer(peer, request, temp, K, seed=0)
        for repeat in range(repeats):
            outputs = {}
            for name, decoder, depth in rotated([("plain", None, 0)] + runs, index * repeats + repeat):
                if decoder is None:
                    out = run_plain(session.model, request, seed=repeat)
                else:
                    out = run_mtp(decoder, request, seed=repeat, draft_tokens=depth)
                outputs[name] = out.row.generated
                engines[name].append(out.tokens_per_second)
                if name in stats:
                    stats[name].append(out.row.stats)
            if temp == 0:
                for name, tokens in outputs.items():
                    assert tokens == outputs["plain"], f"greedy {name} left plain decoding"
            if peer is not None:
                out = _run_peer(peer, request, temp, K, seed=repeat)
                if temp == 0:
                    assert out["tokens"] == outputs["plain"], "greedy mlx-vlm MTP left plain decoding"
                engines[PEER].append((len(out["tokens"]) - 1) / out["seconds"] if out["seconds"] > 0 else 0.0)
                peer_stats.append(out)
    plain_tps = statistics.median(engines["plain"])
    costs = component_costs(session, list(requests[0].prompt), K, temp=temp) if K != "auto" else {}
    costs["decode_ms"] = 1000 / plain_tps if plain_tps else 0.0  # t_decode is a plain mlx-lm step
    results = []
    for name, values in engines.items():
        entry = _entry(name, temp, K, 1, statistics.median(values))
        if name == PEER:
            entry.update(_peer_rates(peer_stats))
        if name in stats:
            pooled = DecodeStats.pooled(stats[name])
            entry.update(_what_it_did(pooled))
        results.append(entry)
    _with_bounds(results, costs, K, engines)
    for entry in results:
        entry.update(costs)
        say(_row(entry))
    return results


def _row(e: dict) -> str:
    line = (f"{e['engine']:<11} T={e['temp']:<4} K={e['draft_tokens']!s:<4} B={e['batch']:<2} "
            f"{e['tokens_per_second']:8.1f} tok/s"
            f"  x{e['speedup_vs_plain']:.2f}")
    if "speedup_vs_no_draft" in e and e["engine"] not in BASELINES:
        line += f" (x{e['speedup_vs_no_draft']:.2f} no-draft)"
    if "acceptance_rate" in e:
        line += f"  accept {e['acceptance_rate']:.0%}  {e['tokens_per_round']:.2f} tok/round"
    if "round_plain_steps" in e:
        line += f"  round {e['round_plain_steps']:.2f} steps"
    if "speedup_bound" in e:
        line += f"  bound x{e['speedup_bound']:.2f}  achieved/bound {e['achieved_over_bound']:.2f}"
    if e.get("draft_tokens") == "auto" and "plain_share" in e:
        line += f"  plain {e['plain_share']:.0%} of rounds, {e['probes']} probes"
    return line


def _what_it_did(stats: DecodeStats) -> dict:
    """Acceptance, and (for auto) how its rounds split between drafting and plain steps."""
    counted = stats.as_dict()
    return {**{key: counted[key] for key in ("acceptance_rate", "tokens_per_round", "probes", "depths")},
            "plain_share": stats.plain_steps / stats.rounds if stats.rounds else 0.0}


def bench_prompts(session: Session, prompt_tokens: int) -> list[list[int]]:
    """Code prompts when the model has a tokenizer (the demo pair knows Python), else random ids."""
    from ..fixtures.demo import PROMPTS

    if session.tokenizer is not None:
        return [session.encode(text) for text in PROMPTS]
    key = mx.random.key(0)
    return [mx.random.randint(3, session.target.vocab_size, (prompt_tokens,), key=k).tolist()
            for k in mx.random.split(key, 2)]


def query_position_acceptance(session: Session, prompts, K: int, max_tokens: int, say=print) -> list[dict]:
    """Greedy acceptance with the drafter's query at the bonus position N and at N - 1."""
    out = []
    for name, offset in (("bonus (N)", 0), ("last (N-1)", -1)):
        decoder = SpeculativeDecoder(session.target, session.drafter, draft_tokens=K, query_offset=offset)
        rows = decoder.generate([Request(p, max_tokens=max_tokens, stop_tokens=session.stop_tokens()) for p in prompts])
        pooled = DecodeStats.pooled(r.stats for r in rows)
        entry = {"engine": "mtp", "query_position": name, "temp": 0.0, "draft_tokens": K, "batch": len(prompts),
                 "acceptance_rate": pooled.acceptance_rate, "tokens_per_round": pooled.tokens_per_round}
        say(f"query at {name:<11} K={K}: acceptance {entry['acceptance_rate']:.1%}, "
            f"{entry['tokens_per_round']:.2f} tokens/round")
        out.append(entry)
    return out


def run_bench(model=None, drafter=None, draft_tokens=(1, 2, 3, 4), max_tokens=128, repeats=3,
              prompt_tokens=64, json_out=None, compare_query_positions=False, synthetic=None,
              synthetic_layers=2, dtype="bfloat16", temps=(0.0,), batches=(1,), plot=None, accuracies=(),
              target_bits=None, head_bits=None, sharding=None) -> int:
    if plot:
        _pyplot()  # refuse before a long run, not after it
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-bench-") as tmp:
        session, label, peer, peer_note = _bench_session(Path(tmp), model, drafter, synthetic, synthetic_layers,
                                                         dtype, target_bits, head_bits, sharding)
        ranks = session.ranks
        if ranks is not None and ranks.rank != 0:  # every rank runs the bench in step; rank 0 reports
            sys.stdout = open(os.devnull, "w")
        print(f"omlx-mtp bench — {label}")
        if ranks is not None:
            print(f"ranks: {ranks.size} ({session.target.sharding} sharding, mx.distributed)")
        print(f"regime: {regime()}, dtype {session.target.dtype}{_scaled(synthetic, synthetic_layers)}")
        print(f"mlx-vlm MTP: {'mlx-vlm ' + peer.version if peer is not None else 'not run: ' + peer_note}")
        prompts = bench_prompts(session, prompt_tokens)
        results = benchmark(session, prompts, list(draft_tokens), max_tokens=max_tokens, repeats=repeats,
                            temps=temps, batches=batches, peer=peer, accuracies=accuracies)
        if compare_query_positions:
            fixed = [k for k in draft_tokens if k != "auto"] or [3]
            results += query_position_acceptance(session, prompts, max(fixed), max_tokens)
        if ranks is not None and ranks.rounds:
            each = ranks.seconds / ranks.rounds
            plain = next((r["tokens_per_second"] for r in results if r.get("engine") == "plain"
                          and r.get("tokens_per_second")), None)
            versus = f" ({each * plain:.2f}x a plain step of {1e3 / plain:.2f} ms)" if plain else ""
            print(f"rank check: {ranks.rounds} collectives, {1e3 * each:.2f} ms each{versus}")
            results.append({"engine": "rank-check", "collectives": ranks.rounds, "seconds": ranks.seconds,
                            "ranks": ranks.size, "sharding": session.target.sharding})
    if json_out and (ranks is None or ranks.rank == 0):
        Path(json_out).write_text(json.dumps({"regime": regime(), "model": label, "results": results}, indent=2))
        print(f"wrote {json_out}")
    if plot:
        plot_speedups(results, plot, f"{label}\n{regime()}")
        print(f"wrote {plot}")
    return 0


def _scaled(synthetic, layers) -> str:
    """What a synthetic model scaled down from its release (layers, routed experts), for the regime line."""
    from ..fixtures.synthetic import scale_note

    note = scale_note(synthetic, layers) if synthetic else ""
    return f", {note}" if note else ""


def _bench_session(tmp: Path, model, drafter, synthetic, synthetic_layers, dtype, target_bits, head_bits,
                   sharding=None):
    """(session, label, loaded mlx-vlm peer or None, why the peer is not run)."""
    from ..fixtures.demo import demo_pair
    from .peer import peer_available, prepare_peer

    peer, peer_note = None, peer_available()
    if synthetic is not None:
        from ..fixtures.synthetic import synthetic_pair

        sharding, ranks = placed(sharding)  # under mlx.launch every rank builds the same pair, then splits it
        target, assistant = synthetic_pair(synthetic, synthetic_layers, dtype, target_bits, head_bits, sharding)
        label = f"{synthetic} ({synthetic_layers} target layers, random weights, {dtype}"
        label += f", target {target_bits}-bit" if target_bits else ""
        label += f", assistant head {head_bits}-bit)" if head_bits else ")"
        why = peer_note or "a synthetic pair has no checkpoint for mlx-vlm to load"
        return Session(target, None, assistant, ranks=ranks), label, None, why
    if model is None:
        model, drafter, label = demo_pair(tmp / "pair")
    else:
        label = f"{model} + {drafter}"
    session = Session.load(model, drafter, sharding=sharding)
    if peer_note is None and not session.target.family.startswith("Gemma 4"):
        peer_note = f"the peer is run on Gemma 4 pairs only, not {session.target.family}"
    if peer_note is None:
        peer = prepare_peer(model, drafter, tmp / "peer")
    return session, label, peer, peer_note


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import MTPError

        raise MTPError("bench --plot needs matplotlib: pip install 'omlx-mtp[plot]'") from None
    return plt


def plot_speedups(results: list[dict], path, title: str) -> None:
    """Speedup over plain against draft tokens, one line per (engine, temperature, batch)."""
    plt = _pyplot()
    lines: dict = {}
    for e in results:
        if e["engine"] not in BASELINES and isinstance(e["draft_tokens"], int) and "query_position" not in e:
            lines.setdefault((e["engine"], e["temp"], e["batch"]), []).append((e["draft_tokens"], e["speedup_vs_plain"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (engine, temp, batch), points in sorted(lines.items()):
        points.sort()
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o",
                linestyle="-" if engine == "mtp" else "--", label=f"{engine} T={temp} batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("draft tokens per round")
    ax.set_ylabel("speedup over plain decoding")
    import textwrap

    ax.set_title("\n".join(textwrap.fill(line, 90) for line in title.splitlines()), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
