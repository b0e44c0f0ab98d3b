"""The MTP head that Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next checkpoints ship (``mtp.*``).

One step reads the target's final-normed hidden state h at position t and the token at t + 1:

    x = fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)))
    x = decoder layer (full attention with its own K/V, the trunk's MLP or MoE) ; out = norm(x)
    logits = the target's LM head (out) ; out is the next step's h

(vLLM ``qwen3_next_mtp.py``, mlx-vlm ``qwen3_5_mtp``).  Embedding and LM head are the target's.
The layers are the trunk family's own mlx-lm full-attention decoder layer (``target.decoder_layer``:
Qwen3.5's, or Qwen3-Next's with its MoE, shared expert and shared_expert_gate), built from the
target's config.

The head's K/V cache holds one entry per committed target position: the pair (hidden at t - 1,
token at t) sits at position t (the references use t - 1; RoPE sees only differences, so a
shift shared by every entry changes nothing).  The loop keeps it beside the target's caches, at
the same lengths: each round writes the true pairs of the verified positions (``absorb``) and
commits them with the target's, as vLLM does; what the draft steps wrote is taken back.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.base import create_attention_mask

from ..checkpoint.files import files_holding, read_config, tensors_under
from ..decode import cache as caches
from ..errors import CheckpointError
from ..checkpoint.mtp_tensors import mtp_shard
from .quantized import load_into, per_expert, quantization_under, stacked_quantization

FAMILY = "qwen3_5_mtp"
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.")
# Hugging Face checkpoints store Qwen3.5's RMSNorm weights as offsets from 1 (x * (1 + w)); mlx-lm's
# RMSNorm multiplies by w.  The trunk is shifted by mlx-lm's sanitize; the head's norms here.
NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def head_layers(config: dict) -> int:
    """MTP layers a Qwen3.5 / Qwen3-Next config promises (0: none)."""
    text = config.get("text_config") or config
    count = text.get(layers_key(config))
    if count is None and text.get("model_type", config.get("model_type")) == "qwen3_next":
        return 1  # a Qwen3-Next config need not count it: every release has one (vLLM's default too)
    return int(count or 0)


def layers_key(config: dict) -> str:
    """The config entry that counts the head's layers: Qwen3.5's spelling, or Qwen3-Next's."""
    text = config.get("text_config") or config
    return "mtp_num_hidden_layers" if text.get("mtp_num_hidden_layers") is not None else "num_nextn_predict_layers"


def has_head(config: dict) -> bool:
    text = config.get("text_config") or config
    return text.get("model_type", config.get("model_type")) in MODEL_TYPES and head_layers(config) > 0


class Qwen35MTPHead(nn.Module):
    layer_types: list = []  # reads no target K/V: it keeps its own

    def __init__(self, args, num_layers: int = 1, decoder_layer: type = qwen3_5.DecoderLayer):
        """args: the trunk's mlx-lm config; decoder_layer: its family's decoder layer class."""
        super().__init__()
        H = args.hidden_size
        self.hidden_size = H
        self.vocab_size = args.vocab_size
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        full = args.full_attention_interval - 1  # an index the trunk gives a full-attention layer
        self.layers = [decoder_layer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    # -- the loop's interface for a drafter that keeps its own cache ----------------------------
    def make_cache(self, batch_size: int, slack: int) -> list:
        return caches.make_caches([None] * len(self.layers), batch_size, slack)

    def run_pairs(self, target, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        embedded = self.pre_fc_norm_embedding(target.input_embedding(tokens))
        x = self.fc(mx.concatenate([embedded, self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)

    def absorb(self, target, cache: list, tokens: mx.array, hidden: mx.array) -> None:
        """Write the pairs (hidden[:, i], tokens[:, i]) at the committed lengths onwards (the
        caller commits them); the logits are never computed."""
        self.run_pairs(target, tokens, hidden, cache)

    def step(self, target, token: mx.array, h: mx.array, cache: list):
        """One draft step at the cache's lengths: (logits [B, V], next h [B, 1, H])."""
        out = self.run_pairs(target, token, h, cache)
        return target.head(out)[:, -1], out


def load_built_in_head(model_dir: str | Path, target) -> Qwen35MTPHead:
    """The head a Qwen3.5 / Qwen3-Next checkpoint ships, for ``target`` (the loaded trunk).
    Refused, naming what is missing, when the checkpoint has no MTP tensors or they don't fit."""
    directory = Path(model_dir)
    config = read_config(directory)
    where = f"{directory}"
    layers, key = head_layers(config), layers_key(config)
    text = config.get("text_config") or config
    promise = (f"config.json promises an MTP head ({key}: {layers})" if key in text
               else "a Qwen3-Next checkpoint carries an MTP head (every release has one)")
    if layers != 1:
        raise CheckpointError(f"{where}: {key} is {layers}; omlx-mtp runs Qwen3.5 / Qwen3-Next heads of one layer "
                              "(every published checkpoint has one)")
    weights, prefix = _head_tensors(directory, config)
    if not weights:
        raise CheckpointError(f"{where}: {promise} but no "
                              f"{'/'.join(p + '*' for p in PREFIXES)} tensors were found — the checkpoint was "
                              "converted by a tool that drops them; add them back with `omlx-mtp add-mtp ORIGINAL DIR` "
                              "or requantize with `omlx-mtp quantize`")
    head = Qwen35MTPHead(target.args, layers, getattr(target, "decoder_layer", qwen3_5.DecoderLayer))
    return load_into(head, sanitize(weights, head), stacked_quantization(quantization_under(config, prefix)),
                     f"{where}: the MTP head's tensors do not fit the trunk's config")


def sanitize(weights: dict, head: Qwen35MTPHead) -> dict:
    """Checkpoint names and conventions -> the head's: norms shifted by 1, MoE experts stacked
    (per-expert tensors as Qwen3.5 ships them, or fused gate_up as Qwen3.6 does)."""
    out, experts = {}, {}
    for name, value in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if (expert := per_expert(name)) is not None:
            key, index = expert
            experts.setdefault(key, {})[index] = value
            continue
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("experts.gate_up_proj")]
            mid = value.shape[-2] // 2
            out[base + "switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[base + "switch_mlp.up_proj.weight"] = value[..., mid:, :]
            continue
        if name.endswith("experts.down_proj"):
            out[name[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = value
            continue
        if value.ndim == 1 and name.endswith(NORMS) and mx.issubdtype(value.dtype, mx.floating):
            value = value + 1.0
        out[name] = value
    for key, by_index in experts.items():
        out[key] = mx.stack([by_index[i] for i in sorted(by_index)])
    return out


def _head_tensors(directory: Path, config: dict) -> tuple[dict, str]:
    """The head's tensors with the prefix stripped."""
    weights, prefix = tensors_under(files_holding(directory, PREFIXES, mtp_shard(config)), PREFIXES)
    return weights, prefix or PREFIXES[0]
