"""Training a small GLM-4.5-shaped target (mlx-lm ``glm4_moe``) and its MTP ("nextn") layer on CPU,
on the demo corpus (the Python standard library's sources, with the demo pair's tokenizer).

The trunk is GLM-4.5's in miniature: GQA attention with q/k/v biases and QK-norm, RoPE on half of
each head, a dense first layer, then MoE layers (sigmoid router with GLM's bias-corrected top-k, a
shared expert).  Routing is balanced as DeepSeek-V3 / GLM-4.5 balance it, without an auxiliary
loss: each expert's ``e_score_correction_bias`` moves against its load.

The MTP layer is ``drafters.nextn.NextnLayer`` itself, trained with the DeepSeek-V3 objective
jointly with the trunk: at every position t it reads the trunk's final-normed hidden state h_t and
the token at t + 1 and predicts the token at t + 2 (cross-entropy, weight ``MTP_WEIGHT``), all
positions at once under causal attention over its own entries, as its K/V cache holds them at
inference.  A short second phase (trunk frozen) distills it onto the trunk's own distribution at
t + 1, which is what a verify accepts.  The checkpoint is written as GLM-4.6's bf16 release lays it
out: per-expert tensors, the layer at ``model.layers.{num_hidden_layers}``, sharing the trunk's
embedding and head."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import glm4_moe

from ..decode.loop import SpeculativeDecoder
from ..decode.requests import DecodeStats, Request
from ..decode.sampling import SamplingParams
from ..drafters.nextn import NextnLayer
from ..targets import wrap_target
from .gemma4 import init_small, stdlib_corpus
from .qwen3_5 import copy_tokenizer, corpus_tokens, teacher_kl, train_module

MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first part of its pre-training
BALANCE_RATE = 2e-3  # bias step per balancing probe (DeepSeek-V3's gamma is 1e-3 per step)
BALANCE_EVERY = 4  # steps between probes: a probe is one extra forward on a small batch
# Large trained models' final norms are far from uniform; with uniform weights hnorm(final-normed h)
# would equal hnorm(pre-norm h) and reading the wrong one could not be told apart.  The demo
# trunk's final norm starts log-normally spread (the head learns around it; nothing pulls it back).
FINAL_NORM_SPREAD = 0.8
CORPUS_BYTES = 3_000_000  # of standard library sources; held-out prompts come from past them


@dataclass
class GlmSpec:
    hidden_size: int = 128
    num_layers: int = 4  # the first dense, the others MoE
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384  # the dense layer's MLP
    moe_intermediate_size: int = 128  # each routed expert's and the shared expert's
    routed_experts: int = 4
    experts_per_token: int = 2


def published_config(spec: GlmSpec, vocab_size: int, eos: int, bos: int, pad: int) -> dict:
    """config.json as GLM-4.5 / 4.6 publish it (RoPE settings at the top level)."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "pad_token_id": pad,
        "eos_token_id": eos,
        "bos_token_id": bos,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "partial_rotary_factor": 0.5,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 4096,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": spec.routed_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": spec.experts_per_token,
        "routed_scaling_factor": 1.0,
        "num_key_value_heads": spec.num_kv_heads,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": vocab_size,
    }


class Joint(nn.Module):
    """The trunk and its MTP layer as one module, so one optimizer trains both."""

    def __init__(self, model: glm4_moe.Model, layer: NextnLayer):
        super().__init__()
        self.model = model
        self.mtp = layer


def mtp_logits(layer: NextnLayer, target, hidden: mx.array, next_tokens: mx.array) -> mx.array:
    """The layer's logits at every position at once: pair i is (hidden[:, i], next_tokens[:, i]),
    causal over the pairs before it (its K/V cache's view at inference)."""
    x = layer.run_pairs(target, next_tokens, hidden, [None])  # no cache: a causal mask over the pairs
    return target.head(layer.shared_head.norm(x))


def joint_loss(joint: Joint, target, data: mx.array) -> mx.array:
    """Next-token cross-entropy plus MTP_WEIGHT x the layer's cross-entropy on the token at t + 2
    (the DeepSeek-V3 MTP objective; its gradient reaches the trunk through h)."""
    hidden = joint.model.model(data[:, :-1])  # final-normed, positions 0 .. L-1
    main = nn.losses.cross_entropy(joint.model.lm_head(hidden), data[:, 1:], reduction="mean")
    logits = mtp_logits(joint.mtp, target, hidden[:, :-1], data[:, 1:-1])
    mtp = nn.losses.cross_entropy(logits, data[:, 2:], reduction="mean")
    return main + MTP_WEIGHT * mtp


def distill_loss(layer: NextnLayer, target, data: mx.array) -> mx.array:
    """The layer against the (frozen) trunk's own distribution at t + 1: the soft label of t + 2."""
    hidden = mx.stop_gradient(target.body(data))
    teacher = mx.stop_gradient(target.head(hidden[:, 1:]))
    return teacher_kl(teacher, mtp_logits(layer, target, hidden[:, :-1], data[:, 1:]))


