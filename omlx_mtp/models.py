"""Loading targets (through mlx-lm) with clear errors for user mistakes."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.utils import load_model, load_tokenizer

from .checkpoint import check_safetensors_header, read_config, safetensors_files
from .errors import CheckpointError
from .gemma4_config import normalize_text_config

SUPPORTED_TARGETS = ("gemma4", "gemma4_text")


def target_config_overrides(config: dict, where: str) -> dict:
    """Config entries to hand mlx-lm so that it reads either Gemma 4 spelling."""
    model_type = config.get("model_type")
    if model_type == "gemma4_text":
        return normalize_text_config(config, where)
    if model_type == "gemma4":
        return {"text_config": normalize_text_config(config.get("text_config") or {}, where)}
    return {}


def load_target(path: str | Path, with_tokenizer: bool = True):
    """Return (model, tokenizer or None, config) for a Gemma 4 checkpoint directory."""
    directory = Path(path)
    config = read_config(directory)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TARGETS:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not supported "
            f"(supported targets: {', '.join(SUPPORTED_TARGETS)})"
        )
    for file in safetensors_files(directory):
        check_safetensors_header(file)
    overrides = target_config_overrides(config, str(directory / "config.json"))
    try:
        model, _ = load_model(directory, model_config=overrides)
    except ValueError as exc:  # mlx-lm reports missing/extra/mis-shaped weights this way
        raise CheckpointError(f"{directory}: weights do not match config.json ({exc})") from None
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = load_tokenizer(directory)
        except Exception as exc:  # transformers raises many kinds here
            raise CheckpointError(f"{directory}: no usable tokenizer ({exc})") from None
    return model, tokenizer, config
