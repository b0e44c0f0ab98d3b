"""The tiny "nextn" checkpoints (GLM-4.5/4.6/4.7, GLM-4.7-Flash, DeepSeek-V3, V3.2) are laid out as
the releases are: sharded with a complete index, the MTP block stored as decoder layer N beside an
N-layer trunk, and the trunk loadable by mlx-lm."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the nextn fixtures are built by transformers' models (torch)")
pytest.importorskip("transformers", reason="the nextn fixtures are built by transformers' models")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.utils import _get_classes, load_model  # noqa: E402
from safetensors import safe_open  # noqa: E402

from omlx_mtp.fixtures.tiny_nextn import FAMILIES, MLA_FAMILIES, TinyNextnSpec, write_nextn  # noqa: E402

ATTENTION = {
    "glm4_moe": [f"{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")] + ["o_proj.weight", "q_norm.weight",
                                                                                "k_norm.weight"],
    "mla": ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"],
    "indexer": ["indexer.wq_b.weight", "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
                "indexer.weights_proj.weight"],
}
OWN = ("embed_tokens.weight", "shared_head.head.weight")


def _attention(family: str) -> list[str]:
    names = ATTENTION["mla"] if family in MLA_FAMILIES else ATTENTION["glm4_moe"]
    return names + (ATTENTION["indexer"] if family == "deepseek_v32" else [])


class Checkpoint:
    def __init__(self, directory, spec):
        self.spec, self.dir = spec, write_nextn(directory, spec)
        self.config = json.loads((directory / "config.json").read_text())
        self.index = json.loads((directory / "model.safetensors.index.json").read_text())
        self.shards = {}  # file -> {name: (dtype, shape)}
        for file in sorted(directory.glob("model-*.safetensors")):
            with safe_open(str(file), "np") as f:
                self.shards[file.name] = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                                          for k in f.keys()}

    def tensor(self, name):
        with safe_open(str(self.dir / self.index["weight_map"][name]), "np") as f:
            return f.get_tensor(name)

    def shape(self, name):
        return self.shards[self.index["weight_map"][name]][name][1]


@pytest.fixture(scope="module", params=[(f, own) for f in FAMILIES for own in (True, False)],
                ids=lambda p: f"{p[0]}-{'own' if p[1] else 'shared'}-head")
def checkpoint(request, tmp_path_factory):
    family, own = request.param
    spec = TinyNextnSpec(family=family, own_embed_head=own)
    return Checkpoint(tmp_path_factory.mktemp(f"{family}-{own}"), spec)


def test_the_index_lists_every_tensor_of_every_shard(checkpoint):
    weight_map = checkpoint.index["weight_map"]
    assert len(checkpoint.shards) >= 2
    assert all(f"-of-{len(checkpoint.shards):05d}." in name for name in checkpoint.shards)
    in_files = {name: file for file, names in checkpoint.shards.items() for name in names}
    assert in_files == weight_map
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    total = sum(sizes[d] * int(np.prod(s)) for names in checkpoint.shards.values() for d, s in names.values())
    assert checkpoint.index["metadata"]["total_size"] == total


def test_the_mtp_block_is_decoder_layer_n(checkpoint):
    spec, weight_map = checkpoint.spec, checkpoint.index["weight_map"]
    n, h, v = spec.num_layers, spec.hidden_size, spec.vocab_size
    assert checkpoint.config["num_hidden_layers"] == n
    assert checkpoint.config["num_nextn_predict_layers"] == 1
    layers = {int(name.split(".")[2]) for name in weight_map if name.startswith("model.layers.")}
    assert layers == set(range(n + 1))
    mtp = {name.removeprefix(f"model.layers.{n}.") for name in weight_map if name.startswith(f"model.layers.{n}.")}
    # a full decoder layer of the family's kind: MoE, experts stored one by one
    decoder = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight",
               "mlp.gate.e_score_correction_bias"]
    decoder += [f"self_attn.{name}" for name in _attention(spec.family)]
    decoder += [f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    decoder += [f"mlp.experts.{e}.{p}_proj.weight" for e in range(spec.num_experts) for p in ("gate", "up", "down")]
    extras = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    assert mtp == set(decoder) | extras | (set(OWN) if spec.own_embed_head else set())
    last_trunk = {name.removeprefix(f"model.layers.{n - 1}.") for name in weight_map
                  if name.startswith(f"model.layers.{n - 1}.")}
    assert last_trunk == set(decoder)  # the MTP layer is the trunk's layer kind, nothing less
    mtp_name = f"model.layers.{n}."
    assert checkpoint.shape(mtp_name + "eh_proj.weight") == (h, 2 * h)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        assert checkpoint.shape(mtp_name + name) == (h,)
    if spec.own_embed_head:  # its own, random and not the trunk's
        for own, trunk in zip(OWN, ("model.embed_tokens.weight", "lm_head.weight")):
            assert checkpoint.shape(mtp_name + own) == (v, h)
            assert not np.allclose(checkpoint.tensor(mtp_name + own), checkpoint.tensor(trunk))


def test_the_router_bias_stays_float32_in_bfloat16(tmp_path):
    ck = Checkpoint(tmp_path, TinyNextnSpec(family="deepseek_v3", dtype="bfloat16", own_embed_head=False))
    dtypes = {name: d for names in ck.shards.values() for name, (d, _) in names.items()}
    assert {d for name, d in dtypes.items() if name.endswith("e_score_correction_bias")} == {"F32"}
    assert {d for name, d in dtypes.items() if not name.endswith("e_score_correction_bias")} == {"BF16"}


def _top_level_rope(config: dict) -> dict:
    """transformers 5's nested RoPE entries as the releases spell them (what the package's loader does)."""
    nested = config.get("rope_parameters")
    if not nested:
        return {}
    out = {k: nested[k] for k in ("rope_theta", "partial_rotary_factor") if k in nested}
    kind = nested.get("rope_type", "default")
    rest = {k: x for k, x in nested.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type")}
    out["rope_scaling"] = None if kind == "default" else {**rest, "type": kind}
    return out


def _without_mtp_layers(n: int):
    """mlx-lm's classes, whose sanitizer also drops layers >= n: DeepSeek-V3's drops only
    ``model.layers.61`` (the release's N), so any other N fails a strict load on the MTP layer."""
    def get_classes(config):
        model_class, args_class = _get_classes(config)

        class Trunk(model_class):
            def sanitize(self, weights):
                keep = {k: w for k, w in weights.items()
                        if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
                return super().sanitize(keep)

        return Trunk, args_class
    return get_classes


def load_trunk(directory, config):
    n = config["num_hidden_layers"]
    overrides = _top_level_rope(config)
    try:
        return load_model(directory, model_config=overrides)[0]
    except ValueError as exc:
        if config["model_type"] != "deepseek_v3":
            raise
        extra = str(exc).partition("parameters not in model:")[2]
        assert extra and all(name.strip().startswith(f"model.layers.{n}.") for name in extra.strip(" .\n").split(","))
    return load_model(directory, model_config=overrides, get_model_classes=_without_mtp_layers(n))[0]


def test_mlx_lm_loads_the_trunk(checkpoint):
    model = load_trunk(checkpoint.dir, checkpoint.config)
    assert len(model.layers) == checkpoint.spec.num_layers
    assert np.array_equal(np.array(model.model.embed_tokens.weight),
                          checkpoint.tensor("model.embed_tokens.weight").astype(np.float32))
    logits = model(mx.array([[5, 9, 200, 31, 7]]))
    assert logits.shape == (1, 5, checkpoint.spec.vocab_size) and bool(mx.isfinite(logits).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_both_config_spellings_load_alike(family, tmp_path):
    models, configs = [], []
    for spelling in ("published", "transformers"):
        spec = TinyNextnSpec(family=family, spelling=spelling, own_embed_head=False)
        directory = write_nextn(tmp_path / spelling, spec)
        configs.append(json.loads((directory / "config.json").read_text()))
        models.append(load_trunk(directory, configs[-1]))
    published, nested = configs
    assert "rope_theta" in published and "rope_scaling" in published and "rope_parameters" not in published
    assert "rope_parameters" in nested and "rope_theta" not in nested and "rope_scaling" not in nested
    assert published["num_hidden_layers"] == nested["num_hidden_layers"] == 3
    tokens = mx.array([list(range(3, 43))])  # 40 tokens: past V3.2's index_topk, so sparse attention runs
    assert np.array_equal(np.array(models[0](tokens)), np.array(models[1](tokens)))


def test_greedy_paths_wander(tmp_path):
    """A random model with default init repeats one token under greedy decoding; these do not."""
    from mlx_lm.generate import generate_step

    for family in FAMILIES:
        spec = TinyNextnSpec(family=family, own_embed_head=False)
        directory = write_nextn(tmp_path / family, spec)
        model = load_trunk(directory, json.loads((directory / "config.json").read_text()))
        prompt = mx.array([int(t) for t in np.random.default_rng(1).integers(3, spec.vocab_size, 8)])
        tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=100, sampler=lambda x: mx.argmax(x, -1))]
        assert len(set(tokens)) >= 30, (family, len(set(tokens)))


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_and_transformers_agree_on_the_trunk(family, tmp_path):
    """The per-expert split and the config round-trip: transformers reads the checkpoint back (its
    own conversion fuses the experts again) and computes the logits mlx-lm does."""
    import torch
    import transformers

    import mlx_lm

    if family == "deepseek_v32" and tuple(int(v) for v in mlx_lm.__version__.split(".")[:2]) < (0, 32):
        pytest.skip("mlx-lm 0.31's V3.2 indexer picks other keys than transformers' past index_topk "
                    "(the fixture's 32); mlx-lm 0.32 agrees")
    spec = TinyNextnSpec(family=family, own_embed_head=False)
    directory = write_nextn(tmp_path, spec)
    model = load_trunk(directory, json.loads((directory / "config.json").read_text()))
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                        output_loading_info=True)
    assert not info["missing_keys"]
    assert {k.split(".")[2] for k in info["unexpected_keys"]} == {str(spec.num_layers)}  # only the MTP layer
    tokens = np.random.default_rng(0).integers(3, spec.vocab_size, (1, 40))
    with torch.no_grad():
        expected = reference.eval()(torch.tensor(tokens)).logits.numpy()
    got = np.array(model(mx.array(tokens.tolist())))
    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()
