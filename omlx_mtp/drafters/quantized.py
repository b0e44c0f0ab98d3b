"""Drafter layers quantized the way the checkpoint that holds them was."""

from __future__ import annotations

import mlx.nn as nn


def quantize_like_checkpoint(drafter: nn.Module, quantization: dict, weights: dict) -> None:
    """Turn layers into quantized ones where the checkpoint holds quantized weights."""

    def predicate(path, module):
        if f"{path}.scales" not in weights:
            return False
        override = quantization.get(path)
        if isinstance(override, dict):
            return override
        return hasattr(module, "to_quantized")

    nn.quantize(
        drafter,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
