"""``omlx-mtp demo``: the embedded default pair, MTP off and on, side by side.

No trained pair ships yet, so the demo builds a tiny Gemma-4-shaped target and assistant with
RANDOM weights on the fly.  Their text is noise and the random assistant's drafts are almost
never accepted; what the demo shows is that MTP output equals plain output token for token,
and (with an oracle drafter that proposes the target's own continuation) what the loop gains
when drafts are right.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import mlx.core as mx

from .decode.loop import Request, SpeculativeDecoder
from .decode.oracle import OracleDrafter
from .runner import Session, run_mtp, run_plain
from .tiny import TinySpec, write_pair

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
DEMO_SPEC = TinySpec(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
                     global_head_dim=128, sliding_window=64, vocab_size=512, drafter_hidden=64)


def run_demo(max_tokens: int = 96, draft_tokens: int = 3, as_json: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-demo-") as tmp:
        target_dir, assistant_dir = write_pair(Path(tmp), DEMO_SPEC)
        session = Session.load(target_dir, assistant_dir, draft_tokens=draft_tokens)
    say = (lambda *a: None) if as_json else print
    say("omlx-mtp demo — embedded tiny Gemma 4 pair with RANDOM weights (text is noise; no trained pair ships yet)")
    say(f"device: {mx.default_device()}, draft tokens per round: {draft_tokens}\n")
    results = []
    for text in PROMPTS:
        prompt = session.encode(text)
        request = Request(prompt, max_tokens=max_tokens, stop_tokens=session.stop_tokens())
        run_plain(session.model, request)  # warm-up
        plain = run_plain(session.model, request)
        mtp = session.run(request, mtp=True)
        oracle = SpeculativeDecoder(
            session.target, OracleDrafter({tuple(prompt): plain.row.generated}, session.target.vocab_size),
            draft_tokens=draft_tokens,
        )
        perfect = run_mtp(oracle, request)
        same = plain.row.generated == mtp.row.generated == perfect.row.generated
        entry = {
            "prompt": text,
            "identical_at_T0": same,
            "plain_tokens_per_second": plain.tokens_per_second,
            "mtp": mtp.as_dict(session.tokenizer),
            "oracle": perfect.as_dict(session.tokenizer),
        }
        results.append(entry)
        say(f"prompt: {text!r}")
        say(f"  output: {session.tokenizer.decode(plain.row.generated)[:80]!r}")
        say(f"  MTP output identical to plain decoding: {same}")
        say(f"  plain            {plain.tokens_per_second:8.1f} tok/s")
        for name, run in (("MTP (random)", mtp), ("MTP (oracle)", perfect)):
            say(
                f"  {name:<16} {run.tokens_per_second:8.1f} tok/s  x{run.tokens_per_second / plain.tokens_per_second:.2f}"
                f"  acceptance {run.row.stats.acceptance_rate:.0%}, {run.row.stats.tokens_per_round:.2f} tokens/round"
            )
        say("")
    all_same = all(r["identical_at_T0"] for r in results)
    summary = {
        "weights": "random",
        "identical_at_T0": all_same,
        "median_speedup_random_drafter": statistics.median(
            r["mtp"]["tokens_per_second"] / r["plain_tokens_per_second"] for r in results
        ),
        "median_speedup_oracle_drafter": statistics.median(
            r["oracle"]["tokens_per_second"] / r["plain_tokens_per_second"] for r in results
        ),
        "prompts": results,
    }
    if as_json:
        print(json.dumps(summary))
    else:
        print(f"all outputs identical at T=0: {all_same}")
        print(f"median speedup: random drafter x{summary['median_speedup_random_drafter']:.2f}, "
              f"oracle drafter x{summary['median_speedup_oracle_drafter']:.2f}")
    return 0 if all_same else 1
