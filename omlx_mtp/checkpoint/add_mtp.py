"""``omlx-mtp add-mtp ORIGINAL MLX_DIR``: the MTP weights a converted quant dropped, added back.

mlx-lm's and mlx-vlm's converters (every mlx-community quant) drop MTP tensors.  add-mtp reads from
ORIGINAL (the Hugging Face release) the headers of the shards its index names for them and, of
those shards, only the MTP tensors' bytes; converts them as ``quantize`` does (``quantize.mtp_sources``
serves both), quantized to MLX_DIR's own scheme (its ``quantization``: bits, group size, mode, and
the model's per-module predicate) unless told otherwise; and writes them beside MLX_DIR in the side
shard ``quantize`` writes (``mtp_tensors.mtp_shard``), with the config entries loaders read.

MLX_DIR's weight files are never rewritten; config.json and the index only gain entries.
Everything is written to a staging directory beside MLX_DIR, checked by the validation pass as
MLX_DIR will be (its files and the staged ones side by side), and renamed in at the end, config.json
last (``staging.commit``); an error undoes the renames already made, so MLX_DIR is left as it was.
A run killed outright leaves its staging directory beside MLX_DIR, and the next run undoes any
renames it had made and removes it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter, deque
from pathlib import Path

import mlx.core as mx

from . import shards
from .conversion import MODES, QuantizeOptions, model_for, override_key, text_config
from .files import INDEX, check_safetensors_header, read_config, read_index, safetensors_files, tensor_infos
from ..drafters.gemma4_assistant import check_config_fits, normalize_assistant_config
from ..errors import MTPError
from .loading import is_multimodal
from .mtp_tensors import is_mtp_tensor, mtp_shard
from .quantize import mtp_prefix, mtp_sources
from .staging import commit, new_staging, recover_stale, report
from .validation import check_loads

# Config entries that promise MTP weights; kept from ORIGINAL where MLX_DIR's converter dropped them.
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")
# Dimensions two checkpoints of one model share (compared where both configs give them).
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "moe_intermediate_size",
              "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "n_routed_experts",
              "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "linear_num_value_heads", "linear_num_key_heads")
# Trunk tensors whose shapes are compared, named without their "model." / "language_model." prefixes.
CHECKED_TENSORS = ("embed_tokens.weight", "lm_head.weight", "norm.weight")
_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
STAGING_KINDS = ("add-mtp",)


class _Reads:
    """The bytes read from ORIGINAL: each file's header once, each MTP tensor's bytes, the JSON files."""

    def __init__(self):
        self.headers: dict[Path, int] = {}
        self.total = 0

    def header(self, file: Path) -> dict:
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        if file not in self.headers:
            self.headers[file] = 8 + length
            self.total += 8 + length
        return header

    def json(self, file: Path) -> dict:
        self.total += file.stat().st_size
        return json.loads(file.read_text())


def add_mtp(original: str | Path, mlx_dir: str | Path, bits: int | None = None, group_size: int | None = None,
            mode: str | None = None, assistant: str | Path | None = None, force: bool = False,
            progress: bool = True, say=report) -> int:
    """Add ORIGINAL's MTP tensors (and an ``assistant``'s, Gemma 4) to the quant in ``mlx_dir``;
    returns the bytes read from ORIGINAL.  ``say`` reports what a killed run left and was undone."""
    original, mlx_dir = Path(original), Path(mlx_dir)
    reads = _Reads()
    config = read_config(original)
    reads.total += (original / "config.json").stat().st_size
    mlx_config = read_config(mlx_dir)
    if original.resolve() == mlx_dir.resolve():
        raise MTPError("add-mtp: ORIGINAL and MLX_DIR are the same directory")
    if mode is not None and mode not in MODES:
        raise MTPError(f"--mode {mode!r}: expected one of {', '.join(MODES)}")
    for message in recover_stale(mlx_dir, STAGING_KINDS):
        say(f"omlx-mtp: {message}")
    _check_same_model(config, mlx_config, original, mlx_dir)
    check_loads(mlx_dir, merged=False)  # the quant itself loads: its trunk as mlx-lm reads it
    new_config = _gain_mtp_keys(mlx_config, config)
    mlx_infos = tensor_infos(mlx_dir)
    present = sorted(n for n in mlx_infos if is_mtp_tensor(n, new_config))
    if (present or _merged_assistant(mlx_config)) and not force:
        what = f"{len(present)} MTP tensors (e.g. {present[0]})" if present else "a merged assistant"
        raise MTPError(f"{mlx_dir} already holds {what}; pass --force to replace them")

    weight_map = read_index(original)
    if weight_map is not None:
        reads.total += (original / INDEX).stat().st_size
    files = _mtp_files(original, config, weight_map)
    infos = tensor_infos(original, files, accept=("F8_E4M3",))  # validates those headers and their dtypes
    for file in files:
        reads.header(file)
    mtp_names = [n for n in infos if is_mtp_tensor(n, config)]
    if not mtp_names and assistant is None:
        raise MTPError(f"{original}: no MTP tensors (mtp.*, model.layers.{{num_hidden_layers}}.*, ...) to add; "
                       "is ORIGINAL the Hugging Face release, not a conversion?")
    _check_trunk_shapes(original, config, weight_map, mlx_dir, mlx_config, mlx_infos, reads)
    assistant_config = None
    if assistant is not None:
        assistant = Path(assistant)
        assistant_config = normalize_assistant_config(read_config(assistant), str(assistant / "config.json"))
        check_config_fits(mlx_config, assistant_config, f"assistant {assistant}")
        tensor_infos(assistant)

    default = _scheme(mlx_config, bits, group_size, mode, mlx_dir)
    # Every MTP tensor at MLX_DIR's scheme (the trunk's embedding and head are quantized too).
    options = QuantizeOptions(dtype=_dtype(mlx_infos))
    if default is not None:
        options.bits, options.group_size, options.mode = default["bits"], default["group_size"], default["mode"]
        options.mtp_bits = options.mtp_head_bits = default["bits"]
    prefix = mtp_prefix(mlx_config)
    sources, read = _sources(original, config, files, mtp_names, infos, options, default, assistant, prefix)
    reads.total += read

    side = mtp_shard(mlx_config)
    room = shards.header_room((name, array.shape) for name, array, *_ in sources)
    layout = shards.ShardLayout(1 << 62, room)
    jobs = shards.plan_jobs(sources, shards.ShardLayout(1 << 62, room), layout, getattr(mx, options.dtype))
    for shard in layout.shards:
        shard.filename = side
    # Loaders fall back on MLX_DIR's own default: any other scheme is an override.
    q = mlx_config.get("quantization") or {}
    base = {"group_size": q.get("group_size"), "bits": q.get("bits"), "mode": q.get("mode", "affine")} if q else default
    overrides = {override_key(job.name): dict(job.scheme) for job in jobs
                 if job.scheme is not None and job.scheme != base}

    final = _new_config(new_config, default, overrides, present, force, assistant, assistant_config, prefix)
    _write(mlx_dir, final, jobs, layout, side, options.dtype, progress)
    return reads.total


def _sources(original: Path, config: dict, files: list[Path], mtp_names: list[str], infos: dict,
             options: QuantizeOptions, default, assistant, prefix: str) -> tuple[deque, int]:
    """The MTP tensors of ``files`` (lazy: only their bytes are read, when written) as
    ``quantize`` converts them, and the bytes that will be read."""
    lazy = {}
    for file in files:
        check_safetensors_header(file)
        lazy.update({k: v for k, v in mx.load(str(file)).items() if k in mtp_names})
    regions = shards.file_tensors(original, files)
    in_file = {id(array): regions[name] for name, array in lazy.items()}  # `lazy` keeps the ids alive
    where = str(original / "config.json")
    model = model_for(config, where)
    sources = deque(mtp_sources(config, lazy, in_file, options, default, getattr(model, "quant_predicate", None),
                                where, assistant, assistant_prefix=prefix))
    # FP8 releases (DeepSeek-V3.x): the model's sanitizer dequantizes each FP8 weight by its
    # weight_scale_inv; one that comes out as it went in has nothing to be read by.
    fp8 = sorted(name for name, array, *_ in sources
                 if infos.get(name, (None, ""))[1] == "F8_E4M3" and array.dtype == mx.uint8)
    if fp8:
        raise MTPError(f"{original}: {fp8[0]} is FP8 (F8_E4M3) and the model's sanitizer does not dequantize it "
                       "(it needs a weight_scale_inv beside it, as DeepSeek-V3.x releases have)")
    return sources, sum(int(array.nbytes) for array in lazy.values())


def _write(mlx_dir: Path, config: dict, jobs, layout, side: str, dtype: str, progress: bool) -> None:
    """Write the side shard, the index and ``config`` in a staging directory beside MLX_DIR, check
    the result, then rename them in, config.json last."""
    from tqdm import tqdm

    staging = new_staging(mlx_dir, STAGING_KINDS[0])
    try:
        total = sum(job.nbytes for job in jobs)
        try:
            layout.open(staging)
            with tqdm(total=total, unit="B", unit_scale=True, desc="add-mtp", disable=not progress) as bar:
                shards.convert_all(jobs, getattr(mx, dtype), bar)
            for shard in layout.shards:
                os.fsync(shard.fd)
        finally:
            layout.close()
        written = {name for shard in layout.shards for name in shard.entries}
        folder = Path(side).parent  # mtp/ for a multimodal checkpoint: moved whole when MLX_DIR has none
        whole = folder != Path(".") and not (mlx_dir / folder).exists()
        moves = [(staging / folder, mlx_dir / folder) if whole else (staging / side, mlx_dir / side)]
        if (mlx_dir / INDEX).is_file() and not is_multimodal(config):  # where quantize lists it
            index = _new_index(mlx_dir, config, written, side, (staging / side).stat().st_size)
            _write_json(staging / INDEX, index)
            moves.append((staging / INDEX, mlx_dir / INDEX))
        _write_json(staging / "config.json", config)
        moves.append((staging / "config.json", mlx_dir / "config.json"))  # last: loaders read it first
        _check_result(mlx_dir, staging, moves)
        commit(staging, moves)
    except OSError as exc:
        raise MTPError(f"writing into {mlx_dir} failed: {exc.strerror or exc} ({exc.filename or mlx_dir}); "
                       f"{mlx_dir} is as it was") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_result(mlx_dir: Path, staging: Path, moves: list[tuple[Path, Path]]) -> None:
    """The validation pass on MLX_DIR as the moves will leave it: a view of links to its files,
    the staged ones in their places, loaded as ``generate`` loads it."""
    view = staging / "view"
    _link_view(view, mlx_dir, {final.relative_to(mlx_dir): staged for staged, final in moves})
    try:
        check_loads(view)
    except MTPError as exc:
        raise MTPError(f"{str(exc).replace(str(view), str(mlx_dir))} (after adding the MTP weights; "
                       f"nothing was written)") from None


def _link_view(view: Path, base: Path, replaced: dict[Path, Path]) -> None:
    view.mkdir()
    tops = {rel.parts[0] for rel in replaced}
    for entry in base.iterdir():
        if entry.name not in tops:
            os.symlink(entry.resolve(), view / entry.name)
    for top in sorted(tops):
        if Path(top) in replaced:
            os.symlink(replaced[Path(top)].resolve(), view / top)
        else:  # a file inside a folder MLX_DIR has (mtp/): the folder's other files linked beside it
            inner = {Path(*rel.parts[1:]): staged for rel, staged in replaced.items() if rel.parts[0] == top}
            _link_view(view / top, base / top, inner)


def _merged_assistant(config: dict) -> bool:
    return bool(config.get("mtp_assistant_config") or (config.get("text_config") or {}).get("mtp_assistant_config"))


def _family(config: dict) -> str:
    return str(text_config(config).get("model_type", config.get("model_type"))).removesuffix("_text")


def _check_same_model(config: dict, mlx_config: dict, original: Path, mlx_dir: Path) -> None:
    text, mlx_text = text_config(config), text_config(mlx_config)
    differ = []
    if _family(config) != _family(mlx_config):
        differ.append(f"model_type {_family(mlx_config)!r} vs {_family(config)!r}")
    differ += [f"{key} {mlx_text[key]} vs {text[key]}" for key in SHAPE_KEYS
               if key in text and key in mlx_text and text[key] != mlx_text[key]]
    if differ:
        raise MTPError(f"{mlx_dir} is not a conversion of {original}: {', '.join(differ)} (MLX_DIR vs ORIGINAL)")


def _gain_mtp_keys(mlx_config: dict, config: dict) -> dict:
    """MLX_DIR's config with ORIGINAL's MTP entries where its converter left them out."""
    out = json.loads(json.dumps(mlx_config))
    target = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    for key in MTP_CONFIG_KEYS:
        value = text_config(config).get(key, config.get(key))
        if value is not None and not target.get(key):
            target[key] = value
    return out


def _mtp_files(original: Path, config: dict, weight_map: dict | None) -> list[Path]:
    """The shards of ORIGINAL that hold MTP tensors: those its index names for them, else every one."""
    if weight_map is None:
        return safetensors_files(original)
    names = sorted({f for name, f in weight_map.items() if is_mtp_tensor(name, config)})
    return [original / name for name in names]


def _trunk_name(name: str) -> str:
    while name.startswith(("model.", "language_model.")):
        name = name.split(".", 1)[1]
    return name


def _check_trunk_shapes(original: Path, config: dict, weight_map: dict | None, mlx_dir: Path, mlx_config: dict,
                        mlx_infos: dict, reads: _Reads) -> None:
    """The embedding, LM head and final norm have the same shapes in both (MLX_DIR's unpacked from
    its quantization), read from ORIGINAL's headers only."""
    wanted = {}
    for name, (_, dtype, shape) in mlx_infos.items():
        key = _trunk_name(name)
        if key in CHECKED_TENSORS and not is_mtp_tensor(name, config):
            wanted[key] = _unpacked(name, shape, mlx_infos, mlx_config.get("quantization") or {})
    if weight_map is not None:
        files = sorted({original / f for n, f in weight_map.items() if _trunk_name(n) in wanted
                        and not is_mtp_tensor(n, config)})
    else:
        files = safetensors_files(original)
    for file in files:
        for name, entry in reads.header(file).items():
            key = _trunk_name(name)
            if key in wanted and name != "__metadata__" and not is_mtp_tensor(name, config):
                if list(entry["shape"]) != wanted[key]:
                    raise MTPError(f"{mlx_dir} is not a conversion of {original}: {key} is {wanted[key]} in MLX_DIR "
                                   f"(unpacked) and {entry['shape']} in ORIGINAL")


