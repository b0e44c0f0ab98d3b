"""K/V memory of one request at a long context: plain decoding, MTP, and TurboQuant KV.

The demo pair, a prompt of ``--context`` tokens, then ``--steps`` generated tokens; bytes held by:

* plain decoding (mlx-lm's caches, what oMLX's loop holds for the request);
* TurboQuant KV as oMLX 0.3.8 applies it: its converters are never called, so the same caches;
* TurboQuant KV + MTP: this loop's caches (K/V buffers, slot tables, the drafter's own cache);
* TurboQuant KV were it applied: the full-attention layers converted to mlx-vlm's
  ``TurboQuantKVCache`` at ``--bits`` (oMLX skips the last such layer; its rotating layers stay).

    python benchmarks/kv_memory.py [--context 4096] [--steps 32] [--bits 4]
"""

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from omlx_mtp.decode import cache as caches  # noqa: E402
from omlx_mtp.decode.requests import Request
from omlx_mtp.fixtures.demo import demo_pair
from omlx_mtp.tools.session import Session, regime  # noqa: E402

MiB = 2**20


def nbytes(tree) -> int:
    """Bytes of every array in a (nested) cache state."""
    if isinstance(tree, mx.array):
        return tree.nbytes
    if isinstance(tree, (list, tuple)):
        return sum(nbytes(t) for t in tree)
    if isinstance(tree, dict):
        return sum(nbytes(t) for t in tree.values())
    return 0


def plain_cache(session: Session, prompt: list[int], steps: int) -> list:
    cache = make_prompt_cache(session.model)
    logits = session.model(mx.array(prompt)[None], cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    for _ in range(steps):
        logits = session.model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval([c.state for c in cache])
    return cache


def mtp_bytes(session: Session, prompt: list[int], steps: int) -> int:
    """This loop's caches for the request while it runs, after ``steps`` tokens."""
    decoder = session.decoder
    batch = decoder.batch()
    row = batch.new_row(Request(prompt, max_tokens=steps + 64))
    cache, hidden, logits = decoder._prefill([row.request], slack=batch.max_depth + 1)
    batch.start([row], cache, hidden, logits)
    while len(row.generated) < steps:
        batch.round()
    held = sum(nbytes([c.keys, c.values]) for c in batch.cache if hasattr(c, "table"))
    states = sum(nbytes(c.state) for c in batch.cache if not hasattr(c, "table"))
    tables = sum(t.positions.nbytes for t in caches.tables_of(batch.cache))  # once per table, shared by layers
    return held + states + tables


def turboquant_bytes(cache: list, bits: float) -> int:
    """The caches were oMLX's converter applied (full-attention layers but the last)."""
    from mlx_vlm.turboquant import TurboQuantKVCache

    full = [i for i, c in enumerate(cache) if type(c) is KVCache]
    converted = list(cache)
    for i in full[:-1]:
        layer = converted[i] = TurboQuantKVCache(bits=bits)  # (its from_cache reads an older state layout)
        layer.update_and_fetch(cache[i].keys[..., : cache[i].offset, :], cache[i].values[..., : cache[i].offset, :])
    return sum(nbytes(c.state) for c in converted)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--bits", type=float, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, assistant, _ = demo_pair(Path(tmp) / "pair")
        session = Session.load(target, assistant, draft_tokens=3)
    prompt = (session.encode("def handler(request):\n    return request.get(1)\n\n") * args.context)[: args.context]
    plain = plain_cache(session, prompt, args.steps)
    rows = {"plain": nbytes([c.state for c in plain]),
            "TurboQuant as oMLX 0.3.8 applies it": nbytes([c.state for c in plain]),
            "TurboQuant + MTP": mtp_bytes(session, prompt, args.steps)}
    try:
        rows[f"TurboQuant were it applied ({args.bits:g} bits)"] = turboquant_bytes(plain, args.bits)
    except ImportError as exc:
        print(f"(mlx-vlm's TurboQuant is not importable here: {exc})")
    print(f"regime: {regime()}; demo pair, {args.context}-token prompt + {args.steps} tokens")
    for name, size in rows.items():
        print(f"{name:<40} {size / MiB:7.2f} MiB  (x{size / rows['plain']:.2f})")


if __name__ == "__main__":
    main()
