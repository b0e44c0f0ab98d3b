"""``omlx-mtp inspect``: what a checkpoint holds — quantization, MTP tensors, a merged assistant
and whether it fits — read from config.json and the safetensors headers only.  Whether it loads,
and its drafter fits, is the validation pass's verdict (``validation``), the one ``generate``'s
loaders give: ``inspect`` says "fits" exactly when ``generate`` would draft."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .files import DTYPE_BYTES, read_config, tensor_infos
from ..drafters import merged_assistant_config
from ..drafters import nextn, qwen3_5_mtp
from ..errors import CheckpointError, MTPError
from .mtp_tensors import mtp_family
from .validation import problem as load_problem

_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32", "U32": "uint32"}


def _size(dtype: str, shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES[dtype]


def _precision(name: str, infos: dict, quantization: dict | None) -> str:
    path = name.rsplit(".", 1)[0]
    if f"{path}.scales" in infos and name.endswith(".weight"):
        override = (quantization or {}).get(path)
        scheme = override if isinstance(override, dict) else (quantization or {})
        mode = scheme.get("mode", "affine")
        return f"{scheme.get('bits', '?')}-bit {mode}"
    return _NAMES.get(infos[name][1], infos[name][1])


def inspect_checkpoint(directory: str | Path) -> dict:
    directory = Path(directory)
    report = {"path": str(directory), "problems": []}
    try:
        config = read_config(directory)
        infos = tensor_infos(directory)
    except (CheckpointError, MTPError) as exc:
        report["problems"].append(str(exc))
        return report
    quantization = config.get("quantization")
    report["model_type"] = config.get("model_type")
    report["quantization"] = (
        None if not quantization else
        {**{k: quantization[k] for k in ("group_size", "bits", "mode") if k in quantization},
         "per_module_overrides": sum(isinstance(v, (dict, bool)) for v in quantization.values())}
    )
    report["tensors"] = {"count": len(infos), "bytes": sum(_size(d, s) for _, d, s in infos.values())}

    mtp_names = [n for n in infos if mtp_family(n, config)]
    precision = Counter(_precision(n, infos, quantization) for n in mtp_names if not n.endswith((".scales", ".biases")))
    report["mtp"] = {
        "count": len(mtp_names),
        "bytes": sum(_size(infos[n][1], infos[n][2]) for n in mtp_names),
        "families": dict(Counter(mtp_family(n, config) for n in mtp_names)),
        "precision": dict(precision),
        "tensors": {n: {"dtype": infos[n][1], "shape": infos[n][2], "precision": _precision(n, infos, quantization)}
                    for n in sorted(mtp_names)},
    }

    report["towers"] = _towers(config, infos, quantization)
    for kind, tower in report["towers"].items():
        if tower["configured"] and not tower["count"]:
            report["problems"].append(f"config.json configures a {kind} tower but the checkpoint has no {kind} tensors")

    merged = merged_assistant_config(config)
    if merged is not None:
        assistant, prefix = merged
        report["drafter"] = _describe_assistant(assistant)
        report["drafter"]["merged"] = True
        if not any(n.startswith(prefix) for n in infos):
            report["problems"].append(f"config.json embeds an assistant but there are no {prefix}* tensors")
        report["problems"] += report["drafter"]["problems"]
    elif qwen3_5_mtp.has_head(config):
        text = config.get("text_config") or config
        report["drafter"] = {"model_type": qwen3_5_mtp.FAMILY, "built_in": True, "merged": False,
                             "layers": qwen3_5_mtp.head_layers(config), "hidden_size": text.get("hidden_size"),
                             "problems": []}
        if not any(n.startswith(qwen3_5_mtp.PREFIXES) for n in infos):
            key = qwen3_5_mtp.layers_key(config)
            promise = (f"config.json promises a built-in MTP head ({key})" if key in text
                       else "a Qwen3-Next checkpoint carries a built-in MTP head")
            report["drafter"]["problems"].append(
                f"{promise} but there are no mtp.* tensors (add them back with `omlx-mtp add-mtp`)")
        report["problems"] += report["drafter"]["problems"]
    elif nextn.has_nextn(config):
        report["drafter"] = _describe_nextn(config, infos, quantization)
        report["problems"] += report["drafter"]["problems"]
    elif config.get("model_type") == "gemma4_assistant":
        report["drafter"] = _describe_assistant(config)
        report["drafter"]["merged"] = False
        report["problems"] += report["drafter"]["problems"]
    else:
        report["drafter"] = None
    verdict = load_problem(directory)  # what generate's loaders say, lazily
    if report["drafter"] is not None and report["drafter"].get("merged"):
        report["drafter"]["fits_target"] = verdict is None
    if verdict is not None and not report["problems"]:  # the specific findings above say it better
        report["problems"].append(verdict)
    return report


def _describe_nextn(config: dict, infos: dict, quantization: dict | None) -> dict:
    """The MTP layer a nextn config promises (``num_nextn_predict_layers``) at
    ``model.layers.{num_hidden_layers}``: where its tensors are, what it owns, at what precision."""
    text = config.get("text_config") or config
    expected = int(text.get("num_hidden_layers", 0))
    found: dict[int, list[str]] = {}  # layer index -> its tensors, for layers with an MTP layer's own parts
    for name in infos:
        parts = name.split(".")
        if name.startswith("model.layers.") and len(parts) > 3 and parts[2].isdigit():
            found.setdefault(int(parts[2]), []).append(name)
    mtp_layers = sorted(i for i, names in found.items()
                        if any(n.split(".", 3)[3].startswith(nextn.OWN[:3]) for n in names))
    index = expected if expected in mtp_layers else (mtp_layers[0] if mtp_layers else None)
    names = found.get(index, []) if index is not None else []
    own = {n.split(".", 3)[3] for n in names}
    precision = Counter(_precision(n, infos, quantization) for n in names if not n.endswith((".scales", ".biases")))
    out = {"model_type": nextn.FAMILY, "family": mtp_family(f"model.layers.{expected}.eh_proj.weight", config),
           "built_in": True, "merged": False, "layers": nextn.nextn_layers(config), "index": index,
           "expected_index": expected, "hidden_size": text.get("hidden_size"), "own_embedding":
           "embed_tokens.weight" in own, "own_head": "shared_head.head.weight" in own,
           "count": len(names), "precision": dict(precision), "problems": []}
    if index is None:
        out["problems"].append(f"config.json promises an MTP layer (num_nextn_predict_layers: {out['layers']}) but "
                               f"there are no model.layers.{expected}.* tensors "
                               "(add them back with `omlx-mtp add-mtp`)")
    elif index != expected:
        out["problems"].append(f"the MTP layer's tensors sit at model.layers.{index}, not at model.layers.{expected} "
                               f"(num_hidden_layers): num_hidden_layers does not match the checkpoint")
    return out


# Tensor names of the multimodal towers (mlx-vlm's names and the Hugging Face release's "model." ones).
_TOWERS = {"vision": ("vision_tower.", "embed_vision.", "visual."), "audio": ("audio_tower.", "embed_audio.")}


def _towers(config: dict, infos: dict, quantization: dict | None) -> dict:
    out = {}
    for kind, prefixes in _TOWERS.items():
        names = [n for n in infos if n.removeprefix("model.").startswith(prefixes)]
        precision = Counter(_precision(n, infos, quantization) for n in names if not n.endswith((".scales", ".biases")))
        out[kind] = {"configured": bool(config.get(f"{kind}_config")), "count": len(names),
                     "bytes": sum(_size(infos[n][1], infos[n][2]) for n in names), "precision": dict(precision)}
    return out


def _describe_assistant(assistant: dict) -> dict:
    text = assistant.get("text_config") or {}
    out = {
        "model_type": assistant.get("model_type"),
        "layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "backbone_hidden_size": assistant.get("backbone_hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "centroid_head": bool(assistant.get("use_ordered_embeddings")),
        "problems": [],
    }
    return out


def render(report: dict) -> str:
    lines = [f"checkpoint: {report['path']}"]
    if "model_type" in report:
        lines.append(f"model type: {report['model_type']}")
        q = report["quantization"]
        lines.append("quantization: none" if not q else
                     f"quantization: {q.get('bits')}-bit {q.get('mode', 'affine')}, group {q.get('group_size')}, "
                     f"{q['per_module_overrides']} per-module overrides")
        lines.append(f"tensors: {report['tensors']['count']} ({report['tensors']['bytes'] / 1e6:.1f} MB)")
        mtp = report["mtp"]
        if mtp["count"]:
            families = ", ".join(f"{k}: {v}" for k, v in mtp["families"].items())
            precision = ", ".join(f"{k}: {v}" for k, v in mtp["precision"].items())
            lines.append(f"MTP tensors: {mtp['count']} ({mtp['bytes'] / 1e6:.1f} MB) [{families}] precision [{precision}]")
        else:
            lines.append("MTP tensors: none")
        for kind, tower in report.get("towers", {}).items():
            if tower["configured"] or tower["count"]:
                precision = ", ".join(f"{k}: {v}" for k, v in tower["precision"].items())
                lines.append(f"{kind} tower: {tower['count']} tensors ({tower['bytes'] / 1e6:.1f} MB) precision [{precision}]")
        drafter = report.get("drafter")
        if drafter and drafter.get("model_type") == nextn.FAMILY:
            where = "missing" if drafter["index"] is None else f"model.layers.{drafter['index']}"
            precision = ", ".join(f"{k}: {v}" for k, v in drafter["precision"].items())
            embedding, head = ("its own" if drafter[k] else "the trunk's" for k in ("own_embedding", "own_head"))
            lines.append(f"drafter: built-in MTP layer ({drafter['family']}) at {where}, {embedding} embedding, "
                         f"{head} head, precision [{precision}]")
        elif drafter and drafter.get("built_in"):
            lines.append(f"drafter: built-in MTP head ({drafter['model_type']}), {drafter['layers']} layer(s), "
                         f"hidden {drafter['hidden_size']}")
        elif drafter:
            kind = "merged assistant" if drafter["merged"] else "assistant checkpoint"
            fits = {True: ", fits the target", False: ", DOES NOT fit the target"}.get(drafter.get("fits_target"), "")
            lines.append(f"drafter: {kind}, {drafter['layers']} layers, hidden {drafter['hidden_size']}, backbone "
                         f"{drafter['backbone_hidden_size']}, {'centroid' if drafter['centroid_head'] else 'tied'} head"
                         f"{fits}")
    for problem in report["problems"]:
        lines.append(f"problem: {problem}")
    return "\n".join(lines)
