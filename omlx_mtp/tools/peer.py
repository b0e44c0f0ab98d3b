"""The peer: mlx-vlm's own Gemma 4 MTP speculative decoding, run on the same weights as ours.

``omlx-mtp bench`` uses it to put mlx-vlm's tok/s next to ours. mlx-vlm is optional (it is not a
dependency of this package); install it in its own environment, e.g.
``pip install -e . "mlx-vlm==0.7.10"`` (written against 0.7.10).

mlx-vlm cannot read our checkpoints as they are (DESIGN §9):

* its ``gemma4_text`` model returns no hidden states, so the target must be a ``gemma4`` (VLM-style)
  checkpoint: we wrap the text config as ``text_config`` and name the weights
  ``language_model.model.*``; no vision weights are written, so mlx-vlm drops its vision tower;
* it reads neither transformers' ``per_layer_config`` spelling nor the defaults mlx-lm fills in for
  absent keys (its own defaults differ, e.g. ``use_double_wide_mlp``), so every text config is
  written out in full, as mlx-lm reads it.

Tensor values are copied unchanged (quantized tensors included), so both engines run the same model;
the copies take as much disk as the checkpoints. mlx-vlm is imported only inside the functions here.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma4_text

from ..checkpoint.files import load_weights, read_config
from ..drafters import merged_assistant_config
from ..drafters.gemma4_assistant import normalize_assistant_config
from ..errors import CheckpointError
from ..checkpoint.gemma4_config import normalize_text_config, text_config_of
from ..checkpoint.loading import SUPPORTED_TARGETS

TESTED_VERSION = "0.7.10"

# A vision tower as small as mlx-vlm will build; it is dropped at load because no weights name it.
_TINY_VISION = {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 8, "patch_size": 2,
                "position_embedding_size": 4, "pooling_kernel_size": 1, "default_output_length": 1}


def peer_available() -> str | None:
    """None when mlx-vlm's MTP can run here, else one line saying why not."""
    try:
        import mlx_vlm

        for module in ("mlx_vlm.generate.ar", "mlx_vlm.speculative.drafters", "mlx_vlm.speculative.utils",
                       "mlx_vlm.utils"):  # the entry points used below
            importlib.import_module(module)
    except ImportError as exc:
        return f"mlx-vlm is not usable here ({exc}); pip install 'mlx-vlm=={TESTED_VERSION}'"
    version = getattr(mlx_vlm, "__version__", "?")
    if version.split(".")[:2] != TESTED_VERSION.split(".")[:2]:
        return f"mlx-vlm {version} is installed; the peer adapter is written for mlx-vlm {TESTED_VERSION}"
    return None


@dataclass
class Peer:
    model: object  # mlx-vlm gemma4 Model
    drafter: object  # mlx-vlm Gemma4AssistantDraftModel
    target_dir: Path  # the converted copies mlx-vlm loaded
    assistant_dir: Path
    version: str


def prepare_peer(target_dir, assistant_dir, workdir) -> Peer:
    """Write mlx-vlm-readable copies of the pair under ``workdir`` and load them with mlx-vlm, once.

    ``assistant_dir`` None: use the assistant merged into the target checkpoint."""
    reason = peer_available()
    if reason:
        raise RuntimeError(reason)
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    target_dir, workdir = Path(target_dir), Path(workdir)
    out_target, out_assistant = workdir / "peer-target", workdir / "peer-assistant"
    _write_target(target_dir, out_target)
    _write_assistant(target_dir, None if assistant_dir is None else Path(assistant_dir), out_assistant)
    with _quiet_dropped_vision():
        model = load_model(out_target)
    drafter, kind = load_drafter(str(out_assistant), kind="mtp")
    if kind != "mtp":
        raise RuntimeError(f"mlx-vlm loaded the assistant as a {kind!r} drafter, not 'mtp'")
    return Peer(model, drafter, out_target, out_assistant, mlx_vlm.__version__)


