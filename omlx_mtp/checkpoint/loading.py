"""Loading targets with clear errors for user mistakes: text checkpoints through mlx-lm, multimodal
ones (a ``vision_config`` or ``audio_config``) through mlx-vlm, as oMLX loads them."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from .files import read_config, tensor_infos
from ..errors import CheckpointError
from .gemma4_config import normalize_text_config
from .mtp_tensors import is_mtp_tensor
from .sharded import shard_model

log = logging.getLogger("omlx_mtp")

SUPPORTED_TARGETS = ("gemma4", "gemma4_text", "qwen3_5", "qwen3_5_moe", "glm4_moe", "glm4_moe_lite", "deepseek_v3",
                     "deepseek_v32", "qwen3_next")
# Families whose mlx-lm model reads RoPE settings at the top of config.json, as their releases put
# them; transformers 5 writes them nested in ``rope_parameters``.
TOP_LEVEL_ROPE = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "deepseek_v32")
# Multimodal checkpoints of these families load through mlx-vlm (a target module wraps its model);
# others load their text model through mlx-lm, whose sanitizer drops the towers.
VLM_TARGETS = ("gemma4", "qwen3_5", "qwen3_5_moe")
# Safetensors dtypes a model's sanitizer takes as they are (FP8 releases are dequantized by it).
READ_AS_IS = ("F8_E4M3", "F8_E5M2", "F64", "U64")


def target_config_overrides(config: dict, where: str) -> dict:
    """Config entries to hand mlx-lm so that it reads either Gemma 4 spelling."""
    model_type = config.get("model_type")
    if model_type == "gemma4_text":
        return normalize_text_config(config, where)
    if model_type == "gemma4":
        return {"text_config": normalize_text_config(config.get("text_config") or {}, where)}
    if model_type in TOP_LEVEL_ROPE:
        return top_level_rope(config)
    return {}


def top_level_rope(config: dict) -> dict:
    """RoPE entries of transformers 5's nested ``rope_parameters`` spelled as the releases spell
    them (``rope_theta``, ``partial_rotary_factor`` and a ``rope_scaling`` dict at the top), for
    mlx-lm models that read only those; entries already at the top win."""
    nested = config.get("rope_parameters")
    if not isinstance(nested, dict):
        return {}
    out = {}
    for name in ("rope_theta", "partial_rotary_factor"):
        if name in nested and name not in config:
            out[name] = nested[name]
    kind = nested.get("rope_type", nested.get("type", "default"))
    if "rope_scaling" not in config or config["rope_scaling"] is None:
        scaling = {k: v for k, v in nested.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type")}
        out["rope_scaling"] = None if kind == "default" else {**scaling, "type": kind, "rope_type": kind}
    return out


def is_multimodal(config: dict) -> bool:
    """Whether hosts load this checkpoint as a VLM (oMLX's rule: a vision or audio tower is configured)."""
    return bool(config.get("vision_config") or config.get("audio_config"))


def load_target(path: str | Path, with_tokenizer: bool = True, sharding: str | None = None, lazy: bool = False):
    """Return (model, tokenizer or None, config) for a checkpoint directory of a supported family.
    ``sharding`` ("pipeline", "tensor" or "auto"): split the trunk over the ranks of
    ``mx.distributed`` with mlx-lm's own sharding (``checkpoint.sharded``).  ``lazy``: every weight
    checked against the model, none read (``validation``)."""
    directory = Path(path)
    config = read_config(directory)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TARGETS:
        raise CheckpointError(
            f"{directory / 'config.json'}: model_type {model_type!r} is not supported "
            f"(supported targets: {', '.join(SUPPORTED_TARGETS)})"
        )
    tensor_infos(directory, accept=READ_AS_IS)  # every header, and the index against them
    try:
        if is_multimodal(config) and model_type in VLM_TARGETS:
            if sharding is not None:
                raise CheckpointError(f"{directory}: a multimodal checkpoint loads through mlx-vlm, which has no "
                                      "sharding; serve it on one machine")
            model = _load_vlm(directory, lazy)
        else:
            model, _ = load_model(directory, lazy=lazy or sharding is not None, get_model_classes=trunk_classes,
                                  model_config=target_config_overrides(config, str(directory / "config.json")))
            if sharding is not None:
                shard_model(model, sharding, str(directory))
    except ValueError as exc:  # mlx-lm and mlx-vlm report missing/extra/mis-shaped weights this way
        raise CheckpointError(f"{directory}: weights do not match config.json ({exc})") from None
    except (TypeError, KeyError) as exc:  # the model's arguments, built from config.json, refused it
        raise CheckpointError(f"{directory / 'config.json'}: not a {model_type} config mlx-lm can build "
                              f"({type(exc).__name__}: {exc})") from None
    if not lazy:
        upcast_where_the_cpu_needs_it(model, str(directory))
    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = load_tokenizer(directory)
        except Exception as exc:  # transformers raises many kinds here
            raise CheckpointError(f"{directory}: no usable tokenizer ({exc})") from None
    return model, tokenizer, config


def upcast_where_the_cpu_needs_it(model, where: str) -> None:
    """Upcast a model with bf16/fp16 unquantized routed experts (mlx-lm's and mlx-vlm's SwitchLinear)
    to float32 where it runs on mlx's CPU backend, whose ``gather_mm`` takes float32 only (0.31 and
    0.32 alike), saying so in one log line; Metal and CUDA keep bf16/fp16.  Not probed by running a
    half-precision ``gather_mm``: on mlx 0.31 the error it raises leaves the heap corrupted, and the
    process aborts later."""
    if mx.default_device() != mx.cpu:
        return
    half = sorted({str(m.weight.dtype).rpartition(".")[2] for _, m in model.named_modules()
                   if type(m).__name__ == "SwitchLinear" and m.weight.dtype in (mx.bfloat16, mx.float16)})
    if half:
        model.set_dtype(mx.float32)  # all of it, as the tests run such a model: one dtype throughout
        log.warning("%s: mlx's CPU gather_mm takes float32 only, so this model (%s routed experts) runs upcast "
                    "to float32, at twice the memory", where, "/".join(half))


def load_plain(path: str | Path):
    """A checkpoint of a family omlx-mtp drafts nothing for, loaded lazily as mlx-lm loads it (its
    weights checked against its config, none read): the model, or CheckpointError saying why not."""
    directory = Path(path)
    config = read_config(directory)
    try:
        _get_classes(config)
    except ValueError:
        raise CheckpointError(f"{directory / 'config.json'}: model_type {config.get('model_type')!r} is not one "
                              f"mlx-lm knows (omlx-mtp drafts for: {', '.join(SUPPORTED_TARGETS)})") from None
    tensor_infos(directory, accept=READ_AS_IS)
    try:
        return load_model(directory, lazy=True, get_model_classes=trunk_classes)[0]
    except ValueError as exc:
        raise CheckpointError(f"{directory}: weights do not match config.json ({exc})") from None
    except (TypeError, KeyError) as exc:
        raise CheckpointError(f"{directory / 'config.json'}: not a config mlx-lm can build "
                              f"({type(exc).__name__}: {exc})") from None


def trunk_classes(config: dict):
    """mlx-lm's (model, args) classes for ``config``, the model's sanitizer handed the trunk only:
    MTP tensors are left out by the registry (by config: deepseek_v3's own sanitizer drops a fixed
    ``model.layers.61``, so a variant of another depth would not load)."""
    model_class, args_class = _get_classes(config)

    class Trunk(model_class):
        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if not is_mtp_tensor(k, config)}
            return super().sanitize(weights) if hasattr(model_class, "sanitize") else weights

    Trunk.__name__, Trunk.__qualname__, Trunk.__module__ = model_class.__name__, model_class.__qualname__, model_class.__module__
    return Trunk, args_class


