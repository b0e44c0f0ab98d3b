"""``omlx-mtp quantize``: a streaming quantizer that keeps MTP weights.

Shards are planned and written piece by piece (``shards``: memory stays near a few pieces of a
few MB whatever the largest tensor).  The trunk is quantized the way mlx-lm's own converter does it (same modules, same per-module predicate, same
``quantization`` config, so plain ``mlx_lm.load`` loads it); MTP tensors — found through the one
registry in ``mtp_tensors`` — are kept, in ``--dtype`` or at ``--mtp-bits``.  A Gemma 4 assistant
can be merged in: its tensors go under ``[language_model.]mtp.`` in their own shard, which the
index lists and mlx-lm's ``model*.safetensors`` glob leaves alone, and its config is embedded as
``mtp_assistant_config``.  Output is written to a temporary directory beside OUT and renamed at
the end; on any error or Ctrl-C nothing is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes

from . import shards
from .files import load_weights, read_config, tensor_infos
from ..drafters.gemma4_assistant import check_config_fits, normalize_assistant_config
from ..errors import MTPError
from .loading import is_multimodal, target_config_overrides
from .mtp_tensors import is_mtp_tensor, mtp_shard

MODES = {"affine": None, "mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}  # mode -> fixed (group, bits)
COPIED = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt")
SKIPPED = {"config.json", "model.safetensors.index.json"}


@dataclass
class QuantizeOptions:
    bits: int = 4
    group_size: int = 64
    mode: str = "affine"
    mtp_bits: int | None = None
    mtp_head_bits: int | None = None
    dtype: str = "bfloat16"
    shard_bytes: int = 5 << 30
    force: bool = False

    def scheme(self, bits: int | None = None) -> dict:
        fixed = MODES[self.mode]
        if fixed is not None:
            return {"group_size": fixed[0], "bits": fixed[1], "mode": self.mode}
        return {"group_size": self.group_size, "bits": bits or self.bits, "mode": "affine"}


def mtp_prefix(config: dict) -> str:
    return "language_model.mtp." if config.get("model_type") == "gemma4" else "mtp."


def _model_for(config: dict, where: str):
    """An un-evaluated mlx-lm model of this config (for sanitize and module structure), or None."""
    merged = {**config, **target_config_overrides(config, where)}
    try:
        model_class, args_class = _get_classes(config=merged)
    except ValueError:  # a model type mlx-lm does not know: names are kept as they are
        return None
    return model_class(args_class.from_dict(merged))


def _multimodal_trunk(src: Path):
    """(mlx-vlm's model, its parameters by name, quantization predicate) for a multimodal checkpoint,
    as mlx-vlm's own conversion sees it: every tensor through the model's sanitizers (towers
    included, in mlx-vlm's names), the towers left unquantized, the rest by the model's own rules.
    The parameters stay lazy: nothing is read until a tensor is written."""
    try:
        from mlx.utils import tree_flatten
        from mlx_vlm.utils import load_model as load_vlm_model
        from mlx_vlm.utils import skip_multimodal_module
    except ImportError:
        raise MTPError(f"{src}: a multimodal checkpoint (vision_config) is converted through mlx-vlm, which is "
                       "not installed (a dependency of omlx-mtp: pip install 'mlx-vlm>=0.5.0,<0.8')") from None
    try:
        model = load_vlm_model(src, lazy=True)
    except ValueError as exc:
        raise MTPError(f"{src}: mlx-vlm cannot build this checkpoint ({exc})") from None
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if skip_multimodal_module(path):
            return False
        return own(path, module) if own is not None else True

    return model, dict(tree_flatten(model.parameters())), predicate


def quantize(src: str | Path, out: str | Path, options: QuantizeOptions, assistant: str | Path | None = None,
             progress: bool = True) -> Path:
    from tqdm import tqdm

    src, out = Path(src), Path(out)
    config = read_config(src)
    if options.mode not in MODES:
        raise MTPError(f"--mode {options.mode!r}: expected one of {', '.join(MODES)}")
    if out.exists() and not options.force:
        raise MTPError(f"{out} exists (pass --force to replace it)")
    if out.resolve() == src.resolve():
        raise MTPError("OUT must differ from SRC (SRC is never modified)")
    if config.get("quantization"):
        raise MTPError(f"{src / 'config.json'}: SRC is already quantized; quantize from the original weights")
    tensor_infos(src)  # validates every header and dtype before anything is written
    assistant_config = None
    if assistant is not None:
        assistant = Path(assistant)
        assistant_config = normalize_assistant_config(read_config(assistant), str(assistant / "config.json"))
        check_config_fits(config, assistant_config, f"assistant {assistant}")
        tensor_infos(assistant)

    dtype = getattr(mx, options.dtype)
    default = options.scheme()
    sources = _sources(src, config, options, default, assistant)
    room = shards.header_room((name, array.shape) for name, array, *_ in sources)
    trunk_layout, mtp_layout = shards.ShardLayout(options.shard_bytes, room), shards.ShardLayout(1 << 62, room)
    jobs = shards.plan_jobs(sources, trunk_layout, mtp_layout, dtype)
    shards.name_trunk_shards(trunk_layout.shards)
    for shard in mtp_layout.shards:
        shard.filename = mtp_shard(config)
    quant_config = dict(default)
    for job in jobs:
        if job.scheme is not None and job.scheme != default:
            quant_config[job.name[: -len(".weight")]] = dict(job.scheme)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        total = sum(job.nbytes for job in jobs)
        try:
            trunk_layout.open(staging)
            mtp_layout.open(staging)
            with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
                shards.convert_all(jobs, dtype, bar)
        finally:
            trunk_layout.close()
            mtp_layout.close()
        weight_map = {n: shard.filename for shard in trunk_layout.shards for n in shard.entries}
        if not is_multimodal(config):  # mlx-vlm refuses an index naming tensors its model lacks
            weight_map.update({n: shard.filename for shard in mtp_layout.shards for n in shard.entries})
        (staging / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum((staging / f).stat().st_size for f in set(weight_map.values()))},
                        "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
        new_config = dict(config)
        new_config["quantization"] = quant_config
        new_config["quantization_config"] = quant_config
        if assistant_config is not None:
            embedded = dict(read_config(assistant))
            if config.get("model_type") == "gemma4":
                new_config["text_config"] = {**config.get("text_config", {}), "mtp_assistant_config": embedded}
            else:
                new_config["mtp_assistant_config"] = embedded
        (staging / "config.json").write_text(json.dumps(new_config, indent=2))
        _copy_side_files(src, staging)
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _sources(src: Path, config: dict, options: QuantizeOptions, default: dict, assistant: Path | None) -> deque:
    """Every tensor to write, in order: (output name, lazy array, scheme or None, is MTP, its file
    region or None).  A trunk tensor that mlx-lm's sanitize (or mlx-vlm) hands back unchanged is
    found in its file by identity; a transformed one has no region and is read whole."""
    lazy = load_weights(src)  # lazy: nothing is read until a tensor is evaluated
    mtp = {k: v for k, v in lazy.items() if is_mtp_tensor(k, config)}
    if is_multimodal(config):
        model, trunk, predicate = _multimodal_trunk(src)
    else:
        model = _model_for(config, str(src / "config.json"))
        trunk = {k: v for k, v in lazy.items() if k not in mtp}
        if model is not None and hasattr(model, "sanitize"):
            trunk = model.sanitize(trunk)
        predicate = getattr(model, "quant_predicate", None)
    modules = dict(model.named_modules()) if model is not None else {}
    files = shards.file_tensors(src)
    in_file = {id(array): files[name] for name, array in lazy.items() if name in files}  # `lazy` keeps the ids alive

    sources = deque()
    for name, array in trunk.items():
        sources.append((name, array, _trunk_scheme(name, array, modules, predicate, default), False,
                        in_file.get(id(array))))
    for name, array in mtp.items():
        sources.append((name, array, _mtp_scheme(name, array, options, head=False), True, in_file.get(id(array))))
    if assistant is not None:
        prefix = mtp_prefix(config)
        assistant_files = shards.file_tensors(assistant)
        for name, array in _assistant_tensors(assistant).items():
            head = name == "model.embed_tokens.weight"
            sources.append((prefix + name, array, _mtp_scheme(name, array, options, head=head), True,
                            assistant_files.get(name)))
    return sources


def _trunk_scheme(name, array, modules, predicate, default):
    if not name.endswith(".weight") or array.ndim < 2:
        return None
    path = name[: -len(".weight")]
    module = modules.get(path)
    if module is None or not hasattr(module, "to_quantized"):
        return None
    scheme = dict(default)
    if array.shape[-1] % scheme["group_size"]:
        return None
    if predicate is not None:
        decision = predicate(path, module)
        if decision is False:
            return None
        if isinstance(decision, dict):
            scheme.update(decision)
    return scheme


def _mtp_scheme(name, array, options: QuantizeOptions, head: bool):
    bits = options.mtp_head_bits if head else options.mtp_bits
    if bits is None or not name.endswith(".weight") or array.ndim != 2 or "norm" in name:
        return None
    scheme = options.scheme(bits)
    if array.shape[-1] % scheme["group_size"]:
        return None
    return scheme


def _assistant_tensors(directory: Path) -> dict:
    weights = load_weights(directory)
    weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    return weights


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in COPIED:
        for path in src.glob(pattern):
            if path.name not in SKIPPED and path.is_file():
                shutil.copy2(path, dst / path.name)