def peer_generate(peer: Peer, prompt_tokens: list[int], max_tokens: int, temperature: float, draft_tokens: int,
                  seed: int, stop_tokens=()) -> dict:
    """One request through mlx-vlm's ``generate_step`` with the assistant as its MTP drafter.

    ``draft_tokens`` K: mlx-vlm's block is K + 1 (the bonus token and K drafts), every round.
    ``seconds``: wall time from the first token (which prefill produces) to the last one, i.e. decode
    without prefill, the same span as ``runner.Outcome.decode_seconds``; tok/s = (len(tokens) - 1) / seconds.
    ``acceptance_rate``: accepted / drafted drafts; ``tokens_per_round``: tokens after the first per round
    (both as ``DecodeStats`` counts them; None when no round ran), with the raw ``rounds``,
    ``accepted`` and ``drafted`` counts.
    ``prefill_seconds``: from the call to the first token.
    ``stop_tokens``: end at one of these, which is not included in ``tokens`` (as our decoder does)."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.utils import speculative_stats_since, speculative_stats_snapshot

    if draft_tokens < 1:
        raise ValueError("the peer needs draft_tokens >= 1")
    # mlx-vlm treats a block above the assistant's configured one as a ceiling it reaches only after
    # a run of full accepts; raise the configured one so every round drafts K, like ours.
    peer.drafter.config.block_size = draft_tokens + 1
    mx.random.seed(seed)
    stops = set(stop_tokens)
    snapshot = speculative_stats_snapshot(peer.drafter)
    tokens, first, start = [], None, time.perf_counter()
    steps = generate_step(
        mx.array([list(prompt_tokens)], dtype=mx.int32), peer.model, None, None,
        max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=0,  # plain temperature sampling
        draft_model=peer.drafter, draft_kind="mtp", draft_block_size=draft_tokens + 1, seed=seed,
    )
    for token, _ in steps:
        if first is None:
            first = time.perf_counter()
        if int(token) in stops:
            break
        tokens.append(int(token))
        if len(tokens) >= max_tokens:
            break
    end = time.perf_counter()
    steps.close()
    rounds, accepted, drafted = speculative_stats_since(peer.drafter, snapshot)
    return {
        "tokens": tokens,
        "seconds": end - first if first is not None else 0.0,
        "prefill_seconds": first - start if first is not None else 0.0,
        "rounds": rounds, "accepted": accepted, "drafted": drafted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_round": (len(tokens) - 1) / rounds if rounds else None,
    }


# ---- conversion -------------------------------------------------------------------------------


def _full_text_config(text: dict, where: str) -> dict:
    """Every field of a Gemma 4 text config, valued as mlx-lm reads it (the model we decode with)."""
    args = gemma4_text.ModelArgs.from_dict(normalize_text_config(text, where))
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def _write_target(source: Path, out: Path) -> None:
    config = read_config(source)
    if config.get("model_type") not in SUPPORTED_TARGETS:
        raise CheckpointError(f"{source}: model_type {config.get('model_type')!r} is not a Gemma 4 target")
    text = _full_text_config(text_config_of(config), f"{source / 'config.json'}")
    if not text.get("tie_word_embeddings", True):
        raise CheckpointError(f"{source}: mlx-vlm's Gemma 4 has no separate lm_head (untied embeddings)")
    text_only = config.get("model_type") == "gemma4_text"

    def rename(name: str) -> str | None:
        """mlx-vlm's name for a target tensor; None for tensors the peer does not load."""
        if text_only:
            return "language_model." + name if name.startswith("model.") else None
        # gemma4 checkpoints already say language_model.*; mlx-vlm's sanitize fixes up the rest.
        # Vision/audio towers are left out (the peer decodes text), and so is a merged assistant.
        return name if "language_model." in name and ".mtp." not in name and not name.startswith("mtp.") else None

    weights = {}
    for name, value in load_weights(source).items():
        new = rename(name)
        if new is not None:
            weights[new] = value
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    top = {
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": _TINY_VISION,
        "audio_config": None,
        "vocab_size": text["vocab_size"],
        "hidden_size": text["hidden_size"],
    }
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if key in config:
            top[key] = config[key]
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            top[key] = _renamed_quantization(config[key], rename)
    (out / "config.json").write_text(json.dumps(top, indent=2))


def _write_assistant(target: Path, source: Path | None, out: Path) -> None:
    if source is None:  # merged into the target by ``omlx-mtp quantize --assistant``
        target_config = read_config(target)
        merged = merged_assistant_config(target_config)
        if merged is None:
            raise CheckpointError(f"{target}: no assistant given and none is merged into the checkpoint")
        config, prefix = merged
        weights = {k[len(prefix):]: v for k, v in load_weights(target).items() if k.startswith(prefix)}
        if isinstance(target_config.get("quantization"), dict):
            config = dict(config)
            config["quantization"] = _renamed_quantization(
                target_config["quantization"], lambda k: k[len(prefix):] if k.startswith(prefix) else None)
    else:
        config, weights = read_config(source), load_weights(source)
    where = f"{source or target}: assistant config"
    config = normalize_assistant_config(config, where)
    config["text_config"] = _full_text_config(config["text_config"], where)
    out.mkdir(parents=True, exist_ok=True)
    # The assistant's tensor names (HF layout) are the ones mlx-vlm's drafter uses.
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _renamed_quantization(quantization: dict, rename) -> dict:
    """Global settings (bits, group_size, mode) kept; per-module overrides follow their module's new
    name, and go where the module goes (``rename`` gives None)."""
    out = {}
    for name, value in quantization.items():
        if not isinstance(value, (dict, bool)):
            out[name] = value
        elif rename(name):
            out[rename(name)] = value
    return out


class _quiet_dropped_vision:
    """Hide mlx-vlm's warning that the converted target has no vision weights: we left them out."""

    def filter(self, record) -> bool:
        return "Checkpoint has no weights for module" not in record.getMessage()

    def __enter__(self):
        logging.getLogger().addFilter(self)

    def __exit__(self, *exc):
        logging.getLogger().removeFilter(self)
