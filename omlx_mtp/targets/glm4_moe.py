"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (mlx-lm ``glm4_moe``: GQA attention, partial RoPE, MoE past
``first_k_dense_replace``) and GLM-4.7-Flash (``glm4_moe_lite``: MLA attention).  mlx-lm's model
runs unchanged; what they share with DeepSeek-V3.x is in ``attention_stack``."""

from __future__ import annotations

from mlx_lm.models import glm4_moe, glm4_moe_lite

from .attention_stack import AttentionStackTarget


class Glm4MoeTarget(AttentionStackTarget):
    family = "GLM-4.x MoE (mlx-lm)"
    model_classes = (glm4_moe.Model, glm4_moe_lite.Model)
