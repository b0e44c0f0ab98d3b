"""What MTP would gain at a model's real depth, from component costs measured at two shallow ones.

The synthetic pairs of ``omlx-mtp bench --synthetic`` have a real model's widths but a few layers,
so the drafter's cost weighs several times more against a step than it does at 60 layers.  This
measures a plain step, a verify of K+1 positions and a draft step at two layer counts, fits each
forward's cost as (embedding + head) + layers x (one layer), and prints the speedup bound
E[tokens per round] / (t_verify / t_step + K t_draft / t_step) at the real depth for drafts right
at rate a (E = (1 - a^(K+1)) / (1 - a)), beside the bound at the measured depth.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python benchmarks/real_depth.py \\
        --synthetic gemma4-31b-shaped --real-layers 60 [--dtype float32] [--target-bits 4 --head-bits 8]
"""

import argparse
import gc
import json

import mlx.core as mx

from omlx_mtp.tools.bench import component_costs, speedup_bound
from omlx_mtp.fixtures.synthetic import synthetic_pair
from omlx_mtp.tools.session import Session, regime


def measure(args, layers: int) -> dict:
    target, drafter = synthetic_pair(args.synthetic, layers, args.dtype, args.target_bits, args.head_bits)
    session = Session(target, None, drafter)
    prompt = mx.random.randint(3, target.vocab_size, (args.prompt_tokens,), key=mx.random.key(0)).tolist()
    out = {}
    for batch in args.batch:
        step = component_costs(session, prompt, 0, batch, repeats=args.repeats)["verify_ms"]
        for K in args.depths:
            costs = component_costs(session, prompt, K, batch, repeats=args.repeats)
            out[(batch, K)] = {"step_ms": step, "verify_ms": costs["verify_ms"], "draft_ms": costs["draft_ms"]}
            print(f"  {layers} layers B={batch} K={K}: step {step:.0f} ms, verify {costs['verify_ms']:.0f} ms, "
                  f"draft {costs['draft_ms']:.0f} ms", flush=True)
    del session, target, drafter
    gc.collect()
    mx.clear_cache()
    return out


def expected_tokens(a: float, K: int) -> float:
    """E[tokens per round] for drafts right at rate a independently: 1 + a + ... + a^K."""
    return sum(a**i for i in range(K + 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--synthetic", default="gemma4-31b-shaped")
    parser.add_argument("--real-layers", type=int, default=60)
    parser.add_argument("--layers", default="2,3", help="the two shallow depths measured (Gemma 4 needs both a "
                        "sliding and a full layer: 2 at least)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--target-bits", type=int)
    parser.add_argument("--head-bits", type=int)
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--depths", default="1,3")
    parser.add_argument("--accuracy", default="0.5,0.7,0.85")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    args.depths = [int(k) for k in args.depths.split(",")]
    low, high = (int(n) for n in args.layers.split(","))
    print(f"{args.synthetic}, {args.dtype}, target bits {args.target_bits}, head bits {args.head_bits}; {regime()}")
    shallow, deep = measure(args, low), measure(args, high)
    rows = []
    for (batch, K), a_costs in shallow.items():
        b_costs = deep[(batch, K)]

        def at(layers, key):  # (embedding + head) + layers x per-layer, fitted through the two depths
            per_layer = (b_costs[key] - a_costs[key]) / (high - low)
            return a_costs[key] + per_layer * (layers - low)

        for a in (float(x) for x in args.accuracy.split(",")):
            E = expected_tokens(a, K)
            bound = {n: speedup_bound(E, K, {"verify_ms": at(n, "verify_ms"), "decode_ms": at(n, "step_ms")},
                                      a_costs["draft_ms"]) for n in (high, args.real_layers)}
            rows.append({"batch": batch, "K": K, "accuracy": a, "step_ms_real": at(args.real_layers, "step_ms"),
                         "verify_ms_real": at(args.real_layers, "verify_ms"), "draft_ms": a_costs["draft_ms"],
                         f"bound_at_{high}_layers": bound[high], f"bound_at_{args.real_layers}_layers": bound[args.real_layers]})
            print(f"B={batch} K={K} a={a}: bound x{bound[high]:.2f} at {high} layers, "
                  f"x{bound[args.real_layers]:.2f} at {args.real_layers} (step {at(args.real_layers, 'step_ms'):.0f} ms, "
                  f"verify {at(args.real_layers, 'verify_ms'):.0f} ms, draft {a_costs['draft_ms']:.0f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"regime": regime(), "model": args.synthetic, "dtype": args.dtype, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
