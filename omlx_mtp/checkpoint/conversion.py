"""How each tensor of a checkpoint is converted: the quantization schemes (the trunk's rules, the MTP
knobs), the model's sanitizer run so that no trunk layer is lost, and the MTP tensors laid out the
way a quantized checkpoint keeps them.  ``quantize`` and ``add-mtp`` both convert MTP tensors
through ``convert_mtp``, so the two write the same bytes for the same scheme.

The "nextn" families (DeepSeek-V3/V3.2, GLM-4.5+, GLM-4.7-Flash) store their MTP block as one more
decoder layer, ``model.layers.{num_hidden_layers}``: its decoder part is converted as the model
converts a trunk layer (mlx-lm's sanitize on the layer renamed to index 0: experts stacked,
DeepSeek's ``kv_b_proj`` split, fp8 dequantized; then quantized by the trunk's scheme and the
model's predicate), while ``enorm``/``hnorm``/``eh_proj``/``shared_head.*``/``embed_tokens`` follow
the MTP knobs (``--dtype``, ``--mtp-bits``, ``--mtp-head-bits``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.nn as nn
from mlx_lm.utils import _get_classes

from ..errors import MTPError
from .loading import target_config_overrides
from .mtp_tensors import mtp_family

MODES = {"affine": None, "mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}  # mode -> fixed (group, bits)

# A decoder layer's tensor: "<prefix>layers.<index>.<rest>".
_LAYER = re.compile(r"^(?P<prefix>(?:.*?\.)?layers\.)(?P<index>\d+)\.(?P<rest>.+)$")
# The nextn block's own parts (the rest is a decoder layer of the family's kind), and of those the
# vocabulary-sized ones (--mtp-head-bits).
NEXTN_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
NEXTN_HEAD = ("shared_head.head.", "embed_tokens.")


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


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def model_for(config: dict, where: str, num_hidden_layers: int | None = None):
    """An un-evaluated mlx-lm model of this config (for sanitize and module structure), or None
    when mlx-lm does not know the model type.  ``num_hidden_layers`` builds a deeper one, whose
    extra layers give the MTP layers of the nextn families their modules."""
    merged = {**config, **target_config_overrides(config, where)}
    if num_hidden_layers is not None:
        if "text_config" in merged:
            merged["text_config"] = {**merged["text_config"], "num_hidden_layers": num_hidden_layers}
        else:
            merged["num_hidden_layers"] = num_hidden_layers
    try:
        model_class, args_class = _get_classes(config=merged)
    except ValueError:  # a model type mlx-lm does not know: names are kept as they are
        return None
    return model_class(args_class.from_dict(merged))


def trunk_scheme(name, array, modules, predicate, default):
    """The scheme mlx-lm's converter gives this tensor, or None to keep it unquantized."""
    if default is None or not name.endswith(".weight") or array.ndim < 2:
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


def mtp_scheme(name, array, options: QuantizeOptions, head: bool, predicate=None):
    """The scheme of an MTP tensor by the MTP knobs (None: kept in --dtype); the model's predicate
    still has its say (a router gate kept at 8 bits in the trunk is kept so in the head)."""
    bits = options.mtp_head_bits if head else options.mtp_bits
    if bits is None or not name.endswith(".weight") or array.ndim != 2 or "norm" in name:
        return None
    scheme = options.scheme(bits)
    if array.shape[-1] % scheme["group_size"]:
        return None
    if predicate is not None:
        # MTP modules have no place in the trunk's model; predicates decide by path, so a plain
        # linear of the tensor's shape stands in (lazy: nothing is allocated).
        decision = predicate(name[: -len(".weight")], nn.Linear(array.shape[1], array.shape[0], bias=False))
        if decision is False:
            return None
        if isinstance(decision, dict):
            scheme.update(decision)
    return scheme


_EXPERT = re.compile(r"\.experts\.\d+\.")