def _load_vlm(directory: Path, lazy: bool = False):
    try:
        from mlx_vlm.utils import load_model as load_vlm_model
    except ImportError:
        raise CheckpointError(f"{directory}: a multimodal checkpoint (vision_config) loads through mlx-vlm, which "
                              "is not installed (a dependency of omlx-mtp: pip install 'mlx-vlm>=0.5.0,<0.8')") from None
    try:
        return load_vlm_model(directory, lazy=lazy)
    except ValueError as exc:
        if not _only_extra_mtp_tensors(str(exc), read_config(directory)):
            raise
    # The MTP head sits in the model's shards (oMLX's oQ without omlx-mtp's patches puts it there)
    # and mlx-vlm's model has no place for it.  Releases that honour strict=False load it as oMLX
    # does, once a strict load has failed on nothing but those tensors (a missing weight still fails).
    try:
        return load_vlm_model(directory, lazy=lazy, strict=False)
    except ValueError as exc:
        if not _only_extra_mtp_tensors(str(exc), read_config(directory)):
            raise
    raise CheckpointError(f"{directory}: the MTP head's tensors sit in the model's shards, which this mlx-vlm "
                          "loads strictly (oMLX's VLM engine too); requantize with `omlx-mtp quantize`, or with "
                          "oMLX's oQ patched by `omlx-mtp patch apply`, which put them in mtp/mtp.safetensors")


def _only_extra_mtp_tensors(message: str, config: dict) -> bool:
    """Whether mlx's strict-load error names only extra tensors, all of them MTP tensors."""
    head, _, names = message.partition("parameters not in model:")
    if not names or not head.startswith("Received"):
        return False
    return all(is_mtp_tensor(name.strip().rstrip("."), config) for name in names.split(",") if name.strip())


def load_processor(path: str | Path):
    """mlx-vlm's processor of a multimodal checkpoint (images and audio into model inputs)."""
    directory = Path(path)
    config = read_config(directory)
    if not is_multimodal(config):
        raise CheckpointError(f"{directory}: not a multimodal checkpoint (no vision_config); --image needs one")
    import importlib

    from mlx_vlm.utils import load_processor as load_vlm_processor

    importlib.import_module(f"mlx_vlm.models.{config['model_type']}")  # registers the model's own processor
    try:
        return load_vlm_processor(directory, True)
    except Exception as exc:  # transformers raises many kinds here
        raise CheckpointError(f"{directory}: no usable image processor ({exc})") from None
