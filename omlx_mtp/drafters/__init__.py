"""Drafter families: separate checkpoints looked up by the ``model_type`` in their config.json,
assistants merged into a target checkpoint by ``omlx-mtp quantize --assistant``, and the MTP
heads that checkpoints ship."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.files import files_holding, read_config, tensors_under
from ..errors import CheckpointError
from ..checkpoint.mtp_tensors import mtp_shard
from . import gemma4_assistant, nextn, qwen3_5_mtp
from .quantized import quantization_under

LOADERS = {gemma4_assistant.MODEL_TYPE: (gemma4_assistant.load_gemma4_assistant, gemma4_assistant.check_fits)}


def load_drafter(path: str | Path, target):
    """Load a drafter checkpoint and check that it fits ``target`` (a decode.target wrapper)."""
    directory = Path(path)
    model_type = read_config(directory).get("model_type")
    if model_type not in LOADERS:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not a known drafter "
            f"(known: {', '.join(sorted(LOADERS))})"
        )
    load, check_fits = LOADERS[model_type]
    drafter = load(directory)
    check_fits(drafter, target, where=f"drafter {directory}")
    return drafter


def merged_assistant_config(config: dict) -> tuple[dict, str] | None:
    """(assistant config, tensor name prefix) of an assistant merged into a target checkpoint."""
    if config.get("model_type") == "gemma4":
        embedded = (config.get("text_config") or {}).get("mtp_assistant_config")
        return (embedded, "language_model.mtp.") if embedded else None
    embedded = config.get("mtp_assistant_config")
    return (embedded, "mtp.") if embedded else None


def load_merged_drafter(model_dir: str | Path, target):
    """The drafter inside ``model_dir``: the MTP head or layer the checkpoint ships (Qwen3.5/3.6,
    GLM-4.x, DeepSeek-V3.x) or an
    assistant merged in by ``omlx-mtp quantize --assistant``; None when there is neither."""
    directory = Path(model_dir)
    config = read_config(directory)
    if qwen3_5_mtp.has_head(config):
        return qwen3_5_mtp.load_built_in_head(directory, target)  # built from the trunk's own config
    if nextn.has_nextn(config):
        return nextn.load_nextn_layer(directory, target)
    merged = merged_assistant_config(config)
    if merged is None:
        return None
    assistant_config, prefix = merged
    weights, _ = tensors_under(files_holding(directory, (prefix,), mtp_shard(config)), (prefix,))
    if not weights:
        raise CheckpointError(f"{directory}: config.json embeds an assistant but no {prefix}* tensors were found")
    drafter = gemma4_assistant.build_gemma4_assistant(assistant_config, weights, quantization_under(config, prefix),
                                                      str(directory))
    gemma4_assistant.check_fits(drafter, target, where=f"assistant merged into {directory}")
    return drafter
