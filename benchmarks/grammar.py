"""Constrained output with MTP on the demo pair: tokens per round and speed, free vs grammar.

For each output kind (free text, a JSON schema, an EBNF tool call) and prompt: plain decoding,
MTP with the drafter masked by the grammar, and MTP with an unmasked drafter, alternated
(A B C A B C ...) after a warm-up; medians of tok/s, with acceptance and tokens per round.

    python benchmarks/grammar.py [--draft-tokens 3] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from omlx_mtp.decode.grammar import GrammarCompiler
from omlx_mtp.decode.requests import DecodeStats, Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.sampling import SamplingParams
from omlx_mtp.fixtures.demo import PAIR_DIR
from omlx_mtp.tools.session import Session, regime, run_mtp, run_plain

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", '    config = {"name": ']
FILE = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "count": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "kind": {"enum": ["file", "dir", "link"]}}}
TOOL_CALL = ('root ::= "{\\"name\\": \\"" ("read_file" | "list_dir") "\\", \\"arguments\\": {\\"path\\": \\"" '
             '[a-z/._]{1,24} "\\"}}"')


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    session = Session.load(PAIR_DIR / "target", PAIR_DIR / "assistant")
    compiler = GrammarCompiler(session.tokenizer, session.target.vocab_size)
    kinds = {"free": lambda: None, "json-schema": lambda: compiler.json_schema(FILE),
             "ebnf-tool-call": lambda: compiler.ebnf(TOOL_CALL)}
    decoders = {}
    for name, masked in (("mtp", True), ("mtp-unmasked-drafter", False)):
        decoders[name] = SpeculativeDecoder(session.target, session.drafter, draft_tokens=args.draft_tokens)
        decoders[name].mask_drafts = masked

    def request(prompt, make):
        processor = make()
        params = dataclasses.replace(SamplingParams(), logits_processors=(processor,) if processor else ())
        return Request(session.encode(prompt), params, args.max_tokens, session.stop_tokens())

    rows = []
    for kind, make in kinds.items():
        speeds = {name: [] for name in ["plain", *decoders]}
        stats = {name: [] for name in decoders}
        for prompt in PROMPTS:
            run_plain(session.model, request(prompt, make))  # warm-up
            for decoder in decoders.values():
                run_mtp(decoder, request(prompt, make))
            for _ in range(args.repeats):
                speeds["plain"].append(run_plain(session.model, request(prompt, make)).tokens_per_second)
                for name, decoder in decoders.items():
                    outcome = run_mtp(decoder, request(prompt, make))
                    speeds[name].append(outcome.tokens_per_second)
                    stats[name].append(outcome.row.stats)
        plain = statistics.median(speeds["plain"])
        for name in ["plain", *decoders]:
            row = {"output": kind, "engine": name, "tokens_per_second": round(statistics.median(speeds[name]), 1),
                   "speedup_vs_plain": round(statistics.median(speeds[name]) / plain, 2)}
            if name in stats:
                pooled = DecodeStats.pooled(stats[name])
                row.update(acceptance_rate=round(pooled.acceptance_rate, 3),
                           tokens_per_round=round(pooled.tokens_per_round, 2))
            rows.append(row)
    if args.json:
        print(json.dumps({"regime": regime(), "draft_tokens": args.draft_tokens, "rows": rows}, indent=1))
        return
    print(f"regime: {regime()}; demo pair fp32, K={args.draft_tokens}, {len(PROMPTS)} prompts x {args.repeats}")
    print(f"{'output':16}{'engine':22}{'tok/s':>8}{'x plain':>9}{'accepted':>10}{'tok/round':>11}")
    for r in rows:
        accepted = f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else ""
        per_round = f"{r['tokens_per_round']:.2f}" if "tokens_per_round" in r else ""
        print(f"{r['output']:16}{r['engine']:22}{r['tokens_per_second']:8.1f}{r['speedup_vs_plain']:9.2f}"
              f"{accepted:>10}{per_round:>11}")


if __name__ == "__main__":
    main()
