"""DeepSeek-V3 / V3.1 (mlx-lm ``deepseek_v3``) and DeepSeek-V3.2 (``deepseek_v32``): MLA attention,
whose cache holds the compressed latents and the RoPE keys, and a MoE past ``first_k_dense_replace``.
A V3.2 layer keeps a second cache for its sparse-attention indexer's keys (mlx-lm's ``CacheList``
of two); both caches of a layer move with the same positions.  mlx-lm's model runs unchanged."""

from __future__ import annotations

from mlx_lm.models import deepseek_v3, deepseek_v32

from .attention_stack import AttentionStackTarget


class DeepseekV3Target(AttentionStackTarget):
    family = "DeepSeek-V3 (mlx-lm)"
    model_classes = (deepseek_v3.Model,)


class DeepseekV32Target(AttentionStackTarget):
    family = "DeepSeek-V3.2 (mlx-lm)"
    model_classes = (deepseek_v32.Model,)
    caches_per_layer = 2
