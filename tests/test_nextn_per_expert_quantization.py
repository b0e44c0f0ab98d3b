"""A quantized checkpoint whose nextn layer keeps its experts one by one, each with its own
quantization override in config.json, as oMLX's oQ writes the layer (it quantizes tensors as the
release names them): the layer loads into its stacked experts, at the overrides' scheme."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.targets import wrap_target
from omlx_mtp.tools.cli import main

pytest.importorskip("transformers")
pytest.importorskip("torch")

PROJECTIONS = ("gate_proj", "up_proj")  # quantized at the default group size (64); down_proj (32 wide) is not
GROUP = 32  # the per-expert overrides' group size, other than the default


def test_per_expert_overrides_load_into_the_stacked_experts(tmp_path):
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    spec = TinyNextnSpec(family="glm4_moe")
    src, out = write_nextn(tmp_path / "src", spec), tmp_path / "q"
    assert main(["quantize", str(src), str(out), "--bits", "8", "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    prefix = f"model.layers.{spec.num_layers}.mlp."
    shard = out / "mtp.safetensors"
    tensors = mx.load(str(shard))
    mx.eval(tensors)  # read before the file is written again
    written = {}
    for proj in PROJECTIONS:
        stacked = f"{prefix}switch_mlp.{proj}."
        assert tensors[stacked + "scales"].shape[-1] == spec.hidden_size // 64  # quantized at the default
        full = mx.dequantize(*(tensors.pop(stacked + k) for k in ("weight", "scales", "biases")), group_size=64, bits=8)
        for e in range(spec.num_experts):
            module = f"{prefix}experts.{e}.{proj}"
            weight, scales, biases = mx.quantize(full[e], group_size=GROUP, bits=8)
            tensors.update({module + ".weight": weight, module + ".scales": scales, module + ".biases": biases})
            config["quantization"][module] = {"group_size": GROUP, "bits": 8}
            written[(proj, e)] = weight
    down = tensors.pop(f"{prefix}switch_mlp.down_proj.weight")
    tensors.update({f"{prefix}experts.{e}.down_proj.weight": down[e] for e in range(spec.num_experts)})
    mx.save_safetensors(str(shard), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    index = json.loads((out / "model.safetensors.index.json").read_text())  # the index as oQ writes it
    index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if v != shard.name},
                           **{k: shard.name for k in tensors}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))

    model, _, _ = load_target(out)
    layer = load_merged_drafter(out, wrap_target(model))
    experts = layer.block.mlp.switch_mlp
    for (proj, e), weight in written.items():
        module = getattr(experts, proj)
        assert module.group_size == GROUP
        assert mx.array_equal(module.weight[e], weight)
    assert mx.array_equal(experts.down_proj.weight, down)
