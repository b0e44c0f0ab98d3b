"""``omlx-mtp demo``: the embedded default pair, MTP off and on, side by side.

The default pair ships in the package (``omlx_mtp/demo_pair``): a small Gemma 4 target trained
on the Python standard library's sources and a Gemma 4 assistant distilled from it
(``scripts/train_demo_pair.py`` reproduces both).  Where it is missing, a tiny pair with RANDOM
weights is built on the fly instead and labelled so.  Beside plain decoding and MTP, an oracle
drafter that proposes the target's own continuation shows what the loop gains when every
draft is right.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from .decode.loop import Request, SpeculativeDecoder
from .decode.oracle import OracleDrafter
from .runner import Session, regime, run_mtp, run_plain
from .fixtures.tiny import TinySpec, write_pair

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", "    def __init__(self, name"]
DEMO_SPEC = TinySpec(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
                     global_head_dim=128, sliding_window=64, vocab_size=512, drafter_hidden=64)
PAIR_DIR = Path(__file__).resolve().parent / "demo_pair"


def demo_pair(scratch: Path) -> tuple[Path, Path, str]:
    """(target, assistant, description) of the embedded default pair."""
    if (PAIR_DIR / "target" / "config.json").is_file() and (PAIR_DIR / "assistant" / "config.json").is_file():
        return (PAIR_DIR / "target", PAIR_DIR / "assistant",
                "embedded demo pair: small Gemma 4 target trained on Python stdlib sources + distilled assistant")
    target, assistant = write_pair(scratch, DEMO_SPEC)
    return target, assistant, "embedded tiny Gemma 4 pair with RANDOM weights (text is noise; drafts are noise)"


QWEN_DIR = Path(__file__).resolve().parent / "demo_qwen"


def demo_qwen(scratch: Path) -> Path:
    """The embedded Qwen3.5 checkpoint with its built-in MTP head (``scripts/train_demo_qwen.py``
    trains it), or a tiny one with RANDOM weights where it is missing."""
    if (QWEN_DIR / "config.json").is_file():
        return QWEN_DIR
    from .fixtures.tiny_qwen import TinyQwenSpec, write_qwen

    return write_qwen(scratch, TinyQwenSpec())


def _median_run(outcomes):
    """The run of median speed (a machine's speed can swing between runs)."""
    return sorted(outcomes, key=lambda o: o.tokens_per_second)[len(outcomes) // 2]


def run_demo(max_tokens: int = 96, draft_tokens: int = 3, as_json: bool = False, repeats: int = 3) -> int:
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-demo-") as tmp:
        target_dir, assistant_dir, label = demo_pair(Path(tmp))
        session = Session.load(target_dir, assistant_dir, draft_tokens=draft_tokens)
    say = (lambda *a: None) if as_json else print
    say(f"omlx-mtp demo — {label}")
    say(f"regime: {regime()}, draft tokens per round: {draft_tokens}, median of {repeats} alternating runs\n")
    results = []
    for text in PROMPTS:
        prompt = session.encode(text)
        request = Request(prompt, max_tokens=max_tokens, stop_tokens=session.stop_tokens())
        reference = run_plain(session.model, request)  # warm-up; the oracle drafts this continuation
        oracle = SpeculativeDecoder(
            session.target, OracleDrafter({tuple(prompt): reference.row.generated}, session.target.vocab_size),
            draft_tokens=draft_tokens,
        )
        engines = {"plain": lambda: run_plain(session.model, request),
                   "mtp": lambda: session.run(request, mtp=True),
                   "oracle": lambda: run_mtp(oracle, request)}
        runs = {name: [] for name in engines}
        for repeat in range(repeats + 1):  # alternating runs; the first pass warms up (compiling)
            for name, engine in engines.items():
                outcome = engine()
                if repeat:
                    runs[name].append(outcome)
        plain, mtp, perfect = (_median_run(runs[name]) for name in engines)
        same = all(o.row.generated == reference.row.generated for name in runs for o in runs[name])
        entry = {
            "prompt": text,
            "identical_at_T0": same,
            "plain_tokens_per_second": plain.tokens_per_second,
            "mtp": mtp.as_dict(session.tokenizer),
            "oracle": perfect.as_dict(session.tokenizer),
        }
        results.append(entry)
        say(f"prompt: {text!r}")
        say(f"  output: {session.tokenizer.decode(plain.row.generated)[:160]!r}")
        say(f"  MTP output identical to plain decoding: {same}")
        say(f"  plain            {plain.tokens_per_second:8.1f} tok/s")
        for name, run in (("MTP", mtp), ("MTP (oracle)", perfect)):
            say(
                f"  {name:<16} {run.tokens_per_second:8.1f} tok/s  x{run.tokens_per_second / plain.tokens_per_second:.2f}"
                f"  acceptance {run.row.stats.acceptance_rate:.0%}, {run.row.stats.tokens_per_round:.2f} tokens/round"
            )
        say("")
    all_same = all(r["identical_at_T0"] for r in results)
    summary = {
        "pair": label,
        "identical_at_T0": all_same,
        "median_speedup_mtp": statistics.median(
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
        print(f"median speedup: MTP x{summary['median_speedup_mtp']:.2f}, "
              f"oracle drafter x{summary['median_speedup_oracle_drafter']:.2f}")
    return 0 if all_same else 1
