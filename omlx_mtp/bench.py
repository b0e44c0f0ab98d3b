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
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .decode import cache as caches
from .decode.loop import DecodeStats, Request, SpeculativeDecoder
from .decode.sampling import SamplingParams
from .decode.oracle import OracleDrafter
from .runner import Session, run_mtp, run_plain


def regime() -> str:
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "").lower() else "bundled BLAS"
    return f"{mx.default_device()}, {blas}"


def _median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def component_costs(session: Session, prompt: list[int], K: int) -> dict:
    """Milliseconds for one verify of K+1 positions and one draft step."""
    target = session.target
    cache = target.make_cache(1, slack=max(len(prompt), K + 1))
    hidden = target.body(mx.array([prompt]), cache=cache)
    caches.advance(cache, len(prompt))
    mx.eval(hidden)
    length = cache[0].lengths[0]

    def forward(n):
        def run():
            logits, h = target.forward(mx.zeros((1, n), dtype=mx.int32), cache)
            mx.eval(logits, h)
            caches.commit(cache, [length])
        return run

    costs = {"verify_ms": _median_ms(forward(K + 1))}
    drafter = session.drafter
    if drafter is not None and hasattr(drafter, "visible_span"):
        kinds = sorted(set(drafter.layer_types))
        kv = {k: target.kv_source(cache, k).state for k in kinds}
        masks = {k: target.kv_source(cache, k).table.visible(drafter.visible_span(k, target.sliding_window))[:, None, None]
                 for k in kinds}
        token = mx.zeros((1, 1), dtype=mx.int32)
        h_prev = hidden[:, -1:]

        def draft():
            logits, h = drafter(target.input_embedding(token), h_prev, kv, masks, length)
            mx.eval(mx.argmax(logits, axis=-1), h)

        costs["draft_ms"] = _median_ms(draft)
    return costs


def speedup_bound(tokens_per_round: float, K: int, costs: dict, draft_ms: float) -> float:
    return tokens_per_round / (costs["verify_ms"] / costs["decode_ms"] + K * draft_ms / costs["decode_ms"])


def benchmark(session: Session, prompts: list[list[int]], draft_tokens: list, max_tokens: int = 128,
              repeats: int = 3, temps=(0.0,), say=print) -> list[dict]:
    results = []
    stop = session.stop_tokens()
    continuation = {}
    for prompt in prompts:  # warm-up, and the oracle's (greedy) continuation
        continuation[tuple(prompt)] = run_plain(session.model, Request(prompt, max_tokens=max_tokens,
                                                                       stop_tokens=stop)).row.generated
    for temp in temps:
        requests = [Request(p, SamplingParams(temperature=temp), max_tokens, stop) for p in prompts]
        for K in draft_tokens:
            results += _bench_depth(session, requests, K, temp, continuation, repeats, say)
    return results


def _bench_depth(session, requests, K, temp, continuation, repeats, say) -> list[dict]:
    oracle = SpeculativeDecoder(session.target, OracleDrafter(continuation, session.target.vocab_size), draft_tokens=K)
    engines = {"plain": [], "mtp": [], "oracle": []}
    stats = {"mtp": [], "oracle": []}
    for request in requests:
        run_mtp(session.decoder, request, seed=0, draft_tokens=K)  # warm-up at this depth
        for repeat in range(repeats):
            plain = run_plain(session.model, request, seed=repeat)
            engines["plain"].append(plain.tokens_per_second)
            for name, decoder in (("mtp", session.decoder), ("oracle", oracle)):
                out = run_mtp(decoder, request, seed=repeat, draft_tokens=K)
                if temp == 0:
                    assert out.row.generated == plain.row.generated, "greedy MTP left plain decoding"
                engines[name].append(out.tokens_per_second)
                stats[name].append(out.row.stats)
    plain_tps = statistics.median(engines["plain"])
    costs = component_costs(session, list(requests[0].prompt), K) if K != "auto" else {}
    costs["decode_ms"] = 1000 / plain_tps  # t_decode is a plain mlx-lm step
    results = []
    for name, values in engines.items():
        tps = statistics.median(values)
        entry = {"engine": name, "temp": temp, "draft_tokens": K if name != "plain" else 0, "batch": 1,
                 "tokens_per_second": tps, "speedup_vs_plain": tps / plain_tps}
        if name in stats:
            pooled = DecodeStats.pooled(stats[name])
            entry.update(acceptance_rate=pooled.acceptance_rate, tokens_per_round=pooled.tokens_per_round)
            if K != "auto":
                draft_ms = costs.get("draft_ms", 0.0) if name == "mtp" else 0.0
                bound = speedup_bound(entry["tokens_per_round"], K, costs, draft_ms)
                entry.update(speedup_bound=bound, achieved_over_bound=entry["speedup_vs_plain"] / bound)
        entry.update(costs)
        results.append(entry)
        say(_row(entry))
    return results


def _row(e: dict) -> str:
    line = (f"{e['engine']:<7} T={e['temp']:<4} K={e['draft_tokens']!s:<4} {e['tokens_per_second']:8.1f} tok/s"
            f"  x{e['speedup_vs_plain']:.2f}")
    if "acceptance_rate" in e:
        line += f"  accept {e['acceptance_rate']:.0%}  {e['tokens_per_round']:.2f} tok/round"
    if "speedup_bound" in e:
        line += f"  bound x{e['speedup_bound']:.2f}  achieved/bound {e['achieved_over_bound']:.2f}"
    return line


def bench_prompts(session: Session, prompt_tokens: int) -> list[list[int]]:
    """Code prompts when the model has a tokenizer (the demo pair knows Python), else random ids."""
    from .demo import PROMPTS

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
              synthetic_layers=2, dtype="bfloat16", temps=(0.0,)) -> int:
    from .demo import demo_pair

    if synthetic is not None:
        from .synthetic import synthetic_pair

        target, assistant = synthetic_pair(synthetic, synthetic_layers, dtype)
        session = Session(target, None, assistant)
        label = f"{synthetic} ({synthetic_layers} target layers, random weights, {dtype})"
    else:
        with tempfile.TemporaryDirectory(prefix="omlx-mtp-bench-") as tmp:
            if model is None:
                model, drafter, label = demo_pair(Path(tmp))
            else:
                label = f"{model} + {drafter}"
            session = Session.load(model, drafter)
    print(f"omlx-mtp bench — {label}")
    print(f"regime: {regime()}, dtype {session.target.dtype}")
    prompts = bench_prompts(session, prompt_tokens)
    results = benchmark(session, prompts, list(draft_tokens), max_tokens=max_tokens, repeats=repeats, temps=temps)
    if compare_query_positions:
        fixed = [k for k in draft_tokens if k != "auto"] or [3]
        results += query_position_acceptance(session, prompts, max(fixed), max_tokens)
    if json_out:
        Path(json_out).write_text(json.dumps({"regime": regime(), "model": label, "results": results}, indent=2))
        print(f"wrote {json_out}")
    return 0
