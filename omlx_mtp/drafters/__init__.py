"""Drafter families, looked up by the ``model_type`` in a drafter checkpoint's config.json."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import read_config
from ..errors import CheckpointError
from . import gemma4_assistant

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