# -- expert balancing (no auxiliary loss) ------------------------------------------------------
def moe_gates(joint: Joint) -> list:
    """The routers in the order a forward calls them: trunk layers, then the MTP layer's."""
    gates = [layer.mlp.gate for layer in joint.model.model.layers if isinstance(layer.mlp, glm4_moe.MoE)]
    return gates + [joint.mtp.block.mlp.gate]


@contextmanager
def recorded_routing():
    """Every expert choice mlx-lm's routers make meanwhile, in call order."""
    original = glm4_moe.group_expert_select
    chosen = []

    def recording(*args):
        inds, scores = original(*args)
        chosen.append(inds)
        return inds, scores

    glm4_moe.group_expert_select = recording
    try:
        yield chosen
    finally:
        glm4_moe.group_expert_select = original


def balance_experts(joint: Joint, target, data: mx.array, rate: float = BALANCE_RATE) -> list:
    """One probe forward; each router's bias moves ``rate`` up for experts below the mean load and
    down for those above.  Returns the loads (fractions of choices), one list per router."""
    with recorded_routing() as chosen:
        hidden = joint.model.model(data[:, :-1])
        joint.mtp.run_pairs(target, data[:, 1:-1], hidden[:, :-1], [None])
        mx.eval(chosen)
    loads = []
    for gate, inds in zip(moe_gates(joint), chosen):
        E = gate.e_score_correction_bias.shape[0]
        counts = (inds.reshape(-1, 1) == mx.arange(E)).sum(axis=0).astype(mx.float32)
        gate.e_score_correction_bias = gate.e_score_correction_bias + rate * mx.sign(counts.mean() - counts)
        loads.append((counts / counts.sum()).tolist())
    mx.eval([g.e_score_correction_bias for g in moe_gates(joint)])
    return loads


# -- the checkpoint, as GLM publishes it ------------------------------------------------------
def hf_layer_tensors(prefix: str, weights: dict) -> dict:
    """One decoder layer's mlx-lm tensors under Hugging Face names: the stacked experts
    (``mlp.switch_mlp.*``) split back into ``mlp.experts.{e}.*``."""
    out = {}
    for name, value in weights.items():
        if ".switch_mlp." in name:
            head, _, tail = name.partition(".switch_mlp.")  # tail: gate_proj.weight ...
            for e in range(value.shape[0]):
                out[f"{prefix}{head}.experts.{e}.{tail}"] = value[e]
        else:
            out[prefix + name] = value
    return out


def published_tensors(model: glm4_moe.Model, layer: NextnLayer, dtype=mx.bfloat16) -> dict:
    """Trunk and MTP layer in GLM's names and dtypes (router biases stay float32, as released)."""
    trunk = dict(tree_flatten(model.parameters()))
    n = model.args.num_hidden_layers
    out = {k: v for k, v in trunk.items() if not k.startswith("model.layers.")}
    for i in range(n):
        prefix = f"model.layers.{i}."
        out.update(hf_layer_tensors(prefix, {k[len(prefix):]: v for k, v in trunk.items() if k.startswith(prefix)}))
    own = dict(tree_flatten(layer.parameters()))
    block = {k[len("block."):]: v for k, v in own.items() if k.startswith("block.")}
    out.update(hf_layer_tensors(f"model.layers.{n}.", block))
    out.update({f"model.layers.{n}.{k}": v for k, v in own.items() if not k.startswith("block.")})
    return {k: v if "e_score_correction_bias" in k else v.astype(dtype) for k, v in out.items()}