def _unpacked(name: str, shape: list[int], infos: dict, quantization: dict) -> list[int]:
    path = name[: -len(".weight")]
    if f"{path}.scales" not in infos:
        return list(shape)
    override = quantization.get(path)
    bits = (override if isinstance(override, dict) else quantization).get("bits", 4)
    return [*shape[:-1], shape[-1] * 32 // bits]


def _scheme(mlx_config: dict, bits, group_size, mode, mlx_dir: Path) -> dict | None:
    """The scheme the MTP tensors get: MLX_DIR's default, with what the command line says on top;
    None (kept unquantized) for an unquantized MLX_DIR and no --bits/--mode."""
    q = mlx_config.get("quantization") or {}
    if not q and bits is None and mode is None:
        return None
    mode = mode or q.get("mode", "affine")
    if MODES[mode] is not None:
        return {"group_size": MODES[mode][0], "bits": MODES[mode][1], "mode": mode}
    scheme = {"group_size": group_size or q.get("group_size", 64), "bits": bits or q.get("bits", 4), "mode": mode}
    if scheme["bits"] not in (2, 3, 4, 5, 6, 8):
        raise MTPError(f"{mlx_dir / 'config.json'}: quantization bits {scheme['bits']} is not one mlx supports")
    return scheme


def _dtype(infos: dict) -> str:
    """MLX_DIR's float dtype: its final norm's, else the commonest among its unquantized tensors."""
    for name, (_, dtype, _) in infos.items():
        if _trunk_name(name) == "norm.weight" and dtype in _FLOATS:
            return _FLOATS[dtype]
    found = Counter(_FLOATS[d] for n, (_, d, _) in infos.items()
                    if d in _FLOATS and not n.endswith((".scales", ".biases")))
    return found.most_common(1)[0][0] if found else "bfloat16"


def _new_index(mlx_dir: Path, config: dict, written: set, side: str, side_bytes: int) -> dict:
    index = json.loads((mlx_dir / INDEX).read_text())
    weight_map = dict(index.get("weight_map", {}))
    old = {n for n, f in weight_map.items() if f == side or is_mtp_tensor(n, config)}  # only with --force
    if (mlx_dir / side).is_file():
        side_bytes -= (mlx_dir / side).stat().st_size
    weight_map = {n: f for n, f in weight_map.items() if n not in old}
    weight_map.update({name: side for name in written})
    metadata = dict(index.get("metadata") or {})
    if "total_size" in metadata:
        metadata["total_size"] = int(metadata["total_size"]) + side_bytes
    return {**index, "metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}


def _new_config(config: dict, default, overrides: dict, present: list, force: bool, assistant, assistant_config,
                prefix: str) -> dict:
    """MLX_DIR's config gaining the MTP modules' quantization overrides (and a merged assistant's
    config); with --force the overrides of the MTP modules it replaces go first.  mlx-lm writes
    ``quantization_config`` as a copy of ``quantization``: such a copy follows it."""
    out = dict(config)
    old = out.get("quantization")
    if old or default is not None:
        q = dict(old) if isinstance(old, dict) else dict(default or {})  # --bits on an unquantized MLX_DIR
        if force and present:
            q = {k: v for k, v in q.items() if not (isinstance(v, (dict, bool)) and _is_mtp_module(k, config, prefix))}
        q.update(overrides)
        out["quantization"] = q
        if out.get("quantization_config") == old or (not old and "quantization_config" not in out):
            out["quantization_config"] = q
    if assistant_config is not None:
        embedded = dict(read_config(assistant))
        if config.get("model_type") == "gemma4":
            out["text_config"] = {**config.get("text_config", {}), "mtp_assistant_config": embedded}
        else:
            out["mtp_assistant_config"] = embedded
    return out


def _is_mtp_module(path: str, config: dict, prefix: str) -> bool:
    return is_mtp_tensor(path + ".weight", config) or path.startswith(prefix)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
