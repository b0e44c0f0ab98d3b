"""``omlx-mtp quantize``: a streaming quantizer that keeps MTP weights.

Shards are planned and written piece by piece (``shards``: memory stays near a few pieces of a
few MB whatever the largest tensor).  The trunk is quantized the way mlx-lm's own converter does it (same modules, same per-module predicate, same
``quantization`` config, so plain ``mlx_lm.load`` loads it); MTP tensors — found through the one
registry in ``mtp_tensors`` — are kept, in ``--dtype`` or at ``--mtp-bits`` (a nextn family's MTP
layer has its decoder block converted and quantized as a trunk layer: ``conversion``).  A Gemma 4 assistant
can be merged in: its tensors go under ``[language_model.]mtp.`` in their own shard, which the
index lists and mlx-lm's ``model*.safetensors`` glob leaves alone, and its config is embedded as
``mtp_assistant_config``.  SRC and the assistant pass the validation pass first, and the output
passes it before it takes OUT's place.  Output is staged beside OUT and renamed in at the end
(``staging``): on an error or Ctrl-C nothing is left behind, a killed run's leftovers are removed
by the next, and ``--force`` replaces only a directory this package wrote (``output_dir``).
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from pathlib import Path

import mlx.core as mx

from . import shards
from .conversion import (MODES, QuantizeOptions, convert_mtp, model_for, mtp_scheme, override_key, sanitize_trunk,
                         trunk_scheme)
from .files import load_weights, read_config, tensor_infos
from ..drafters.gemma4_assistant import check_config_fits, normalize_assistant_config
from ..errors import MTPError
from .loading import is_multimodal
from .mtp_tensors import is_mtp_tensor, mtp_shard
from .output_dir import check_output, write_marker
from .staging import commit, new_staging, recover_stale, report
from .validation import check_loads

__all__ = ["MODES", "QuantizeOptions", "mtp_sources", "quantize"]

STAGING_KINDS = ("partial",)  # the staging directories beside OUT (``staging``)

COPIED = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt")
SKIPPED = {"config.json", "model.safetensors.index.json"}


def mtp_prefix(config: dict) -> str:
    return "language_model.mtp." if config.get("model_type") == "gemma4" else "mtp."


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
             progress: bool = True, say=report) -> Path:
    """Write SRC quantized (and ``assistant`` merged in) to OUT; ``say`` reports what was cleaned up."""
    from tqdm import tqdm

    src, out = Path(src), Path(out)
    assistant = Path(assistant) if assistant is not None else None
    config = read_config(src)
    if options.mode not in MODES:
        raise MTPError(f"--mode {options.mode!r}: expected one of {', '.join(MODES)}")
    check_output(out, options.force, {"SRC": src, "the assistant": assistant})
    if config.get("quantization"):
        raise MTPError(f"{src / 'config.json'}: SRC is already quantized; quantize from the original weights")
    tensor_infos(src)  # validates every header and dtype before anything is written
    if assistant is not None:
        check_config_fits(config, normalize_assistant_config(read_config(assistant), str(assistant / "config.json")),
                          f"assistant {assistant}")
    check_loads(src, assistant)  # every tensor the model and its drafter read, at its shape, before any work
    for message in recover_stale(out, STAGING_KINDS):
        say(f"omlx-mtp: {message}")

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
            quant_config[override_key(job.name)] = dict(job.scheme)

    staging = new_staging(out, STAGING_KINDS[0])
    written = staging / "checkpoint"
    try:
        written.mkdir()
        total = sum(job.nbytes for job in jobs)
        try:
            trunk_layout.open(written)
            mtp_layout.open(written)
            with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
                shards.convert_all(jobs, dtype, bar)
        finally:
            trunk_layout.close()
            mtp_layout.close()
        weight_map = {n: shard.filename for shard in trunk_layout.shards for n in shard.entries}
        if not is_multimodal(config):  # mlx-vlm refuses an index naming tensors its model lacks
            weight_map.update({n: shard.filename for shard in mtp_layout.shards for n in shard.entries})
        (written / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum((written / f).stat().st_size for f in set(weight_map.values()))},
                        "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
        new_config = dict(config)
        new_config["quantization"] = quant_config
        new_config["quantization_config"] = quant_config
        if assistant is not None:
            embedded = dict(read_config(assistant))
            if config.get("model_type") == "gemma4":
                new_config["text_config"] = {**config.get("text_config", {}), "mtp_assistant_config": embedded}
            else:
                new_config["mtp_assistant_config"] = embedded
        (written / "config.json").write_text(json.dumps(new_config, indent=2))
        _copy_side_files(src, written)
        check_loads(written)  # what generate will read: never an output it would refuse
        write_marker(written, "quantize")
        commit(staging, [(written, out)])
    except OSError as exc:
        raise MTPError(f"writing {out} failed: {exc.strerror or exc} ({exc.filename or out}); nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
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
        model = model_for(config, str(src / "config.json"))
        trunk = {k: v for k, v in lazy.items() if k not in mtp}  # MTP tensors never reach the trunk's sanitize
        if model is not None and hasattr(model, "sanitize"):
            trunk = sanitize_trunk(model, trunk, config)
        predicate = getattr(model, "quant_predicate", None)
    modules = dict(model.named_modules()) if model is not None else {}
    files = shards.file_tensors(src)
    in_file = {id(array): files[name] for name, array in lazy.items() if name in files}  # `lazy` keeps the ids alive

    sources = deque()
    for name, array in trunk.items():
        sources.append((name, array, trunk_scheme(name, array, modules, predicate, default), False,
                        in_file.get(id(array))))
    sources.extend(mtp_sources(config, mtp, in_file, options, default, predicate, str(src / "config.json"), assistant))
    return sources


def mtp_sources(config: dict, mtp: dict, in_file: dict, options: QuantizeOptions, default: dict | None, predicate,
                where: str, assistant: Path | None = None, assistant_prefix: str | None = None) -> list:
    """The MTP part of the sources: the checkpoint's MTP tensors (``mtp``: lazy arrays by name;
    ``in_file``: their file regions by array id) as ``convert_mtp`` lays them out, then a merged
    assistant's (under ``assistant_prefix``, by default the one ``config``'s loaders read).
    ``quantize`` and ``add-mtp`` both write these."""
    out = [(name, array, scheme, True, in_file.get(id(array)))
           for name, array, scheme in convert_mtp(mtp, config, options, default, predicate, where)]
    if assistant is not None:
        prefix = assistant_prefix or mtp_prefix(config)
        assistant_files = shards.file_tensors(assistant)
        for name, array in _assistant_tensors(assistant).items():
            head = name == "model.embed_tokens.weight"
            out.append((prefix + name, array, mtp_scheme(name, array, options, head=head), True,
                        assistant_files.get(name)))
    return out


def _assistant_tensors(directory: Path) -> dict:
    weights = load_weights(directory)
    weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    return weights


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in COPIED:
        for path in src.glob(pattern):
            if path.name not in SKIPPED and path.is_file():
                shutil.copy2(path, dst / path.name)
