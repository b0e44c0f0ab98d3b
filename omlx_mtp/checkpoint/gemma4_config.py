"""Gemma 4 text configs come in two spellings; mlx-lm reads only the first.

* original release: ``head_dim``/``num_key_value_heads`` for sliding layers and
  ``global_head_dim``/``num_global_key_value_heads`` for full-attention layers;
* transformers >= 5.2x: base values plus ``per_layer_config: {"<layer>": {"head_dim": .., ...}}``.

``normalize_text_config`` turns either into the first, refusing what mlx-lm cannot represent.
"""

from __future__ import annotations

from ..errors import CheckpointError

SLIDING = "sliding_attention"
FULL = "full_attention"

# Gemma 4's RoPE: default on sliding layers; proportional, a quarter of the dims rotated, on full layers.
GEMMA4_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def default_layer_types(config: dict) -> list[str]:
    layers = int(config.get("num_hidden_layers", 35))
    pattern = int(config.get("sliding_window_pattern", 5))
    cycle = [SLIDING] * (pattern - 1) + [FULL]
    return (cycle * (layers // len(cycle) + 1))[:layers]


def normalize_text_config(config: dict, where: str = "config") -> dict:
    """Return a copy in the original spelling, with ``layer_types`` spelled out."""
    out = dict(config)
    out.setdefault("layer_types", default_layer_types(out))
    per_layer = out.pop("per_layer_config", None) or {}
    if not per_layer:
        return out
    base = {"head_dim": out.get("head_dim", 256), "num_key_value_heads": out.get("num_key_value_heads", 1)}
    by_type: dict[str, dict[str, set]] = {SLIDING: {}, FULL: {}}
    for index, layer_type in enumerate(out["layer_types"]):
        override = per_layer.get(str(index), per_layer.get(index, {})) or {}
        for key in base:
            by_type[layer_type].setdefault(key, set()).add(override.get(key, base[key]))
    for key, values in by_type[SLIDING].items():
        if values != {base[key]}:
            raise CheckpointError(
                f"{where}: per_layer_config gives sliding layers {key} {sorted(values)}; "
                f"only full-attention layers may differ from the base value {base[key]}"
            )
    for key, values in by_type[FULL].items():
        if len(values) > 1:
            raise CheckpointError(f"{where}: per_layer_config gives full-attention layers mixed {key} {sorted(values)}")
    if by_type[FULL]:
        out["global_head_dim"] = next(iter(by_type[FULL]["head_dim"]))
        full_kv_heads = next(iter(by_type[FULL]["num_key_value_heads"]))
        if full_kv_heads != base["num_key_value_heads"]:
            if not out.get("attention_k_eq_v"):
                raise CheckpointError(
                    f"{where}: full-attention layers have {full_kv_heads} K/V heads and sliding layers "
                    f"{base['num_key_value_heads']}; mlx-lm supports that only with attention_k_eq_v"
                )
            out["num_global_key_value_heads"] = full_kv_heads
    return out


def text_config_of(config: dict) -> dict:
    """The text config of a gemma4 (multimodal) or gemma4_text checkpoint config."""
    if config.get("model_type") == "gemma4_text":
        return config
    return config.get("text_config") or {}


def layer_head_dim(config: dict, layer_type: str) -> int:
    if layer_type == FULL and config.get("global_head_dim"):
        return int(config["global_head_dim"])
    return int(config.get("head_dim", 256))


def layer_kv_heads(config: dict, layer_type: str) -> int:
    if layer_type == FULL and config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
        return int(config["num_global_key_value_heads"])
    return int(config.get("num_key_value_heads", 1))