def build_glm(out: Path, tokenizer_dir: Path, joint_steps: int, distill_steps: int, batch: int = 16,
              seq_len: int = 128, corpus_bytes: int = CORPUS_BYTES, spec: GlmSpec = GlmSpec(),
              joint_snapshot: Path | None = None, log=print) -> Path:
    """Train trunk and MTP layer jointly, then distill the layer; write one checkpoint directory
    (and, given ``joint_snapshot``, the one before distillation there)."""
    from mlx_lm.utils import load_tokenizer

    out = Path(out)
    tokenizer = load_tokenizer(Path(tokenizer_dir))
    tokens = corpus_tokens(tokenizer, corpus_bytes, log)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = published_config(spec, len(tokenizer.vocab), tokenizer.eos_token_id, tokenizer.bos_token_id, pad)
    model = glm4_moe.Model(glm4_moe.ModelArgs.from_dict(config))
    target = wrap_target(model, compiled=False)
    layer = NextnLayer(target, own_embedding=False, own_head=False)
    joint = Joint(model, layer)
    init_small(joint, seed=0)
    spread = np.random.default_rng(2).normal(0.0, FINAL_NORM_SPREAD, spec.hidden_size)
    model.model.norm.weight = mx.array(np.exp(spread).astype(np.float32))
    joint.freeze(keys=["e_score_correction_bias"])  # moved by balance_experts, never by gradients
    probe = {}

    def balance(i, data):
        if i % BALANCE_EVERY == 0:
            probe["loads"] = balance_experts(joint, target, data[:4])
        if i % 200 == 0:
            log("  expert loads: " + "  ".join("/".join(f"{x:.2f}" for x in load) for load in probe["loads"]))

    train_module(joint, lambda j, data: joint_loss(j, target, data), tokens, joint_steps, batch, seq_len, lr=3e-3,
                 name="joint (CE + 0.3 MTP CE)", seed=0, compiled=True, after_step=balance, log=log)
    weight = np.array(model.model.norm.weight)
    log(f"final norm weights: {weight.min():.2f} .. {weight.max():.2f}, std / mean {weight.std() / weight.mean():.2f}")
    if joint_snapshot is not None:
        write_checkpoint(Path(joint_snapshot), model, layer, config, tokenizer_dir)
    if distill_steps:
        model.freeze()
        train_module(layer, lambda m, data: distill_loss(m, target, data), tokens, distill_steps, batch, seq_len,
                     lr=1e-3, name="MTP layer (KL)", seed=1, compiled=True, log=log)
    return write_checkpoint(out, model, layer, config, tokenizer_dir)


def write_checkpoint(out: Path, model: glm4_moe.Model, layer: NextnLayer, config: dict, tokenizer_dir: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), published_tensors(model, layer), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, out)
    return out


# -- acceptance through the decode loop ------------------------------------------------------
# Code prompts the demo trunk continues without falling into a loop of one or two tokens.
CODE_PROMPTS = ["import os\nimport sys\n\n\nclass ", "    def __init__(self, name",
                "class Parser:\n    def parse(self, text):\n", "    for i in range(len(",
                "        if not isinstance(value, str):\n            raise ",
                "def _check_arg(value, name):\n", "        for key, value in self.items():\n"]


def held_out_prompts(tokenizer, count: int = 32, length: int = 24, seed: int = 7) -> list:
    """``count`` prompts of ``length`` tokens, each from a line start in the standard library's
    sources past the training corpus."""
    text = stdlib_corpus(CORPUS_BYTES + 1_000_000)[CORPUS_BYTES:]
    starts = [i + 1 for i in range(len(text) - 200) if text[i] == "\n" and text[i + 1 : i + 5].strip()]
    picked = np.random.default_rng(seed).choice(starts, count, replace=False)
    return [tokenizer.encode(text[i : i + 5 * length])[:length] for i in picked]


def acceptance(target, layer, prompts: list, K: int, temperature: float, max_tokens: int, seed: int = 0):
    """(accepted / drafted, rows) of one batch of requests through the real loop."""
    requests = [Request(p, SamplingParams(temperature=temperature), max_tokens=max_tokens) for p in prompts]
    rows = SpeculativeDecoder(target, layer, draft_tokens=K).generate(requests, seed=seed)
    stats = DecodeStats.pooled(r.stats for r in rows)
    return stats.acceptance_rate, rows


def acceptance_table(directory: Path, max_tokens: int = 64, seeds: int = 3, log=print) -> dict:
    """Acceptance over held-out prompts at K = 1, 2, 3 and T = 0 and 1 (the mean of ``seeds``
    runs), for both chains past depth one; greedy output checked against plain decoding.
    {(chain, K, T): rate}."""
    from ..checkpoint.loading import load_target
    from ..drafters.nextn import load_nextn_layer
    from ..tools.session import run_plain

    model, tokenizer, _ = load_target(directory)
    model.set_dtype(mx.float32)  # mlx's CPU gather_mm (the routed experts) runs float32 only
    target = wrap_target(model)
    prompts = held_out_prompts(tokenizer)
    plain = [run_plain(model, Request(p, max_tokens=max_tokens)).row.generated for p in prompts]
    table = {}
    for chain in ("normed", "raw"):
        layer = load_nextn_layer(directory, target, chain=chain)
        layer.set_dtype(mx.float32)
        for K in (1, 2, 3):
            greedy, rows = acceptance(target, layer, prompts, K, 0.0, max_tokens)
            sampled = [acceptance(target, layer, prompts, K, 1.0, max_tokens, seed=s)[0] for s in range(seeds)]
            table[chain, K, 0.0], table[chain, K, 1.0] = greedy, float(np.mean(sampled))
            log(f"chain {chain:6s}  K={K}  T=0 {greedy:.3f} (greedy == plain: {[r.generated for r in rows] == plain})"
                f"  T=1 {np.mean(sampled):.3f} (seeds: {' '.join(f'{x:.3f}' for x in sampled)})")
    return table
