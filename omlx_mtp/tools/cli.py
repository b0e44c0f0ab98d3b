"""omlx-mtp command line: generate, demo, bench, quantize, add-mtp, inspect, settings, patch and serve."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..errors import MTPError
from .options import Range, check, check_args

QUERY_POSITIONS = {"bonus": 0, "last": -1}
MAX_DRAFT_TOKENS = 16
DEPTH = Range(0, MAX_DRAFT_TOKENS)  # a fixed --draft-tokens; 0 decodes without drafts
# Each command's numeric options, checked before anything loads (argparse checks types only).
SAMPLING_RANGES = {
    "max_tokens": Range(low=1),
    "temp": Range(low=0),
    "top_p": Range(0, 1),
    "top_k": Range(low=0),  # and below the vocabulary, checked once the model is loaded
    "min_p": Range(0, 1),
    "repetition_penalty": Range(above=0),  # mlx-lm divides by it
    "seed": Range(0, 2**64 - 1),  # mx.random.seed takes an unsigned 64-bit integer
    "max_draft_tokens": Range(1, MAX_DRAFT_TOKENS),
}
RANGES = {
    "generate": SAMPLING_RANGES,
    "demo": {"max_tokens": Range(low=1), "draft_tokens": DEPTH},
    "timeline": {"batch": Range(low=1), "max_tokens": Range(low=1), "repeats": Range(low=1)},
    "bench": {"max_tokens": Range(low=1), "prompt_tokens": Range(low=1), "repeats": Range(low=1),
              "synthetic_layers": Range(1, 128)},  # more layers than any release has only exhausts memory
    "quantize": {"shard_size_mb": Range(low=1)},
    "serve": {"port": Range(0, 65535)},
}


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-tokens", default="3", help="drafts per round (K), or 'auto'")
    parser.add_argument("--max-draft-tokens", type=int, default=8, help="largest depth for --draft-tokens auto")
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
    gen.add_argument("--drafter", help="drafter checkpoint directory (Gemma 4 assistant); "
                     "not needed for a checkpoint with a merged assistant")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for a multimodal checkpoint (repeat for several; the prompt is chat-templated)")
    gen.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema (xgrammar)")
    gen.add_argument("--grammar", metavar="FILE", help="constrain the output to this EBNF grammar (xgrammar)")
    gen.add_argument("--no-mtp", action="store_true", help="plain decoding")
    gen.add_argument("--sharding", choices=["auto", "pipeline", "tensor"], default=None,
                     help="under mlx.launch: how the target is split over the ranks (default: the model's choice)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    _add_sampling(gen)

    demo = sub.add_parser("demo", help="run the embedded demo pair: plain, MTP off, MTP (auto and a fixed depth)")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--draft-tokens", type=int, default=3, help="fixed depth shown beside auto")
    demo.add_argument("--json", action="store_true")

    tl = sub.add_parser("timeline", help="where MTP's decode time goes against MTP off, cause by cause")
    tl.add_argument("--model", help="target checkpoint (default: the embedded demo pair)")
    tl.add_argument("--drafter", help="drafter checkpoint (with --model)")
    tl.add_argument("--draft-tokens", default="auto", help="'auto' (default) or a fixed depth")
    tl.add_argument("--batch", type=int, default=1, help="requests decoding together")
    tl.add_argument("--max-tokens", type=int, default=96)
    tl.add_argument("--repeats", type=int, default=10)
    tl.add_argument("--json", action="store_true")

    quant = sub.add_parser("quantize", help="quantize a checkpoint, keeping its MTP weights")
    quant.add_argument("src", help="source checkpoint directory (Hugging Face or MLX layout)")
    quant.add_argument("out", help="output directory (written atomically)")
    quant.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=4)
    quant.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    quant.add_argument("--mode", choices=["affine", "mxfp4", "mxfp8", "nvfp4"], default="affine")
    quant.add_argument("--mtp-bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                       help="quantize MTP tensors too (default: keep them unquantized in --dtype)")
    quant.add_argument("--mtp-head-bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                       help="bits for the merged assistant's tied LM head (its costliest part)")
    quant.add_argument("--assistant", help="Gemma 4 assistant to merge into the output")
    quant.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    quant.add_argument("--force", action="store_true", help="replace an existing OUT")
    quant.add_argument("--shard-size-mb", type=int, default=5120, help="maximum shard size (default 5 GB)")

    add = sub.add_parser("add-mtp", help="add the MTP weights a converted quant dropped, from the original release")
    add.add_argument("original", help="the original (Hugging Face) checkpoint; only its MTP shards are read")
    add.add_argument("mlx_dir", help="the quantized MLX checkpoint to add them to (its weight files are kept)")
    add.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], default=None,
                     help="bits for the MTP weights (default: MLX_DIR's quantization)")
    add.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None)
    add.add_argument("--mode", choices=["affine", "mxfp4", "mxfp8", "nvfp4"], default=None)
    add.add_argument("--assistant", help="Gemma 4 assistant to merge in (as quantize --assistant does)")
    add.add_argument("--force", action="store_true", help="replace MTP weights MLX_DIR already holds")

    sett = sub.add_parser("settings", help="MTP model settings (YAML)")
    sett_sub = sett.add_subparsers(dest="settings_command", required=True)
    show = sett_sub.add_parser("show", help="the settings that apply to a model id, and where they come from")
    show.add_argument("model_id")
    check = sett_sub.add_parser("validate", help="validate one YAML settings file")
    check.add_argument("file")

    srv = sub.add_parser("serve", allow_abbrev=False,
                         help="mlx-lm's HTTP server with MTP decoding (other mlx-lm server flags pass through)")
    srv.add_argument("--model", required=True, help="model directory (or Hugging Face repo) to serve")
    srv.add_argument("--settings", metavar="FILE",
                     help="MTP settings YAML (oMLX's model settings keys; default: omlx-mtp.yaml in the model's directory)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)

    pat = sub.add_parser("patch", help="add the plugin hook call sites to oMLX (or remove them)")
    pat.add_argument("action", choices=["apply", "check", "revert"])
    pat.add_argument("--omlx", help="directory holding the omlx package (default: the importable one)")

    insp = sub.add_parser("inspect", help="describe a checkpoint's quantization and MTP weights")
    insp.add_argument("dir")
    insp.add_argument("--json", action="store_true")

    bench = sub.add_parser("bench", help="plain vs MTP vs oracle drafter, same process and weights")
    bench.add_argument("--model", help="target checkpoint (default: the embedded tiny pair)")
    bench.add_argument("--drafter", help="drafter checkpoint (with --model)")
    bench.add_argument("--draft-tokens", default="1,2,3,4,auto", help="comma-separated depths, 'auto' included")
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--prompt-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--json", dest="json_out", help="write results to this JSON file")
    bench.add_argument("--temps", default="0", help="comma-separated temperatures, e.g. 0,0.7,1.0")
    bench.add_argument("--batch", default="1", help="comma-separated batch sizes (requests decoding together)")
    bench.add_argument("--plot", help="write a PNG of speedup against draft tokens (needs matplotlib)")
    bench.add_argument("--synthetic", help="an in-memory model at real widths, random weights: gemma4-31b-shaped, "
                       "gemma4-26b-a4b-shaped (MoE), qwen3.5-27b-shaped, glm4.5-air-shaped or qwen3-next-shaped "
                       "(MoE, fewer experts)")
    bench.add_argument("--synthetic-layers", type=int, default=2)
    bench.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                       help="dtype of a --synthetic model")
    bench.add_argument("--target-bits", type=int, help="quantize a --synthetic target (4 or 8, as users serve it)")
    bench.add_argument("--head-bits", type=int, help="quantize a --synthetic drafter's head")
    bench.add_argument("--sharding", choices=["auto", "pipeline", "tensor"], default=None,
                       help="under mlx.launch: how --model or --synthetic is split over the ranks (default: the model's choice)")
    bench.add_argument("--accuracy", default="",
                       help="also run the drafter with its drafts right at these rates (comma-separated, "
                            "e.g. 0.5,0.7,0.85; greedy): realistic acceptance where random weights accept nothing")
    bench.add_argument("--compare-query-positions", action="store_true",
                       help="also measure greedy acceptance with the drafter query at N and at N-1")
    return parser


def _sampling_params(args):
    from ..decode.sampling import SamplingParams

    if args.draft_tokens != "auto":
        if not args.draft_tokens.isdigit() or int(args.draft_tokens) > MAX_DRAFT_TOKENS:
            raise MTPError(f"--draft-tokens: expected 0..{MAX_DRAFT_TOKENS} or 'auto', got {args.draft_tokens!r}")
        args.draft_tokens = int(args.draft_tokens)
    return SamplingParams(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )


def _grammar(session, args):
    """The xgrammar processor --json-schema or --grammar asks for."""
    if args.json_schema and args.grammar:
        raise MTPError("give --json-schema or --grammar, not both")
    try:
        from ..decode.grammar import GrammarCompiler
        import xgrammar  # noqa: F401
    except ImportError:
        raise MTPError("constrained output needs xgrammar: pip install 'omlx-mtp[grammar]'") from None
    path = args.json_schema or args.grammar
    try:
        text = open(path).read()
        compiler = GrammarCompiler(session.tokenizer, session.target.vocab_size)
        return compiler.json_schema(json.loads(text)) if args.json_schema else compiler.ebnf(text)
    except OSError as exc:
        raise MTPError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, RuntimeError) as exc:  # bad JSON, or xgrammar refusing the schema/grammar
        raise MTPError(f"{path}: not a usable {'JSON schema' if args.json_schema else 'grammar'}: {str(exc).strip()}") from None


def cmd_generate(args) -> int:
    from ..decode.requests import Request
    from .session import Session

    params = _sampling_params(args)
    session = Session.load(
        args.model,
        None if args.no_mtp else args.drafter,
        merged=not args.no_mtp,
        draft_tokens=args.draft_tokens,
        max_draft_tokens=args.max_draft_tokens,
        query_offset=QUERY_POSITIONS[args.query_position],
        sharding=args.sharding,
    )
    if args.top_k:  # mlx-lm's top-k takes 0 < k < vocabulary
        check("--top-k", args.top_k, Range(0, session.target.vocab_size - 1))
    if args.image:
        from .multimodal import image_request

        request = image_request(args.model, session.target.model, args.prompt, args.image, chat=True, params=params,
                                max_tokens=args.max_tokens, stop_tokens=session.stop_tokens())
    else:
        request = Request(session.encode(args.prompt, chat=args.chat), params, args.max_tokens, session.stop_tokens())
    if args.json_schema or args.grammar:
        request.params = dataclasses.replace(params, logits_processors=(_grammar(session, args),))
    outcome = session.run(request, mtp=not args.no_mtp, seed=args.seed)
    result = {**outcome.as_dict(session.tokenizer), **session.placement()}
    if args.json:
        print(json.dumps(result), flush=True)  # every rank prints its own line
    elif result["rank"] == 0:
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

    if args.drafter is not None and args.model is None:
        raise MTPError("bench: --drafter needs --model")
    if args.synthetic and args.model:
        raise MTPError("bench: --synthetic and --model exclude each other")
    if (args.target_bits or args.head_bits) and not args.synthetic:
        raise MTPError("bench: --target-bits and --head-bits apply to --synthetic models "
                       "(quantize a checkpoint with omlx-mtp quantize)")
    depths = _draft_depths(args.draft_tokens)
    try:
        temps = [float(t) for t in args.temps.split(",")]
    except ValueError:
        raise MTPError(f"--temps: expected comma-separated numbers, got {args.temps!r}") from None
    for temp in temps:
        check("--temps", temp, Range(low=0))
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise MTPError(f"--batch: expected comma-separated positive integers, got {args.batch!r}") from None
    try:
        accuracies = [float(a) for a in args.accuracy.split(",") if a.strip()]
    except ValueError:
        raise MTPError(f"--accuracy: expected comma-separated rates in [0, 1], got {args.accuracy!r}") from None
    for batch in batches:
        check("--batch", batch, Range(low=1))
    for accuracy in accuracies:
        check("--accuracy", accuracy, Range(0, 1))
    return run_bench(args.model, args.drafter, depths, args.max_tokens, args.repeats, args.prompt_tokens,
                     args.json_out, args.compare_query_positions, args.synthetic, args.synthetic_layers, args.dtype,
                     temps, batches, args.plot, accuracies, args.target_bits, args.head_bits, args.sharding)


def cmd_timeline(args) -> int:
    from .timeline import run_timeline

    if args.drafter is not None and args.model is None:
        raise MTPError("timeline: --drafter needs --model")
    depths = _draft_depths(args.draft_tokens)
    if len(depths) != 1:
        raise MTPError(f"timeline: --draft-tokens takes one depth or 'auto', got {args.draft_tokens!r}")
    return run_timeline(args.model, args.drafter, depths[0], args.batch, args.max_tokens, args.repeats, args.json)


def _draft_depths(text: str) -> list:
    """``--draft-tokens``: comma-separated depths, 'auto' among them."""
    try:
        depths = [k if k == "auto" else int(k) for k in text.split(",")]
    except ValueError:
        raise MTPError(f"--draft-tokens: expected comma-separated integers, got {text!r}") from None
    return [k if k == "auto" else check("--draft-tokens", k, DEPTH) for k in depths]


def cmd_quantize(args) -> int:
    from ..checkpoint.quantize import QuantizeOptions, quantize

    options = QuantizeOptions(bits=args.bits, group_size=args.group_size, mode=args.mode, mtp_bits=args.mtp_bits,
                              mtp_head_bits=args.mtp_head_bits, dtype=args.dtype, force=args.force,
                              shard_bytes=args.shard_size_mb << 20)
    try:
        out = quantize(args.src, args.out, options, assistant=args.assistant)
    except KeyboardInterrupt:
        print("omlx-mtp: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


def cmd_add_mtp(args) -> int:
    from ..checkpoint.add_mtp import add_mtp
    from ..checkpoint.files import safetensors_files

    try:
        read = add_mtp(args.original, args.mlx_dir, bits=args.bits, group_size=args.group_size, mode=args.mode,
                       assistant=args.assistant, force=args.force)
    except KeyboardInterrupt:
        print(f"omlx-mtp: interrupted; {args.mlx_dir} is as it was", file=sys.stderr)
        return 130
    total = sum(f.stat().st_size for f in safetensors_files(args.original))
    print(f"read {read / 1e6:.1f} MB of {args.original} ({read / max(total, 1):.1%} of its weights)")
    print(f"added the MTP weights to {args.mlx_dir}")
    return 0


def cmd_settings(args) -> int:
    from ..hosts import settings

    if args.settings_command == "validate":
        data = settings.load_file(args.file)
        print(f"{args.file}: valid ({', '.join(sorted(data)) or 'no keys'})")
        return 0
    resolved, files = settings.resolve(args.model_id)
    print(f"# {args.model_id}: " + (", then ".join(str(f) for f in files) if files else "no settings files; defaults"))
    print(yaml_dump(resolved.as_dict()), end="")
    return 0


def yaml_dump(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def cmd_serve(args) -> int:
    from .serve import serve

    return serve(args.model, args.settings, args.host, args.port, args.passed_on)


def cmd_patch(args) -> int:
    from ..hosts.omlx.patcher import run

    print(run(args.action, args.omlx))
    return 0


def cmd_inspect(args) -> int:
    from ..checkpoint.inspection import inspect_checkpoint, render

    report = inspect_checkpoint(args.dir)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if not report["problems"] else 1


COMMANDS = {"generate": cmd_generate, "demo": cmd_demo, "bench": cmd_bench, "quantize": cmd_quantize,
            "add-mtp": cmd_add_mtp, "inspect": cmd_inspect, "settings": cmd_settings, "patch": cmd_patch,
            "serve": cmd_serve, "timeline": cmd_timeline}


def main(argv=None) -> int:
    parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and args.command != "serve":  # only serve hands unknown flags on (to mlx-lm's server)
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    args.passed_on = passed_on
    try:
        check_args(args, RANGES.get(args.command, {}))  # before any model loads
        return COMMANDS[args.command](args)
    except MTPError as exc:
        print(f"omlx-mtp: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if not str(exc).startswith("[ring]"):
            raise
        # mx.distributed's ring lost a peer (a rank died or was stopped): one line, not a traceback
        print(f"omlx-mtp: error: another rank was lost ({exc}); stopping", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
