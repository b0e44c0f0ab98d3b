"""omlx-mtp command line: generate and demo."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import MTPError

QUERY_POSITIONS = {"bonus": 0, "last": -1}


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-tokens", type=int, default=3, help="drafts per round (K)")
    parser.add_argument(
        "--query-position",
        choices=sorted(QUERY_POSITIONS),
        default="bonus",
        help="drafter query position: the bonus token's (N, default) or the last cached one (N-1)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omlx-mtp", description="Lossless MTP speculative decoding for oMLX/mlx-lm")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with (or without) MTP")
    gen.add_argument("--model", required=True, help="target checkpoint directory")
    gen.add_argument("--drafter", help="drafter checkpoint directory (Gemma 4 assistant)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--no-mtp", action="store_true", help="plain decoding")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling(gen)

    demo = sub.add_parser("demo", help="run the embedded demo pair with MTP off and on")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--draft-tokens", type=int, default=3)
    demo.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="plain vs MTP vs oracle drafter, same process and weights")
    bench.add_argument("--model", help="target checkpoint (default: the embedded tiny pair)")
    bench.add_argument("--drafter", help="drafter checkpoint (with --model)")
    bench.add_argument("--draft-tokens", default="1,2,3,4", help="comma-separated depths")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--json", dest="json_out", help="write results to this JSON file")
    return parser


def _sampling_params(args):
    from .decode.sampling import SamplingParams

    if args.temp < 0 or not 0 <= args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise MTPError("sampling options out of range: --temp >= 0, 0 <= --top-p <= 1, --top-k >= 0, 0 <= --min-p <= 1")
    if args.draft_tokens < 0 or args.draft_tokens > 16:
        raise MTPError("--draft-tokens must be between 0 and 16")
    return SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )


def cmd_generate(args) -> int:
    from .decode.loop import Request
    from .runner import Session

    params = _sampling_params(args)
    if args.max_tokens < 1:
        raise MTPError("--max-tokens must be at least 1")
    session = Session.load(
        args.model,
        None if args.no_mtp else args.drafter,
        draft_tokens=args.draft_tokens,
        query_offset=QUERY_POSITIONS[args.query_position],
    )
    prompt = session.encode(args.prompt, chat=args.chat)
    request = Request(prompt, params, args.max_tokens, session.stop_tokens())
    outcome = session.run(request, mtp=not args.no_mtp, seed=args.seed)
    result = outcome.as_dict(session.tokenizer)
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        summary = f"[{result['generated_tokens']} tokens, {result['tokens_per_second']:.1f} tok/s"
        if result["mtp"]:
            summary += (
                f", MTP: {result['acceptance_rate']:.0%} of {result['drafted']} drafts accepted,"
                f" {result['tokens_per_round']:.2f} tokens/round"
            )
        print(summary + "]", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(max_tokens=args.max_tokens, draft_tokens=args.draft_tokens, as_json=args.json)


def cmd_bench(args) -> int:
    from .bench import run_bench

    if (args.model is None) != (args.drafter is None):
        raise MTPError("bench: pass both --model and --drafter, or neither (embedded pair)")
    try:
        depths = [int(k) for k in args.draft_tokens.split(",")]
    except ValueError:
        raise MTPError(f"--draft-tokens: expected comma-separated integers, got {args.draft_tokens!r}") from None
    return run_bench(args.model, args.drafter, depths, args.max_tokens, args.repeats, args.prompt_tokens,
                     args.json_out)


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "bench": cmd_bench}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MTPError as exc:
        print(f"omlx-mtp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
