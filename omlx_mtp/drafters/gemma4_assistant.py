"""Google's Gemma 4 "assistant" MTP drafter (``model_type: gemma4_assistant``).

The assistant has no K/V projections: its layers attend to the target's K/V (per layer type,
the last target layer of that type that owns K/V).  One draft step:

    x = pre_projection(concat(target_embed(token) * sqrt(backbone), h_prev))
    x = layers(x) ; normed = norm(x)
    logits = tied head (or centroid-routed head) ; h_next = post_projection(normed)

Its decoder layers are mlx-lm's own Gemma 4 layers with every layer K/V-shared.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from ..checkpoint.files import load_weights, read_config
from ..errors import CheckpointError, DrafterMismatchError
from .quantized import load_into
from ..checkpoint.gemma4_config import FULL, SLIDING, layer_head_dim, layer_kv_heads, normalize_text_config, text_config_of

MODEL_TYPE = "gemma4_assistant"
TARGET_TYPES = ("gemma4", "gemma4_text")  # the checkpoints an assistant drafts for


class CentroidHead(nn.Module):
    """Scores only the tokens of the top-k centroids; every other token gets -inf, so a
    distribution drawn from these logits puts no mass where it was never computed."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        self.num_centroids = num_centroids
        self.top_k = top_k
        self.per_centroid = vocab_size // num_centroids
        self.vocab_size = vocab_size
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab_size,), dtype=mx.int32)

    def __call__(self, hidden: mx.array, embedding: nn.Module) -> mx.array:
        scores = self.centroids(hidden)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        table = self.token_ordering.reshape(self.num_centroids, self.per_centroid)
        tokens = table[top].reshape(*hidden.shape[:-1], self.top_k * self.per_centroid)
        rows = embedding(tokens)  # works for dense and quantized embeddings alike
        picked = (rows @ hidden[..., :, None]).squeeze(-1)
        full = mx.full((*hidden.shape[:-1], self.vocab_size), -mx.inf, dtype=picked.dtype)
        return mx.put_along_axis(full, tokens, picked, axis=-1)


class _Body(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4AssistantDrafter(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        text = dict(config["text_config"])
        text.update(
            num_kv_shared_layers=text["num_hidden_layers"],
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            enable_moe_block=False,
            use_double_wide_mlp=False,
        )
        self.config = config
        self.args = gemma4_text.ModelArgs.from_dict(text)
        self.backbone_hidden_size = int(config["backbone_hidden_size"])
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.model = _Body(self.args)
        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, self.hidden_size, bias=False)
        self.post_projection = nn.Linear(self.hidden_size, self.backbone_hidden_size, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = CentroidHead(
                self.hidden_size,
                self.vocab_size,
                int(config.get("num_centroids", 2048)),
                int(config.get("centroid_intermediate_top_k", 32)),
            )
        else:
            self.masked_embedding = None

    @property
    def layer_types(self) -> list[str]:
        return list(self.args.layer_types)

    def visible_span(self, layer_type: str, target_window: int) -> int | None:
        """How many of the latest committed target positions a layer reads (None: all).
        transformers' reference lets sliding layers see the last window + 1 positions
        (a bidirectional window around the drafter's query); we follow the reference."""
        return target_window + 1 if layer_type == SLIDING else None

    def head(self, normed: mx.array) -> mx.array:
        if self.masked_embedding is not None:
            return self.masked_embedding(normed, self.model.embed_tokens)
        return self.model.embed_tokens.as_linear(normed)

    def __call__(self, token_embedding, h_prev, shared_kv: dict, masks: dict, query_position):
        """One draft step.  token_embedding, h_prev: [B, 1, backbone]; shared_kv/masks per layer
        type; query_position: int or [B] array.  Returns (logits [B, 1, V], h_next [B, 1, backbone])."""
        x = self.pre_projection(mx.concatenate([token_embedding, h_prev], axis=-1))
        for layer in self.model.layers:
            kind = layer.layer_type
            x, _, _ = layer(x, masks[kind], None, shared_kv=shared_kv[kind], offset=query_position)
        normed = self.model.norm(x)
        return self.head(normed), self.post_projection(normed)

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for name, value in weights.items():
            if name == "lm_head.weight":  # tied to model.embed_tokens
                continue
            if name.endswith("self_attn.rotary_emb.inv_freq"):
                continue
            if name == "masked_embedding.token_ordering":
                value = value.astype(mx.int32)
            out[name] = value
        return out


def normalize_assistant_config(config: dict, where: str) -> dict:
    if config.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{where}: model_type {config.get('model_type')!r} is not a drafter ({MODEL_TYPE} expected)")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: {MODEL_TYPE} config has no text_config")
    if "backbone_hidden_size" not in config:
        raise CheckpointError(f"{where}: {MODEL_TYPE} config has no backbone_hidden_size")
    out = dict(config)
    out["text_config"] = normalize_text_config(text, where)
    if out.get("use_ordered_embeddings"):
        vocab = int(out["text_config"].get("vocab_size", 262144))
        centroids = int(out.get("num_centroids", 2048))
        if vocab % centroids:
            raise CheckpointError(
                f"{where}: vocab_size {vocab} is not a multiple of num_centroids {centroids} "
                "(the centroid head needs equal-sized clusters; pad the vocabulary)"
            )
    return out


def _target_kind(target) -> str:
    """The target's model_type as its checkpoint spells it (mlx-lm keeps it in ``args``, mlx-vlm in
    ``config``), else its family's name."""
    for holder in ("args", "config"):
        kind = getattr(getattr(target.model, holder, None), "model_type", None)
        if isinstance(kind, str):
            return kind
    return target.family


def check_fits(drafter: Gemma4AssistantDrafter, target, where: str = "drafter") -> None:
    """Refuse a drafter that was not made for this target, naming both numbers."""
    if not hasattr(target, "kv_owner"):
        # The assistant attends to a Gemma 4 target's own K/V (kv_owner maps its layer types to
        # them); another family has none to lend, so the numbers below would not even be defined.
        raise DrafterMismatchError(
            f"{where} does not fit the target: a {MODEL_TYPE} drafts for Gemma 4 targets; this target is "
            f"{_target_kind(target)} ({target.family}); leave the drafter out to use the checkpoint's own MTP "
            "head or layer, where it ships one")
    problems = []
    if drafter.backbone_hidden_size != target.hidden_size:
        problems.append(
            f"backbone_hidden_size {drafter.backbone_hidden_size} != target hidden_size {target.hidden_size}"
        )
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.vocab_size} != target vocab_size {target.vocab_size}")
    drafter_args = vars(drafter.args)
    target_args = vars(target.args)
    for kind in sorted(set(drafter.layer_types)):
        if kind not in target.kv_owner:
            problems.append(f"drafter has {kind} layers but the target has no {kind} layer that owns K/V")
            continue
        d_dim, t_dim = layer_head_dim(drafter_args, kind), layer_head_dim(target_args, kind)
        if d_dim != t_dim:
            problems.append(f"{kind} head_dim {d_dim} != target {t_dim}")
        t_heads = layer_kv_heads(target_args, kind)
        if drafter.args.num_attention_heads % t_heads:
            problems.append(
                f"{kind}: {drafter.args.num_attention_heads} query heads are not a multiple of the target's {t_heads} K/V heads"
            )
    if SLIDING in drafter.layer_types and drafter.args.sliding_window != target.sliding_window:
        problems.append(f"sliding_window {drafter.args.sliding_window} != target sliding_window {target.sliding_window}")
    if problems:
        raise DrafterMismatchError(f"{where} does not fit the target: " + "; ".join(problems))


