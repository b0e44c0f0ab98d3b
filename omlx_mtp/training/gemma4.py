"""Training a small Gemma 4 target and distilling a Gemma 4 assistant drafter from it, on CPU.

The corpus is the Python standard library's own sources (present on every machine with
Python), the tokenizer a byte-level BPE trained on it.  The assistant is distilled exactly as
it runs at inference: for every bonus position N of a sequence (all in parallel) it starts from
the target's final-normed hidden state at N-1 and the bonus token's target embedding, attends to
the target's K/V of positions < N (sliding layers: the latest window + 1), and unrolls K steps,
each step's soft label being the target's own distribution at N + step.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from ..decode import cache as caches
from ..targets import Target, wrap_target
from ..drafters.gemma4_assistant import Gemma4AssistantDrafter, normalize_assistant_config
from ..checkpoint.gemma4_config import FULL, GEMMA4_ROPE, SLIDING, normalize_text_config
from ..fixtures.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS


@dataclass
class PairSpec:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 2
    head_dim: int = 64
    global_head_dim: int = 128
    sliding_window: int = 128
    drafter_hidden: int = 96
    drafter_layers: int = 2
    seq_len: int = 256
    corpus_bytes: int = 6_000_000


def stdlib_corpus(limit: int) -> str:
    """Python standard library sources, sorted for reproducibility (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    parts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text)
        if total >= limit:
            break
    return "\n\n".join(parts)[:limit]


def train_tokenizer(corpus: str, vocab_size: int, directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ["<start_of_turn>", "<end_of_turn>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = [corpus[i : i + 100_000] for i in range(0, len(corpus), 100_000)]
    tokenizer.train_from_iterator(chunks, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(directory))
    return wrapped


def target_config(spec: PairSpec, vocab_size: int) -> dict:
    types = [SLIDING, SLIDING, FULL] * spec.num_layers
    types = types[: spec.num_layers]
    types[-1] = FULL
    return {
        "model_type": "gemma4_text",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": 4 * spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": 1,
        "head_dim": spec.head_dim,
        "global_head_dim": spec.global_head_dim,
        "vocab_size": vocab_size,
        "sliding_window": spec.sliding_window,
        "layer_types": types,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "pad_token_id": 0,
        "rope_parameters": dict(GEMMA4_ROPE),
    }


def assistant_config(spec: PairSpec, target: dict) -> dict:
    text = {
        key: target[key]
        for key in ("head_dim", "global_head_dim", "vocab_size", "sliding_window", "rms_norm_eps", "rope_parameters")
    }
    types = ([SLIDING] * (spec.drafter_layers - 1) + [FULL])[: spec.drafter_layers]
    text.update(
        model_type="gemma4_text",
        hidden_size=spec.drafter_hidden,
        num_hidden_layers=spec.drafter_layers,
        intermediate_size=2 * spec.drafter_hidden,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=1,
        layer_types=types,
        num_kv_shared_layers=spec.drafter_layers,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
        attention_k_eq_v=False,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": False,
        "tie_word_embeddings": True,
        "text_config": text,
    }


def batches(tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
        yield mx.array(np.stack([tokens[s : s + seq_len + 1] for s in starts]))


def train_target(model, tokens: np.ndarray, steps: int, batch: int, seq_len: int, lr: float, log=print):
    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr / 10), weight_decay=0.01)

    def loss_fn(model, data):
        logits = model(data[:, :-1])
        return nn.losses.cross_entropy(logits, data[:, 1:], reduction="mean")

    state = [model.state, optimizer.state]

    def step(data):
        loss, grads = nn.value_and_grad(model, loss_fn)(model, data)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i, data in zip(range(steps), batches(tokens, batch, seq_len, rng)):
        loss = step(data)
        mx.eval(state)
        if i % 50 == 0 or i == steps - 1:
            log(f"target step {i:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.0f}s")


def target_views(target: Target, data: mx.array):
    """One target forward over whole sequences: logits, final-normed hidden, and the K/V of the
    layers the drafter reads (slot == position: the ring is made large enough not to wrap)."""
    B, L = data.shape
    cache = target.make_cache(B, slack=L)
    logits, hidden = target.forward(data, cache)
    caches.advance(cache, L)
    kv = {kind: target.kv_source(cache, kind).state for kind in (SLIDING, FULL)}
    kv = {kind: (k[:, :, :L], v[:, :, :L]) for kind, (k, v) in kv.items()}
    return mx.stop_gradient(logits), mx.stop_gradient(hidden), {k: tuple(map(mx.stop_gradient, v)) for k, v in kv.items()}


def drafter_masks(drafter, target: Target, first: int, count: int, length: int) -> dict:
    """Query n (bonus at position first + n) sees committed positions < first + n."""
    bonus = first + mx.arange(count)[:, None]
    key = mx.arange(length)[None]
    masks = {}
    for kind in set(drafter.layer_types):
        visible = key < bonus
        span = drafter.visible_span(kind, target.sliding_window)
        if span is not None:
            visible = visible & (key >= bonus - span)
        masks[kind] = visible[None, None]
    return masks


def distill_loss(drafter, target: Target, data: mx.array, K: int, query_offset: int = 0):
    logits, hidden, kv = target_views(target, data)
    B, L = data.shape
    first, count = 1, L - K - 1  # bonus positions 1 .. L-K-1 all at once
    masks = drafter_masks(drafter, target, first, count, L)
    h = hidden[:, first - 1 : first - 1 + count]
    total = 0.0
    for j in range(K):
        token = data[:, first + j : first + j + count]
        out, h = drafter(target.input_embedding(token), h, kv, masks, first + query_offset)
        labels = mx.softmax(logits[:, first + j : first + j + count].astype(mx.float32), axis=-1)
        logq = out - mx.logsumexp(out, axis=-1, keepdims=True)
        total = total + (-(labels * logq).sum(-1)).mean()
    return total / K


def train_drafter(drafter, target: Target, tokens: np.ndarray, steps: int, batch: int, seq_len: int,
                  lr: float, K: int = 3, log=print):
    target.model.freeze()
    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr / 10), weight_decay=0.01)
    loss_and_grad = nn.value_and_grad(drafter, lambda m, d: distill_loss(m, target, d, K))
    rng = np.random.default_rng(1)
    start = time.perf_counter()
    for i, data in zip(range(steps), batches(tokens, batch, seq_len, rng)):
        loss, grads = loss_and_grad(drafter, data[:, :-1])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss)
        if i % 50 == 0 or i == steps - 1:
            log(f"drafter step {i:5d}  distill loss {loss.item():.3f}  {time.perf_counter() - start:6.0f}s")


