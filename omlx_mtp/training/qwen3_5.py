"""Training a small Qwen3.5 target and its built-in MTP head on CPU, on the demo corpus (the Python
standard library's sources, with the demo pair's tokenizer).

The head is distilled as it runs at inference for its first draft: at every position t of a
sequence (all in parallel, causal attention over the head's own entries) it reads the trunk's
final-normed hidden state at t and the token at t + 1, and its soft label is the trunk's own
distribution at t + 1 (which predicts t + 2).  The checkpoint is written as Qwen publishes them
(``tiny_qwen.published_tensors``), text-only; ``tiny_qwen.add_vision`` makes a multimodal copy."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models import qwen3_5

from ..drafters.qwen3_5_mtp import Qwen35MTPHead
from ..fixtures.tiny_qwen import TinyQwenSpec, published_config, published_tensors
from .gemma4 import batches, init_small, stdlib_corpus, train_target

SPEC = TinyQwenSpec(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def teacher_kl(teacher_logits: mx.array, student_logits: mx.array) -> mx.array:
    """Mean KL(teacher || student) over positions: a drafter is accepted as often as its
    distribution matches the trunk's own, so it learns that distribution, not the corpus's."""
    p = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    student = nn.log_softmax(student_logits.astype(mx.float32), axis=-1)
    return mx.mean(mx.sum(p * (mx.log(p + 1e-9) - student), axis=-1))


def head_loss(head: Qwen35MTPHead, model: qwen3_5.Model, data: mx.array) -> mx.array:
    text = model.language_model
    hidden = mx.stop_gradient(text.model(data))  # [B, L, H], final-normed
    teacher = mx.stop_gradient(text.lm_head(hidden[:, 1:]))
    embedded = head.pre_fc_norm_embedding(text.model.embed_tokens(data[:, 1:]))
    x = head.fc(mx.concatenate([embedded, head.pre_fc_norm_hidden(hidden[:, :-1])], axis=-1))
    for layer in head.layers:
        x = layer(x, mask="causal", cache=None)
    return teacher_kl(teacher, text.lm_head(head.norm(x)))


def train_module(module: nn.Module, loss_fn, tokens: np.ndarray, steps: int, batch: int, seq_len: int, lr: float,
                 name: str = "head", seed: int = 1, compiled: bool = False, after_step=None, log=print) -> None:
    """AdamW (cosine decay, clipped gradients) on ``loss_fn(module, data)`` over random corpus
    windows; frozen parameters stay as they are.  ``after_step(i, data)`` runs outside the
    gradient (GLM's expert balancing)."""
    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(lr, steps, lr / 10), weight_decay=0.01)
    state = [module.state, optimizer.state]

    def step(data):
        loss, grads = nn.value_and_grad(module, loss_fn)(module, data)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(module, grads)
        return loss

    if compiled:
        step = mx.compile(step, inputs=state, outputs=state)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for i, data in zip(range(steps), batches(tokens, batch, seq_len, rng)):
        loss = step(data)
        mx.eval(state, loss)
        if after_step is not None:
            after_step(i, data)
        if i % 50 == 0 or i == steps - 1:
            log(f"{name} step {i:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.0f}s")


def train_head(head: Qwen35MTPHead, model: qwen3_5.Model, tokens: np.ndarray, steps: int, batch: int,
               seq_len: int, lr: float, log=print) -> None:
    model.freeze()
    train_module(head, lambda h, data: head_loss(h, model, data), tokens, steps, batch, seq_len, lr,
                 name="head (KL)", log=log)


def corpus_tokens(tokenizer, corpus_bytes: int, log=print) -> np.ndarray:
    """The demo corpus (standard library sources) through the demo tokenizer."""
    corpus = stdlib_corpus(corpus_bytes)
    tokens = np.array(tokenizer.encode(corpus), dtype=np.int32)
    log(f"corpus: {len(corpus) / 1e6:.1f} MB of Python standard library sources, {len(tokens):,} tokens")
    return tokens


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, Path(out) / name)


def build_qwen_pair(out: Path, tokenizer_dir: Path, target_steps: int, head_steps: int, batch: int = 16,
                    seq_len: int = 128, corpus_bytes: int = 3_000_000, log=print) -> Path:
    """Train the trunk, then its head; write one checkpoint directory (the head inside, ``mtp.*``)."""
    from mlx_lm.utils import load_tokenizer

    out = Path(out)
    tokenizer = load_tokenizer(Path(tokenizer_dir))
    spec = replace(SPEC, vocab_size=len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else SPEC.vocab_size)
    tokens = corpus_tokens(tokenizer, corpus_bytes, log)
    config = published_config(spec)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    init_small(model, seed=0)
    train_target(model, tokens, target_steps, batch, seq_len, lr=3e-3, log=log)
    head = Qwen35MTPHead(model.language_model.args)
    init_small(head, seed=1)
    train_head(head, model, tokens, head_steps, batch, seq_len, lr=3e-3, log=log)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    tensors = published_tensors(model, head, spec)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    config["text_config"].update(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, out)
    return out
