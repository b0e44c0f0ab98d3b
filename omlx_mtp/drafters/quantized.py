"""Drafter layers quantized the way the checkpoint that holds them was."""

from __future__ import annotations

import contextlib
import contextvars

import mlx.core as mx
import mlx.nn as nn

from ..errors import CheckpointError

# Inside ``weights_unread`` drafters are built and their weights checked, not read (validation).
_UNREAD = contextvars.ContextVar("omlx_mtp_weights_unread", default=False)


@contextlib.contextmanager
def weights_unread():
    """Drafters loaded here check every weight's name and shape but read none (``mx.load`` is lazy)."""
    token = _UNREAD.set(True)
    try:
        yield
    finally:
        _UNREAD.reset(token)


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


def quantization_under(config: dict, prefix: str) -> dict | None:
    """The checkpoint's quantization as it applies to the tensors under ``prefix``: the defaults and
    the per-module overrides of those tensors, named without the prefix."""
    q = config.get("quantization")
    if not q:
        return None
    out = {k: q[k] for k in ("group_size", "bits", "mode") if k in q}
    out.update({k[len(prefix):]: v for k, v in q.items() if k.startswith(prefix)})
    return out


def load_into(drafter: nn.Module, weights: dict, quantization: dict | None, mismatch: str) -> nn.Module:
    """Quantize the drafter like its checkpoint, load its (sanitized) weights strictly and evaluate
    them; ``mismatch`` starts the error when the weights do not fit."""
    if quantization:
        quantize_like_checkpoint(drafter, quantization, weights)
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise CheckpointError(f"{mismatch} ({exc})") from None
    drafter.eval()
    if not _UNREAD.get():
        mx.eval(drafter.parameters())
    return drafter


def per_expert(name: str) -> tuple[str, int] | None:
    """(the stacked name, the expert) of a per-expert tensor or module path, ``experts.{e}.*``."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts")
        if i + 2 < len(parts) and parts[i + 1].isdigit():
            return ".".join(parts[:i] + ["switch_mlp"] + parts[i + 2 :]), int(parts[i + 1])
    return None


def stacked_quantization(quantization: dict | None) -> dict | None:
    """Per-module overrides a quantizer wrote for per-expert tensors (``--mtp-bits``), under the
    stacked module the head loads them into; the experts of one module are quantized alike."""
    if not quantization:
        return quantization
    return {(per_expert(path) or (path,))[0]: value for path, value in quantization.items()}
