"""One registry of the tensor names that hold MTP (multi-token-prediction) weights, per model family.

Quantizers and model sanitizers tend to drop these with scattered substring checks; every place in
omlx-mtp that needs to know asks ``is_mtp_tensor`` instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class MTPFamily:
    name: str
    matches: Callable[[str, dict], bool]


def _prefix(pattern: str) -> Callable[[str, dict], bool]:
    regex = re.compile(pattern)
    return lambda name, config: regex.search(name) is not None


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def _extra_decoder_layers(name: str, config: dict) -> bool:
    """DeepSeek-V3 style: MTP modules are extra decoder layers numbered >= num_hidden_layers."""
    text = _text_config(config)
    if not text.get("num_nextn_predict_layers"):
        return False
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= int(text.get("num_hidden_layers", 1 << 30))


FAMILIES = [
    # Qwen3.5/3.6, Qwen3-Next, ExaOne-MoE, Nemotron-H, Kimi; Gemma 4 merged assistant (mtp.* / language_model.mtp.*)
    MTPFamily("mtp-module", _prefix(r"(?:^|\.)mtp\.")),
    MTPFamily("mimo", _prefix(r"(?:^|\.)mtp_layers\.")),
    MTPFamily("ernie", _prefix(r"(?:^|\.)mtp_(?:block|linear_proj|emb_norm|hidden_norm)\.")),
    MTPFamily("deepseek-v3", _extra_decoder_layers),
]


def mtp_family(name: str, config: dict) -> str | None:
    """The family whose MTP naming ``name`` follows, or None for a trunk tensor."""
    for family in FAMILIES:
        if family.matches(name, config):
            return family.name
    return None


def is_mtp_tensor(name: str, config: dict | None = None) -> bool:
    return mtp_family(name, config or {}) is not None


def mtp_shard(config: dict) -> str:
    """Where a checkpoint written here keeps its MTP tensors, relative to its directory.  Beside
    the trunk for text checkpoints (mlx-lm loads ``model*.safetensors`` only; the index lists the
    file); in a sub-directory, left out of the index, for multimodal ones: mlx-vlm loads every
    ``*.safetensors`` beside config.json and every shard its index names, and refuses tensors its
    model has no place for."""
    multimodal = bool(config.get("vision_config") or config.get("audio_config"))
    return "mtp/mtp.safetensors" if multimodal else "mtp.safetensors"
