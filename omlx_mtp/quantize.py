"""``omlx-mtp quantize``: a streaming quantizer that keeps MTP weights.

Tensors are read lazily (``mx.load`` maps safetensors without reading them) and written one by
one into bounded shards, so peak memory follows the largest tensor, not the model.  The trunk is
quantized the way mlx-lm's own converter does it (same modules, same per-module predicate, same
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

from .checkpoint import load_weights, read_config, tensor_infos
from .drafters.gemma4_assistant import check_config_fits, normalize_assistant_config
from .errors import MTPError
from .models import is_multimodal, target_config_overrides
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


_SAFETENSORS_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32", mx.int16: "I16",
    mx.int8: "I8", mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16", mx.uint8: "U8", mx.bool_: "BOOL",
}


class _ShardWriter:
    """Writes tensors straight into their shard file as they come, so memory holds one tensor at a
    time.  The header is only known when the shard is full, so room for it is reserved up front
    (``header_room``: an upper bound for every tensor still to come) and the JSON is padded with
    spaces to fill it, as the safetensors format allows."""

    def __init__(self, directory: Path, budget: int, header_room: int, stem: str = "part"):
        self.directory = directory
        self.budget = budget
        self.header_room = header_room + (-header_room % 8)
        self.stem = stem
        self.files: list[tuple[str, list[str]]] = []
        self._file = None
        self._entries: dict[str, dict] = {}
        self._size = 0

    def add(self, name: str, array: mx.array):
        nbytes = int(array.nbytes)
        if self._entries and self._size + nbytes > self.budget:
            self.flush()
        if self._file is None:
            self._file = open(self.directory / f"{self.stem}-{len(self.files):05d}.safetensors", "wb")
            self._file.seek(8 + self.header_room)
        self._file.write(memoryview(mx.contiguous(array)))
        self._entries[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                               "data_offsets": [self._size, self._size + nbytes]}
        self._size += nbytes

    def flush(self, filename: str | None = None):
        if not self._entries:
            return
        header = json.dumps({"__metadata__": {"format": "mlx"}, **self._entries}, separators=(",", ":")).encode()
        if len(header) > self.header_room:  # cannot happen with header_room from _header_room()
            raise RuntimeError("safetensors header larger than the room reserved for it")
        self._file.seek(0)
        self._file.write(self.header_room.to_bytes(8, "little"))
        self._file.write(header + b" " * (self.header_room - len(header)))
        self._file.close()
        written = Path(self._file.name)
        if filename is not None:
            (self.directory / filename).parent.mkdir(parents=True, exist_ok=True)
            os.rename(written, self.directory / filename)
            written = self.directory / filename
        self.files.append((str(written.relative_to(self.directory)), list(self._entries)))
        self._file, self._entries, self._size = None, {}, 0

    def finish(self, mtp_files: list[tuple[str, list[str]]], index_mtp: bool) -> dict:
        """Give the trunk shards mlx-lm's names and return the index's weight_map (with the MTP
        files' tensors when ``index_mtp``)."""
        self.flush()
        weight_map = {}
        for i, (old, names) in enumerate(self.files, start=1):
            new = "model.safetensors" if len(self.files) == 1 else f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            os.rename(self.directory / old, self.directory / new)
            weight_map.update({n: new for n in names})
        if index_mtp:
            for f, names in mtp_files:
                weight_map.update({n: f for n in names})
        return weight_map


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
                       "not installed (pip install 'omlx-mtp[vlm]')") from None
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
    default = options.scheme()
    quant_config = dict(default)

    jobs = deque()  # (output name, lazy array, scheme or None, is MTP)
    for name, array in trunk.items():
        jobs.append((name, array, _trunk_scheme(name, array, modules, predicate, default), False))
    prefix = mtp_prefix(config)
    for name, array in mtp.items():
        jobs.append((name, array, _mtp_scheme(name, array, options, head=False), True))
    if assistant is not None:
        for name, array in _assistant_tensors(assistant).items():
            head = name == "model.embed_tokens.weight"
            jobs.append((prefix + name, array, _mtp_scheme(name, array, options, head=head), True))
    # Only `jobs` may reference the lazy source arrays: each is dropped once written, so the
    # evaluated data of finished tensors is freed and memory stays bounded.
    del lazy, trunk, mtp, model, modules, predicate

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        room = _header_room(jobs)
        writer = _ShardWriter(staging, options.shard_bytes, room)
        mtp_writer = _ShardWriter(staging, 1 << 62, room, stem="mtp")
        total = sum(int(a.nbytes) for _, a, _, _ in jobs)
        count = len(jobs)
        with tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not progress) as bar:
            while jobs:
                name, array, scheme, is_mtp = jobs.popleft()
                size = int(array.nbytes)
                target = mtp_writer if is_mtp else writer
                for out_name, value in _convert(name, array, scheme, dtype):
                    mx.eval(value)
                    target.add(out_name, value)
                del array
                if scheme is not None and scheme != default:
                    quant_config[name[: -len(".weight")]] = dict(scheme)
                bar.update(size)
                bar.set_postfix_str(f"{count - len(jobs)}/{count} tensors")
        mtp_writer.flush(mtp_shard(config))
        weight_map = writer.finish(mtp_writer.files, index_mtp=not is_multimodal(config))
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


def _header_room(jobs) -> int:
    """An upper bound on the header of a shard holding every job's outputs (weight, scales, biases)."""
    per_entry = len('"":{"dtype":"BF16","shape":[],"data_offsets":[,]},') + 2 * 20
    room = 256
    for name, array, _, _ in jobs:
        shape = len(",".join(str(d) for d in array.shape)) + 24
        room += 3 * (len(name) + len(".scales") + per_entry + shape)
    return room


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


def _convert(name: str, array: mx.array, scheme, dtype):
    if scheme is None:
        if mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(dtype)
        yield name, array
        return
    path = name[: -len(".weight")]
    parts = mx.quantize(array.astype(dtype), group_size=scheme["group_size"], bits=scheme["bits"], mode=scheme["mode"])
    yield f"{path}.weight", parts[0]
    yield f"{path}.scales", parts[1]
    if len(parts) > 2 and parts[2] is not None:
        yield f"{path}.biases", parts[2]


def _assistant_tensors(directory: Path) -> dict:
    weights = load_weights(directory)
    weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    return weights


def _copy_side_files(src: Path, dst: Path) -> None:
    for pattern in COPIED:
        for path in src.glob(pattern):
            if path.name not in SKIPPED and path.is_file():
                shutil.copy2(path, dst / path.name)
