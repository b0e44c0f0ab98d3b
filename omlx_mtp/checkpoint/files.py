"""Reading checkpoint directories: config.json and safetensors files, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError


def read_config(path: str | Path) -> dict:
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing (a checkpoint directory needs config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object at the top level")
    check_config_types(config, str(config_file))
    return config


# The config entries that loaders read as numbers or objects, and what each must be (None, JSON's
# null, is allowed: releases write it for entries a model does not use, e.g. q_lora_rank).
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "global_head_dim", "vocab_size", "backbone_hidden_size", "kv_lora_rank", "q_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "group_size", "bits", "num_centroids",
                 "full_attention_interval")
# Counts a release may set to 0 (a dense model's experts, a window that is off).
COUNTS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "n_shared_experts", "first_k_dense_replace",
          "num_kv_shared_layers", "intermediate_size", "moe_intermediate_size", "num_experts", "n_routed_experts",
          "num_experts_per_tok", "sliding_window")
OBJECTS = ("text_config", "vision_config", "audio_config", "quantization", "quantization_config",
           "rope_parameters", "per_layer_config", "mtp_assistant_config")


def check_config_types(config: dict, where: str, path: str = "") -> None:
    """Refuse, naming the entry, a config whose numbers or nested objects are of the wrong kind
    (a string for a width, a list for ``quantization``): loaders would fail deep inside."""
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        entry = path + "model_type"
        raise CheckpointError(f"{where}: {entry} must be a string, got {model_type!r}")
    for key, value in config.items():
        if value is None:
            continue
        integer = isinstance(value, int) and not isinstance(value, bool)
        if key in POSITIVE_INTS and not (integer and value > 0):
            raise CheckpointError(f"{where}: {path}{key} must be a positive integer, got {value!r}")
        if key in COUNTS and not (integer and value >= 0):
            raise CheckpointError(f"{where}: {path}{key} must be an integer of at least 0, got {value!r}")
        if key in OBJECTS:
            if not isinstance(value, dict):
                raise CheckpointError(f"{where}: {path}{key} must be a JSON object, got {value!r}")
            if key in ("text_config", "mtp_assistant_config", "quantization", "quantization_config"):
                check_config_types({k: v for k, v in value.items() if not isinstance(v, dict) or
                                    k in OBJECTS}, where, f"{path}{key}.")


INDEX = "model.safetensors.index.json"


def read_index(path: str | Path) -> dict[str, str] | None:
    """The weight map of a checkpoint's safetensors index (tensor -> shard file name), checked:
    an object of names to file names inside the directory; None when there is no index."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{index}: cannot be read ({exc.strerror})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map must be an object of tensor names to file names")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"{index}: weight_map[{name!r}] is {file!r}; expected a file name in the checkpoint")
    return weight_map


def safetensors_files(path: str | Path) -> list[Path]:
    directory = Path(path)
    weight_map = read_index(directory)
    if weight_map is not None:
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{directory / INDEX}: names shard(s) that do not exist: {', '.join(missing)}")
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weight files")
    # MTP tensors of a multimodal checkpoint written here (``mtp_tensors.mtp_shard``).
    return files + [f for f in sorted((directory / "mtp").glob("*.safetensors")) if f not in files]


def check_safetensors_header(file: Path) -> list[str]:
    """Validate the header with the safetensors library; return the tensor names."""
    try:
        with safe_open(str(file), framework="numpy") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({exc})") from None


def load_weights(path: str | Path) -> dict[str, mx.array]:
    """Load every tensor of a checkpoint directory as mlx arrays."""
    weights: dict[str, mx.array] = {}
    for file in safetensors_files(path):
        check_safetensors_header(file)
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError, OSError) as exc:
            raise CheckpointError(f"{file}: could not be read ({exc})") from None
    return weights


# safetensors dtypes omlx-mtp reads, with their sizes in bytes.
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U32": 4, "U16": 2, "U8": 1,
               "BOOL": 1}


def tensor_infos(path: str | Path, files: list[Path] | None = None,
                 accept: tuple[str, ...] = ()) -> dict[str, tuple[Path, str, list[int]]]:
    """name -> (file, safetensors dtype, shape) for every tensor (or every tensor of ``files``),
    read from the headers only; dtypes other than DTYPE_BYTES' (and ``accept``) are refused."""
    infos = {}
    directory = Path(path)
    for file in safetensors_files(directory) if files is None else files:
        try:
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    dtype = view.get_dtype()
                    if dtype not in DTYPE_BYTES and dtype not in accept:
                        raise CheckpointError(f"{file}: tensor {name} has unsupported dtype {dtype}")
                    infos[name] = (file, dtype, list(view.get_shape()))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
    if files is None:  # the index must say where each tensor it names is
        for name, file in (read_index(directory) or {}).items():
            if infos.get(name, (None,))[0] != directory / file:
                raise CheckpointError(f"{directory / INDEX}: puts {name} in {file}, which has no such tensor")
    return infos


def files_holding(directory: Path, prefixes: tuple[str, ...], own_shard: str) -> list[Path]:
    """The safetensors files that may hold tensors named with ``prefixes``: the shard omlx-mtp
    quantize writes them to (``own_shard``), else the shards the index names, else every shard."""
    directory = Path(directory)
    own = directory / own_shard
    if own.is_file():
        return [own]
    weight_map = read_index(directory)
    if weight_map is not None:
        return [directory / n for n in sorted({f for k, f in weight_map.items() if k.startswith(prefixes)})]
    return safetensors_files(directory)


def tensors_under(files: list[Path], prefixes: tuple[str, ...]) -> tuple[dict, str | None]:
    """The tensors of ``files`` named under the first of ``prefixes`` that any of them uses, the
    prefix stripped, and that prefix (None when none is used).  Each file is read once."""
    found: dict[str, dict] = {prefix: {} for prefix in prefixes}
    for file in files:
        for name, value in mx.load(str(file)).items():
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None:
                found[prefix][name[len(prefix):]] = value
    prefix = next((p for p in prefixes if found[p]), None)
    return (found[prefix], prefix) if prefix is not None else ({}, None)
