"""SpecPrefill and MTP, alone and together, as oMLX 0.3.8 runs them — in one process, alternating.

oMLX's own scoring, chunk selection and sparse prefill (``omlx/patches/specprefill.py`` from the
tree at OMLX_SRC; run with oMLX's pins, mlx-lm 0.31.x) on the demo pair; requests are prefilled
outside the generator and inserted with their last token, as oMLX's scheduler does, then decoded by
mlx-lm's BatchGenerator (plain) or omlx-mtp's (MTP).  Four ways per repeat:

    full + plain, full + MTP, SpecPrefill + plain, SpecPrefill + MTP

Time to first token (scoring, prefill and the first token), decode time of the rest, and their sum,
medians over the repeats; each repeat scores once and both SpecPrefill runs use its selection, so
their outputs must be equal (checked).  The demo target scores its own prompt (the demo has no
smaller model with its tokenizer), so scoring costs a full prefill of a same-size model here: the
TTFT gain SpecPrefill is for needs a scorer much smaller than the target.

    OMLX_SRC=/path/to/omlx-0.3.8 python benchmarks/specprefill.py [--prompt-tokens 8192]
        [--max-tokens 128] [--keep 0.2] [--draft-tokens 3] [--repeats 2]
"""

import argparse
import importlib
import inspect
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from omlx_mtp.fixtures.demo import demo_pair
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator  # noqa: E402
from omlx_mtp.checkpoint.loading import load_target  # noqa: E402
from omlx_mtp.tools.session import Session, regime  # noqa: E402

PREFILL_STEP = 2048  # oMLX's prefill_step_size


def specprefill_module():
    source = os.environ.get("OMLX_SRC")
    if not source or not (Path(source) / "omlx" / "patches" / "specprefill.py").is_file():
        sys.exit("OMLX_SRC must point at an oMLX 0.3.8 tree")
    sys.path.insert(0, source)
    return importlib.import_module("omlx.patches.specprefill")


def corpus_prompt(session: Session, tokens: int) -> list[int]:
    """Python standard-library source (the demo pair's kind of text), cut to ``tokens`` tokens."""
    text = ""
    for name in ("argparse", "inspect", "typing", "dataclasses", "pathlib", "statistics"):
        text += inspect.getsource(importlib.import_module(name))
        ids = session.encode(text)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise SystemExit(f"the corpus gives only {len(ids)} tokens")


def full_prefill(model, prompt):
    cache = make_prompt_cache(model)
    for start in range(0, len(prompt) - 1, PREFILL_STEP):
        model(mx.array(prompt[start : min(start + PREFILL_STEP, len(prompt) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def sparse_prefill(sp, model, prompt, selected):
    """The scheduler's sequence: the last prompt token left out (it is inserted), then the
    wrappers' adjustment lowered by one for it."""
    kept = [i for i in selected if i != len(prompt) - 1]
    cache = make_prompt_cache(model)
    sp.sparse_prefill(model, prompt, mx.array(kept), cache, step_size=PREFILL_STEP)
    for _, layer in sp._find_attention_layers(model):
        attention = sp._get_attn_module(layer)
        if isinstance(getattr(attention, "rope", None), sp._OffsetAdjustedRoPE):
            attention.rope._adjustment -= 1
    return cache


def decode(generator, prompt, cache, max_tokens):
    """(tokens, seconds to the first token, seconds for the rest) after a prefilled cache."""
    started = time.perf_counter()
    (uid,) = generator.insert([prompt[-1:]], max_tokens=[max_tokens], caches=[cache])
    tokens, first = [], None
    while len(tokens) < max_tokens:
        for response in generator.next_generated():
            tokens.append(response.token)
            if first is None:
                first = time.perf_counter()
            if response.finish_reason is not None:
                max_tokens = len(tokens)
    return tokens, first - started, time.perf_counter() - first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--keep", type=float, default=0.2)
    parser.add_argument("--draft-tokens", default="3")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sp = specprefill_module()
    from mlx_lm.generate import BatchGenerator

    depth = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, assistant, _ = demo_pair(Path(tmp) / "pair")
        session = Session.load(target_dir, assistant, draft_tokens=depth)
        scorer, _, _ = load_target(target_dir)  # oMLX loads its scorer on its own
    model, prompt = session.model, corpus_prompt(session, args.prompt_tokens)
    engines = {
        "plain": lambda: BatchGenerator(model, max_tokens=args.max_tokens),
        "mtp": lambda: MTPBatchGenerator(session.decoder, BatchGenerator, model=model, max_tokens=args.max_tokens),
    }
    times = {(way, engine): [] for way in ("full", "SpecPrefill") for engine in engines}
    print(f"regime: {regime()}; demo pair, {len(prompt)}-token prompt, {args.max_tokens} tokens at T=0, "
          f"keep {args.keep}, draft tokens {args.draft_tokens}, medians of {args.repeats} (after a warm-up)")
    for repeat in range(args.repeats + 1):
        started = time.perf_counter()
        importance, _ = sp.score_tokens(scorer, prompt, prefill_step_size=PREFILL_STEP)
        selected = sp.select_chunks(importance, keep_pct=args.keep).tolist()
        scoring = time.perf_counter() - started
        outputs = {}
        for engine, make in engines.items():
            for way in ("full", "SpecPrefill"):
                started = time.perf_counter()
                if way == "full":
                    cache = full_prefill(model, prompt)
                else:
                    cache = sparse_prefill(sp, model, prompt, selected)
                prefill = time.perf_counter() - started + (scoring if way == "SpecPrefill" else 0.0)
                tokens, first, rest = decode(make(), prompt, cache, args.max_tokens)
                sp.cleanup_rope(model)  # what oMLX does when the request finishes
                outputs[(way, engine)] = tokens
                if repeat:  # the first pass warms up (compiles) and is not counted
                    times[(way, engine)].append((prefill + first, rest))
        for way in ("full", "SpecPrefill"):
            assert outputs[(way, "plain")] == outputs[(way, "mtp")], f"{way}: MTP differs from plain"
    print(f"kept {len(selected)} of {len(prompt)} prompt tokens; MTP equals plain after each prefill")
    base = None
    for (way, engine), runs in times.items():
        ttft = statistics.median(t for t, _ in runs)
        rest = statistics.median(r for _, r in runs)
        total = ttft + rest
        base = base or total
        print(f"{way:>11} + {engine:<5}  TTFT {ttft:6.2f} s  decode {rest:5.2f} s  total {total:6.2f} s  "
              f"(x{base / total:.2f} of full + plain)")


if __name__ == "__main__":
    main()
