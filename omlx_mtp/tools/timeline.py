"""``omlx-mtp timeline``: where MTP's time goes against MTP off, round by round, on the same requests.

Both engines run this package's loop on the same requests, in a rotated order, a few times each:
MTP off (no drafts, pipelined plain stretches) and MTP as shipped (``auto``) or at a fixed depth.
Every round is kept (``SpeculativeDecoder.timeline``).  The difference in decode time is split
into its causes, each priced against MTP off's own seconds per plain step: drafting rounds and
probes (their seconds less what their tokens cost plainly), what a round right after a plain
stretch takes over its depth's usual round (switching from plain), plain stretches (slower per step
than MTP off's), rounds that traced a graph, and work between rounds.  A negative share is a gain.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from ..decode.requests import Request
from ..fixtures.demo import PROMPTS, demo_pair
from .session import Session, regime, rotated

CAUSES = ("drafting rounds", "probes", "switching from plain", "plain stretches", "tracing", "between rounds")


def _run(session: Session, groups: list[list[Request]], draft_tokens) -> tuple[float, list, int]:
    """Each group decoded together, one group after another: (decode seconds after each group's
    first tokens, rounds, tokens after the first)."""
    decoder = session.decoder
    seconds, rounds, tokens = 0.0, [], 0
    for requests in groups:
        decoder.timeline, first = [], None
        for _, new in decoder.stream(requests, draft_tokens=draft_tokens):
            if first is None:
                first, decoder.timeline = time.perf_counter(), []
                continue
            tokens += sum(len(t) for t in new)
        seconds += time.perf_counter() - first
        rounds += decoder.timeline
    decoder.timeline = None
    return seconds, rounds, tokens


def breakdown(seconds: float, rounds: list, plain_step: float) -> dict:
    """Seconds each cause added over MTP off (``plain_step``: its seconds per step of the batch).
    A drafting round right after a plain stretch is split: what it took over the median round of
    its depth and batch that followed another drafting round is the switch's (None to compare
    with: all of it stays with its round)."""
    out = dict.fromkeys(CAUSES, 0.0)
    steady = {}
    for before, r in zip([None, *rounds], rounds):
        if r.kind != "plain" and not r.traced and before is not None and before.kind != "plain":
            steady.setdefault((r.depth, r.rows), []).append(r.seconds)
    for before, r in zip([None, *rounds], rounds):
        took = r.seconds
        if r.traced:
            cause = "tracing"
        elif r.kind == "plain":
            cause = "plain stretches"
        else:
            cause = "probes" if r.kind == "probe" else "drafting rounds"
            usual = steady.get((r.depth, r.rows))
            if before is not None and before.kind == "plain" and usual:
                switch = max(took - statistics.median(usual), 0.0)
                out["switching from plain"] += switch
                took -= switch
        out[cause] += took - (r.tokens / r.rows) * plain_step  # tokens per row = plain steps saved
    out["between rounds"] = seconds - sum(r.seconds for r in rounds)
    return out


def run_timeline(model=None, drafter=None, draft_tokens="auto", batch: int = 1, max_tokens: int = 96,
                 repeats: int = 10, as_json: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-timeline-") as tmp:
        if model is None:
            model, drafter, label = *demo_pair(Path(tmp))[:2], "embedded demo pair"
        else:
            label = str(model)
        session = Session.load(model, drafter, draft_tokens="auto")
    requests = [Request(session.encode(PROMPTS[i % len(PROMPTS)]), max_tokens=max_tokens,
                        stop_tokens=session.stop_tokens()) for i in range(max(batch, len(PROMPTS)))]
    # one request at a time, or batches of ``batch`` requests decoding together
    requests = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    engines = {"off": 0, "mtp": draft_tokens}
    for name, depth in engines.items():  # warm-up: graphs traced once, as a running server has them
        _run(session, requests, depth)
    runs = {name: [] for name in engines}
    for repeat in range(repeats):
        for name, depth in rotated(list(engines.items()), repeat):
            runs[name].append(_run(session, requests, depth))
    off_seconds = statistics.median(s / max(t, 1) for s, _, t in runs["off"])  # per token, MTP off
    plain_step = off_seconds * batch  # MTP off's seconds per step of the batch
    added = {cause: statistics.median(breakdown(s, r, plain_step)[cause] / (t * off_seconds) for s, r, t in runs["mtp"])
             for cause in CAUSES}
    speedup = statistics.median((m[2] / m[0]) / (o[2] / o[0]) for o, m in zip(runs["off"], runs["mtp"]))
    kinds = {}
    for _, rounds, _ in runs["mtp"]:
        for r in rounds:
            entry = kinds.setdefault(r.kind, [0, 0])
            entry[0], entry[1] = entry[0] + r.steps, entry[1] + r.traced
    report = {"model": label, "regime": regime(), "draft_tokens": draft_tokens, "batch": batch,
              "mtp_over_off": speedup, "added_share_of_off_time": added,
              "rounds_per_run": {k: v[0] / repeats for k, v in kinds.items()},
              "traced_rounds_per_run": {k: v[1] / repeats for k, v in kinds.items()}}
    if as_json:
        print(json.dumps(report))
        return 0
    print(f"omlx-mtp timeline — {label}; regime: {report['regime']}; batch {batch}, {max_tokens} tokens, "
          f"MTP {draft_tokens} against MTP off, median of {repeats} rotated runs (on a machine whose speed "
          "swings, a share of a few percent is within its noise)")
    print(f"MTP speed over MTP off: x{report['mtp_over_off']:.2f}")
    print("time MTP added (+) or saved (-), as a share of MTP off's time:")
    for cause in CAUSES:
        print(f"  {cause:<20} {100 * added[cause]:+6.1f}%")
    print("rounds per run: " + ", ".join(f"{k} {v:g}" for k, v in report["rounds_per_run"].items())
          + " (plain: steps); traced: " + ", ".join(f"{k} {v:g}" for k, v in report["traced_rounds_per_run"].items()))
    return 0
