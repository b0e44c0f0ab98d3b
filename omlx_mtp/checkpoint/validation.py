"""The one validation pass every command runs before it writes or decodes.

A checkpoint is checked by loading it the way ``generate`` loads it — config, index, every
shard's header, the trunk through mlx-lm's (or mlx-vlm's) model with every tensor it reads
present at the shape its config implies, the MTP tensors through the drafter that reads them,
and a paired drafter against the target — but lazily: no tensor's bytes are read, so the pass
costs the headers and the model's construction whatever the checkpoint's size.  ``quantize``,
``add-mtp`` and ``inspect`` run it; ``generate``, ``bench``, ``serve`` and the oMLX plugin run the
same loaders for real, so ``inspect`` says a drafter fits exactly when ``generate`` drafts with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..drafters import gemma4_assistant, load_drafter, load_merged_drafter
from ..drafters.quantized import weights_unread
from ..errors import MTPError
from ..targets import wrap_target
from .files import read_config
from .loading import SUPPORTED_TARGETS, load_plain, load_target


@dataclass
class Loadable:
    """What a checkpoint that passed loads as: the target family and its drafter's kind (None: none)."""

    family: str
    drafter: str | None


def check_loads(model_dir: str | Path, drafter_dir: str | Path | None = None, merged: bool = True) -> Loadable:
    """Load ``model_dir`` (and ``drafter_dir``, or the drafter the checkpoint carries when ``merged``)
    without reading a weight; MTPError names the first problem.  A standalone assistant checkpoint
    is checked on its own; a model of a family no drafter reads, as mlx-lm loads it."""
    model_type = read_config(model_dir).get("model_type")
    with weights_unread():
        if model_type == gemma4_assistant.MODEL_TYPE and drafter_dir is None:
            gemma4_assistant.load_gemma4_assistant(model_dir)
            return Loadable(model_type, None)
        if model_type not in SUPPORTED_TARGETS and drafter_dir is None:
            load_plain(model_dir)
            return Loadable(str(model_type), None)
        model, _, _ = load_target(model_dir, with_tokenizer=False, lazy=True)
        target = wrap_target(model)
        if drafter_dir is not None:
            drafter = load_drafter(drafter_dir, target)
        elif merged:
            drafter = load_merged_drafter(model_dir, target)
        else:
            drafter = None
    return Loadable(target.family, None if drafter is None else type(drafter).__name__)


def problem(model_dir: str | Path, drafter_dir: str | Path | None = None, merged: bool = True) -> str | None:
    """``check_loads``' problem as a sentence, or None when the checkpoint loads."""
    try:
        check_loads(model_dir, drafter_dir, merged)
    except MTPError as exc:
        return str(exc)
    return None
