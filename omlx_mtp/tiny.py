"""Tiny Gemma-4-shaped checkpoints with random weights, in the Hugging Face layout.

Used by the tests and by ``omlx-mtp demo`` when no trained pair is available.  Weights follow
the advice of DESIGN §8: small embeddings and strong layer matrices, so greedy paths wander
through many tokens instead of repeating the last one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text

from .drafters.gemma4_assistant import Gemma4AssistantDrafter, normalize_assistant_config
from .gemma4_config import FULL, GEMMA4_ROPE, SLIDING, normalize_text_config

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass
class TinySpec:
    layout: str = "31b"  # "31b": every layer owns K/V; "e2b": K/V-shared layers + per-layer inputs
    model_type: str = "gemma4_text"  # or "gemma4" (multimodal wrapper, language_model.* names)
    spelling: str = "original"  # or "per_layer" (transformers >= 5.2x per_layer_config)
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 5
    sliding_window: int = 16
    head_dim: int = 16
    global_head_dim: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    k_eq_v: bool = False  # 31B style: full layers use K as V, with their own K/V head count
    drafter_hidden: int = 32
    drafter_layers: int = 2
    centroid_head: bool = False
    num_centroids: int = 16
    centroid_top_k: int = 4
    embed_std: float = 0.02
    layer_std: float = 0.3
    dtype: str = "float32"


def target_text_config(spec: TinySpec) -> dict:
    types = ([SLIDING] * 2 + [FULL]) * spec.num_layers
    types = types[: spec.num_layers]
    types[-1] = FULL  # transformers requires the last layer to be full attention
    config = {
        "model_type": "gemma4_text",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": 2 * spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "sliding_window": spec.sliding_window,
        "layer_types": types,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "attention_k_eq_v": spec.k_eq_v,
        "enable_moe_block": False,
        "max_position_embeddings": 4096,
        "rope_parameters": dict(GEMMA4_ROPE),
    }
    if spec.layout == "e2b":
        config.update(
            num_kv_shared_layers=max(2, spec.num_layers // 2),
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=spec.vocab_size,
            use_double_wide_mlp=True,
        )
    else:
        config.update(num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                      use_double_wide_mlp=False)
    return _spell(config, spec)


def assistant_config(spec: TinySpec) -> dict:
    types = ([SLIDING] * (spec.drafter_layers - 1) + [FULL])[: spec.drafter_layers]
    text = {
        "model_type": "gemma4_text",
        "hidden_size": spec.drafter_hidden,
        "num_hidden_layers": spec.drafter_layers,
        "intermediate_size": 2 * spec.drafter_hidden,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "sliding_window": spec.sliding_window,
        "layer_types": types,
        "rms_norm_eps": 1e-6,
        "num_kv_shared_layers": spec.drafter_layers,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "rope_parameters": dict(GEMMA4_ROPE),
    }
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": spec.hidden_size,
        "use_ordered_embeddings": spec.centroid_head,
        "num_centroids": spec.num_centroids,
        "centroid_intermediate_top_k": spec.centroid_top_k,
        "tie_word_embeddings": True,
        "text_config": _spell(text, spec),
    }


def _spell(config: dict, spec: TinySpec) -> dict:
    full = {"head_dim": spec.global_head_dim}
    if config.get("attention_k_eq_v"):
        full["num_key_value_heads"] = 1
    if spec.spelling == "per_layer":
        config["per_layer_config"] = {str(i): dict(full) for i, t in enumerate(config["layer_types"]) if t == FULL}
    else:
        config["global_head_dim"] = full["head_dim"]
        if "num_key_value_heads" in full:
            config["num_global_key_value_heads"] = full["num_key_value_heads"]
    return config


def randomize(module: nn.Module, spec: TinySpec, rng: np.random.Generator) -> dict:
    weights = {}
    for name, value in tree_flatten(module.parameters()):
        if name.endswith("embed_tokens.weight") or name.endswith("embed_tokens_per_layer.weight"):
            array = rng.normal(0.0, spec.embed_std, value.shape)
        elif value.ndim >= 2:
            array = rng.normal(0.0, spec.layer_std, value.shape)
        elif "norm" in name:
            array = 1.0 + rng.normal(0.0, 0.1, value.shape)
        else:
            array = np.ones(value.shape)
        weights[name] = mx.array(array.astype(np.float32)).astype(getattr(mx, spec.dtype))
    return weights


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level tokenizer (no merges), padded with unused tokens to the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} byte-level tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS + [t for t in vocab if t.startswith("<unused")])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def rename_tokens(path: Path, ids: dict[str, int]) -> None:
    """Give the tokens at these ids of a tokenizer.json these names (special tokens now); merges that
    made the old tokens go, so no text encodes to them."""
    by_id = {i: token for token, i in ids.items()}
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    renamed = {name for name, i in vocab.items() if i in by_id}
    for name in renamed:
        del vocab[name]
    vocab.update(ids)
    merges = data["model"].get("merges") or []
    data["model"]["merges"] = [m for m in merges
                               if "".join(m if isinstance(m, list) else m.split(" ")) not in renamed]
    added = {entry["id"]: entry for entry in data["added_tokens"]}
    for i, token in by_id.items():
        if i in added:
            added[i]["content"] = token
        else:
            data["added_tokens"].append({"id": i, "content": token, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(data, ensure_ascii=False))


def write_target(directory: Path, spec: TinySpec, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = target_text_config(spec)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(normalize_text_config(text)))
    weights = model.sanitize(randomize(model, spec, np.random.default_rng(seed)))
    if spec.model_type == "gemma4":
        weights = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
        config = {"model_type": "gemma4", "vocab_size": spec.vocab_size, "text_config": text}
    else:
        config = dict(text)
    config.update(eos_token_id=1, bos_token_id=2, pad_token_id=0, torch_dtype=spec.dtype)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if spec.vocab_size >= len(SPECIAL_TOKENS) + 256:  # smaller vocabularies are for id-level tests
        write_tokenizer(directory, spec.vocab_size)
    return directory


def write_assistant(directory: Path, spec: TinySpec, seed: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = assistant_config(spec)
    drafter = Gemma4AssistantDrafter(normalize_assistant_config(config, "tiny"))
    rng = np.random.default_rng(seed)
    weights = randomize(drafter, spec, rng)
    if spec.centroid_head:
        ordering = rng.permutation(spec.vocab_size).astype(np.int64)
        weights["masked_embedding.token_ordering"] = mx.array(ordering)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_pair(directory: Path, spec: TinySpec | None = None, seed: int = 0) -> tuple[Path, Path]:
    spec = spec or TinySpec()
    directory = Path(directory)
    return write_target(directory / "target", spec, seed), write_assistant(directory / "assistant", spec, seed + 1)