def init_small(module: nn.Module, seed: int, std: float = 0.02):
    rng = np.random.default_rng(seed)
    weights = []
    for name, value in tree_flatten(module.parameters()):
        if value.ndim >= 2:
            fan_in = value.shape[-1]
            scale = std if "embed" in name else 1 / math.sqrt(fan_in)
            weights.append((name, mx.array(rng.normal(0, scale, value.shape).astype(np.float32))))
    module.load_weights(weights, strict=False)


def save_checkpoint(module: nn.Module, config: dict, directory: Path, drop=()):
    directory.mkdir(parents=True, exist_ok=True)
    weights = {k: v for k, v in tree_flatten(module.parameters()) if not any(d in k for d in drop)}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def build_pair(out: Path, spec: PairSpec, target_steps: int, drafter_steps: int, batch: int = 16, log=print):
    out = Path(out)
    log(f"corpus: {spec.corpus_bytes / 1e6:.1f} MB of Python standard library sources")
    corpus = stdlib_corpus(spec.corpus_bytes)
    target_dir, assistant_dir = out / "target", out / "assistant"
    target_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus, spec.vocab_size, target_dir)
    tokens = np.array(tokenizer(corpus)["input_ids"], dtype=np.int32)
    log(f"tokens: {len(tokens):,} ({len(corpus) / len(tokens):.2f} bytes/token)")
    config = target_config(spec, len(tokenizer))
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(normalize_text_config(config)))
    init_small(model, seed=0)
    train_target(model, tokens, target_steps, batch, spec.seq_len, lr=3e-3, log=log)
    save_checkpoint(model, config, target_dir)
    target = wrap_target(model)
    drafter_config = assistant_config(spec, config)
    drafter = Gemma4AssistantDrafter(normalize_assistant_config(drafter_config, "assistant"))
    init_small(drafter, seed=1)
    train_drafter(drafter, target, tokens, drafter_steps, batch, spec.seq_len, lr=3e-3, log=log)
    save_checkpoint(drafter, drafter_config, assistant_dir)
    return target_dir, assistant_dir


def distill_assistant(target_dir: Path, out: Path, spec: PairSpec, steps: int, batch: int = 16, log=print) -> Path:
    """A fresh assistant distilled from an already trained target checkpoint (the tokenizer is the
    target's); the same corpus and drafter training as build_pair."""
    from ..checkpoint.loading import load_target

    model, tokenizer, config = load_target(target_dir)
    corpus = stdlib_corpus(spec.corpus_bytes)
    tokens = np.array(tokenizer.encode(corpus), dtype=np.int32)
    target = wrap_target(model)
    drafter_config = assistant_config(spec, config)
    drafter = Gemma4AssistantDrafter(normalize_assistant_config(drafter_config, "assistant"))
    init_small(drafter, seed=1)
    train_drafter(drafter, target, tokens, steps, batch, spec.seq_len, lr=3e-3, log=log)
    save_checkpoint(drafter, drafter_config, Path(out))
    return Path(out)