def check_config_fits(config: dict, assistant: dict, where: str) -> None:
    """The config-level twin of ``check_fits``, for a target that is not loaded (quantize, add-mtp):
    the quick refusals; the validation pass then checks the loaded pair with ``check_fits``."""
    if config.get("model_type") not in TARGET_TYPES:
        raise DrafterMismatchError(f"{where} does not fit the target: a {MODEL_TYPE} drafts for Gemma 4 targets "
                                   f"({', '.join(TARGET_TYPES)}); this target is {config.get('model_type')!r}")
    text = text_config_of(config)
    problems = []
    if int(assistant["backbone_hidden_size"]) != int(text.get("hidden_size", -1)):
        problems.append(f"backbone_hidden_size {assistant['backbone_hidden_size']} != target hidden_size "
                        f"{text.get('hidden_size')}")
    a_vocab = assistant["text_config"].get("vocab_size")
    if a_vocab != text.get("vocab_size", config.get("vocab_size")):
        problems.append(f"vocab_size {a_vocab} != target vocab_size {text.get('vocab_size', config.get('vocab_size'))}")
    if problems:
        raise DrafterMismatchError(f"{where} does not fit the target: " + "; ".join(problems))


def load_gemma4_assistant(path: str | Path) -> Gemma4AssistantDrafter:
    directory = Path(path)
    config = read_config(directory)
    return build_gemma4_assistant(config, load_weights(directory), config.get("quantization"), str(directory))


def build_gemma4_assistant(config: dict, weights: dict, quantization: dict | None, where: str):
    """A drafter from its config and (possibly quantized) weights, named as in its checkpoint."""
    drafter = Gemma4AssistantDrafter(normalize_assistant_config(config, f"{where}: assistant config"))
    return load_into(drafter, drafter.sanitize(weights), quantization,
                     f"{where}: assistant weights do not match its config")


__all__ = [
    "MODEL_TYPE",
    "FULL",
    "SLIDING",
    "Gemma4AssistantDrafter",
    "check_fits",
    "check_config_fits",
    "load_gemma4_assistant",
    "build_gemma4_assistant",
    "normalize_assistant_config",
]
