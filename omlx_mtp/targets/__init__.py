"""Target model families, one module each, behind the one interface of ``base.Target``.

``wrap_target`` finds the family of a host's model object (an mlx-lm or mlx-vlm model, or oMLX's
VLM adapter around one) and wraps it without copying weights.  A new family is one module here and
one entry in FAMILIES."""

from __future__ import annotations

from ..errors import MTPError
from .base import Target
from .deepseek_v3 import DeepseekV3Target, DeepseekV32Target
from .gemma4_mlx_lm import Gemma4MlxLmTarget
from .gemma4_mlx_vlm import Gemma4MlxVlmTarget
from .glm4_moe import Glm4MoeTarget
from .qwen3_5_mlx_lm import Qwen35MlxLmTarget
from .qwen3_5_mlx_vlm import Qwen35MlxVlmTarget
from .qwen3_next import Qwen3NextMlxLmTarget

FAMILIES: tuple[type[Target], ...] = (Gemma4MlxLmTarget, Gemma4MlxVlmTarget, Qwen35MlxLmTarget, Qwen35MlxVlmTarget,
                                      Glm4MoeTarget, DeepseekV3Target, DeepseekV32Target, Qwen3NextMlxLmTarget)


class UnsupportedTarget(MTPError):
    """The host's model is of a family no target module knows."""


def host_model(model):
    """The model inside a host wrapper: oMLX's VLMModelAdapter keeps mlx-vlm's model as ``_vlm_model``."""
    return getattr(model, "_vlm_model", model)


def wrap_target(model, compiled: bool | None = None) -> Target:
    model = host_model(model)
    for family in FAMILIES:
        if family.matches(model):
            return family(model, compiled=compiled)
    text = getattr(model, "language_model", model)
    raise UnsupportedTarget(
        f"{type(text).__module__}.{type(text).__name__} is not a model family omlx-mtp drafts for "
        f"(known: {', '.join(f.family for f in FAMILIES)})"
    )


__all__ = ["FAMILIES", "DeepseekV3Target", "DeepseekV32Target", "Glm4MoeTarget", "Gemma4MlxLmTarget", "Gemma4MlxVlmTarget", "Qwen35MlxLmTarget", "Qwen35MlxVlmTarget", "Qwen3NextMlxLmTarget", "Target", "UnsupportedTarget", "host_model", "wrap_target"]