def override_key(name: str) -> str:
    """The ``quantization`` key of a weight quantized off the default scheme: its module's path.
    Experts stored one by one (Qwen's MTP heads) are loaded stacked, so theirs is the stacked
    module's (``...mlp.switch_mlp.up_proj``), which is what loaders look up."""
    return _EXPERT.sub(".switch_mlp.", name[: -len(".weight")])


def _layers(names) -> dict[tuple[str, int], list[str]]:
    """(prefix, index) -> the names of that decoder layer's tensors."""
    found: dict[tuple[str, int], list[str]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match is not None:
            found.setdefault((match["prefix"], int(match["index"])), []).append(name)
    return found


def sanitize_alone(model, tensors: dict, prefix: str, index: int) -> dict:
    """One decoder layer's tensors through ``model.sanitize`` as layer 0, renamed back: the
    model's conversion of a layer, whatever its index (sanitizers convert ``range(num_hidden_layers)``
    and drop the MTP layer, deepseek_v3's by a hard-coded 61)."""
    source, stand_in = f"{prefix}{index}.", f"{prefix}0."
    renamed = {stand_in + name[len(source):]: value for name, value in tensors.items()}
    out = {}
    for name, value in model.sanitize(renamed).items():
        if not name.startswith(stand_in):
            raise MTPError(f"the model's sanitize turned layer {index}'s tensors into {name!r}, outside the layer")
        out[source + name[len(stand_in):]] = value
    return out


def sanitize_trunk(model, trunk: dict, config: dict) -> dict:
    """``model.sanitize`` over the trunk, with any trunk layer (by config) that it drops whole
    converted on its own and put back: deepseek_v3 drops ``model.layers.61*`` whatever the depth.
    Layers are compared by index, since sanitizers may rename the prefix."""
    out = model.sanitize(dict(trunk))  # some sanitizers pop from the dict they are given
    depth = int(text_config(config).get("num_hidden_layers", 0))
    kept = {index for _, index in _layers(out)}
    for (prefix, index), names in _layers(trunk).items():
        if index < depth and index not in kept:
            out.update(sanitize_alone(model, {n: trunk[n] for n in names}, prefix, index))
    return out


def nextn_layer_count(config: dict) -> int:
    return int(text_config(config).get("num_nextn_predict_layers") or 0)


def convert_mtp(mtp: dict, config: dict, options: QuantizeOptions, default: dict | None, predicate,
                where: str) -> list[tuple[str, object, dict | None]]:
    """(name, lazy array, scheme or None) for every MTP tensor, in the checkpoint's layout.
    ``default`` is the trunk's scheme (None: an unquantized trunk), which a nextn decoder block
    shares; ``predicate`` the model's quantization predicate (None: none)."""
    nextn = {n: v for n, v in mtp.items() if mtp_family(n, config) == "deepseek-v3"}
    out = [(n, v, mtp_scheme(n, v, options, head=False, predicate=predicate))
           for n, v in mtp.items() if n not in nextn]
    if not nextn:
        return out
    layers = _layers(nextn)
    deeper = model_for(config, where, max(index for _, index in layers) + 1)
    modules = dict(deeper.named_modules()) if deeper is not None else {}
    block_predicate = getattr(deeper, "quant_predicate", None) if deeper is not None else predicate
    for (prefix, index), names in sorted(layers.items()):
        layer = {n: nextn[n] for n in names}
        if deeper is not None and hasattr(deeper, "sanitize"):  # else mlx-lm does not know it: kept as stored
            # The whole layer: the sanitizer passes the own parts through (an FP8 one dequantized).
            layer = sanitize_alone(deeper, layer, prefix, index)
        for name, value in layer.items():
            rest = name[len(f"{prefix}{index}."):]
            if rest.startswith(NEXTN_OWN) or deeper is None:
                scheme = mtp_scheme(name, value, options, head=rest.startswith(NEXTN_HEAD), predicate=block_predicate)
            else:
                scheme = trunk_scheme(name, value, modules, block_predicate, default)
            out.append((name, value, scheme))
    return out
