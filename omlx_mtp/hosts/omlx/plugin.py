"""omlx-mtp's implementations of the ``omlx`` hooks (registered through the entry point group "omlx")."""

from __future__ import annotations

import logging
from pathlib import Path

from ...targets import wrap_target
from ...drafters import load_drafter, load_merged_drafter
from ...errors import MTPError
from .hookspecs import hookimpl
from ...checkpoint.mtp_tensors import is_mtp_tensor
from ..settings import DESCRIPTIONS, MTPSettings, file_values, validate
from ..strategy import MTPStrategy

log = logging.getLogger("omlx_mtp")


@hookimpl
def omlx_skip_tensor_in_quantization(name: str, config: dict):
    return False if is_mtp_tensor(name, config) else None


@hookimpl
def omlx_tensor_quantization(name: str, shape: tuple, config: dict):
    # MTP tensors stay unquantized unless the user asks otherwise (omlx-mtp quantize --mtp-bits).
    return False if is_mtp_tensor(name, config) else None


@hookimpl
def omlx_tensors_to_preserve(weights: dict, config: dict) -> dict:
    return {name: value for name, value in weights.items() if is_mtp_tensor(name, config)}


@hookimpl
def omlx_model_settings_schema() -> dict:
    return dict(DESCRIPTIONS)


@hookimpl
def omlx_model_settings(model_id: str, model_path: str | None, base_path: str | None = None):
    try:
        merged, files = file_values(model_id, base_path)
        validate(merged, " + ".join(str(p) for p in files) or model_id)  # the files together
    except MTPError as exc:
        log.warning("MTP settings for %s ignored: %s", model_id, exc)
        return None
    return merged or None  # the keys the files set; the rest keep their defaults


@hookimpl
def omlx_load_drafter(model_id: str, model_path: str, model, settings: dict):
    try:
        parsed = validate(settings, f"settings of {model_id}")
        if not parsed.mtp_enabled:
            return None
        target = wrap_target(model)
        if parsed.mtp_drafter:
            drafter_dir = Path(parsed.mtp_drafter)
            if not drafter_dir.is_absolute():
                drafter_dir = Path(model_path) / drafter_dir
            drafter = load_drafter(drafter_dir, target)
        else:
            drafter = load_merged_drafter(model_path, target)
            if drafter is None:
                raise MTPError(f"{model_path} has neither a built-in MTP head nor a merged assistant, and mtp_drafter is not set")
    except (MTPError, TypeError) as exc:  # TypeError: a model of a family omlx-mtp does not know
        log.warning("MTP disabled for %s: %s", model_id, exc)
        return None
    log.info("MTP drafter loaded for %s", model_id)
    return drafter


@hookimpl
def omlx_decode_strategy(model_id: str, model, drafter, settings: dict):
    if drafter is None:
        return None
    parsed = validate(settings, f"settings of {model_id}")
    if not parsed.mtp_enabled:
        return None
    return MTPStrategy.build(model, drafter, parsed)


__all__ = ["MTPSettings"]
