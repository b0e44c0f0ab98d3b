"""The built-in MTP layer stored the DeepSeek way ("nextn"): DeepSeek-V3 / V3.1 / V3.2, GLM-4.5 /
4.5-Air / 4.6 / 4.7 and GLM-4.7-Flash.

Config ``num_nextn_predict_layers: 1``; the layer is stored as one more decoder layer,
``model.layers.{num_hidden_layers}.*``.  One step reads the trunk's final-normed hidden state h at
position t and the token at t + 1:

    x = eh_proj(concat(enorm(embed(token)), hnorm(h)))      # embedding first, as the weights are
    x = decoder layer of the trunk's own kind (MoE; MLA for DeepSeek) with its own K/V
    out = shared_head.norm(x) ; logits = shared_head.head(out)

Releases that store the layer's own ``embed_tokens`` / ``shared_head.head`` use them; the others
(GLM-4.6's bf16 release) use the trunk's.  For a depth past one the layer runs again on its own
output (``chain``: the normed ``out`` by default, or the raw ``x``).  V3.2's layer carries a
sparse-attention indexer, which runs as the host's layer runs it.

The decoder layer is the target family's own mlx-lm layer, built and sanitized by the target
(``mtp_decoder_layer``, ``sanitize_layer``), so the family's checkpoint conventions are mlx-lm's.
Its K/V cache works as the Qwen heads' does (``qwen3_5_mtp``): the pair (hidden at t - 1, token at t)
sits at position t, written for every committed position and committed with the target's.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..checkpoint.files import files_holding, read_config, tensor_infos, tensors_under
from ..checkpoint.mtp_tensors import mtp_shard
from ..decode import cache as caches
from ..errors import CheckpointError
from .quantized import load_into, quantization_under, stacked_quantization

FAMILY = "nextn"
MODEL_TYPES = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "deepseek_v32")
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # the rest is the decoder layer
CHAINS = ("normed", "raw")


def nextn_layers(config: dict) -> int:
    text = config.get("text_config") or config
    return int(text.get("num_nextn_predict_layers") or 0)


def has_nextn(config: dict) -> bool:
    return config.get("model_type") in MODEL_TYPES and nextn_layers(config) > 0


class _SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, own_head: bool):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if own_head:
            self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class NextnLayer(nn.Module):
    layer_types: list = []  # reads no target K/V: it keeps its own

    def __init__(self, target, own_embedding: bool, own_head: bool, chain: str = "normed"):
        super().__init__()
        if chain not in CHAINS:
            raise ValueError(f"chain {chain!r}: expected one of {CHAINS}")
        args = target.args
        H, eps = args.hidden_size, args.rms_norm_eps
        self.hidden_size, self.vocab_size = H, args.vocab_size
        self.caches_per_layer = target.caches_per_layer
        self.chain = chain
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(args.vocab_size, H)
        self.block = target.mtp_decoder_layer()
        self.shared_head = _SharedHead(H, args.vocab_size, eps, own_head)

    @property
    def own_embedding(self) -> bool:
        return "embed_tokens" in self

    @property
    def own_head(self) -> bool:
        return "head" in self.shared_head

    # -- the loop's interface for a drafter that keeps its own cache ----------------------------
    def make_cache(self, batch_size: int, slack: int) -> list:
        return caches.make_caches([None] * self.caches_per_layer, batch_size, slack)

    def run_pairs(self, target, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        embedded = self.embed_tokens(tokens) if self.own_embedding else target.input_embedding(tokens)
        x = self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=True)  # MLA layers take only arrays
        return self.block(x, mask, cache[0] if self.caches_per_layer == 1 else cache)

    def absorb(self, target, cache: list, tokens: mx.array, hidden: mx.array) -> None:
        """Write the pairs (hidden[:, i], tokens[:, i]) at the committed lengths onwards (the
        caller commits them); the logits are never computed."""
        self.run_pairs(target, tokens, hidden, cache)

    def step(self, target, token: mx.array, h: mx.array, cache: list):
        """One draft step at the cache's lengths: (logits [B, V], next h [B, 1, H])."""
        x = self.run_pairs(target, token, h, cache)
        out = self.shared_head.norm(x)
        logits = self.shared_head.head(out) if self.own_head else target.head(out)
        return logits[:, -1], out if self.chain == "normed" else x


def load_nextn_layer(model_dir: str | Path, target, chain: str = "normed") -> NextnLayer:
    """The MTP layer a checkpoint ships, for ``target`` (the loaded trunk).  Refused, naming what
    is missing, when config.json promises a layer the shards lack, the layer sits at another index
    than ``num_hidden_layers``, or its tensors don't fit the trunk."""
    directory = Path(model_dir)
    config = read_config(directory)
    layers = nextn_layers(config)
    if layers != 1:
        raise CheckpointError(f"{directory}: num_nextn_predict_layers is {layers}; omlx-mtp runs one MTP layer "
                              "(every published checkpoint has one)")
    index = target.mtp_layer_index
    prefix = f"model.layers.{index}."
    weights, _ = tensors_under(files_holding(directory, (prefix,), mtp_shard(config)), (prefix,))
    if not weights:
        raise CheckpointError(_missing_layer(directory, index))
    own, block = {}, {}
    for name, value in weights.items():
        (own if name.startswith(OWN) else block)[name] = value
    for required in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        if required not in own:
            raise CheckpointError(f"{directory}: {prefix}{required} is missing: model.layers.{index} is not an MTP "
                                  "layer (enorm, hnorm, eh_proj, shared_head.norm) — is num_hidden_layers right?")
    layer = NextnLayer(target, own_embedding="embed_tokens.weight" in own, own_head="shared_head.head.weight" in own,
                       chain=chain)
    sanitized = {**own, **{"block." + name: value for name, value in target.sanitize_layer(block).items()}}
    # oQ writes the layer's experts one by one, each with its own override: the stacked module's
    quantization = stacked_quantization(quantization_under(config, prefix))
    if quantization:
        quantization = {(k if k in ("group_size", "bits", "mode") or (k + ".").startswith(OWN) else "block." + k): v
                        for k, v in quantization.items()}
    return load_into(layer, sanitized, quantization,
                     f"{directory}: the MTP layer model.layers.{index} does not fit the trunk's config")


def _missing_layer(directory: Path, index: int) -> str:
    """Why no MTP layer was found at ``index``: none anywhere, or one at another index."""
    try:
        names = tensor_infos(directory)
    except CheckpointError:
        names = {}
    others = sorted({int(n.split(".")[2]) for n in names
                     if n.startswith("model.layers.") and n.split(".")[2].isdigit() and int(n.split(".")[2]) > index})
    if others:
        return (f"{directory}: config.json puts the MTP layer at model.layers.{index} (num_hidden_layers) but the "
                f"shards hold layers {others} past it: num_hidden_layers does not match the checkpoint")
    return (f"{directory}: config.json promises an MTP layer (num_nextn_predict_layers: 1) but no "
            f"model.layers.{index}.* tensors were found — the checkpoint was converted by a tool that drops it; "
            "add it back with `omlx-mtp add-mtp ORIGINAL DIR` or requantize with `omlx-mtp quantize`")
