"""Qwen3-Next (``qwen3_next``) with its built-in MTP head: the hybrid target (Gated DeltaNet with
fused projections + full attention, MoE with a shared expert in every layer and in the head)
decoded through the same loop, lossless in float32, linear-attention state taken back per row.

The decoding tests are the Qwen3.5 suite's own (tests/test_qwen3_5.py), collected here over the
``qwen`` fixture below: they read only what every ``Checkpoint`` has (target, head, references),
so each runs on this family's checkpoint as it runs on Qwen3.5's."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_next

from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.drafters import load_merged_drafter, qwen3_5_mtp
from omlx_mtp.errors import CheckpointError
from omlx_mtp.fixtures.tiny_qwen_next import TinyQwenNextSpec, build, write_qwen_next
from omlx_mtp.targets import Qwen3NextMlxLmTarget, wrap_target

from .test_qwen3_5 import Checkpoint
from .test_qwen3_5 import (  # noqa: F401  (collected here, over this module's ``qwen``)
    test_built_in_head_greedy_equals_plain,
    test_far_past_a_prefill_chunk_with_a_small_prefill_step,
    test_head_reads_exactly_the_committed_pairs,
    test_oracle_with_errors_rolls_back_every_round,
    test_rows_ending_inside_a_plain_stretch,
    test_rows_joining_late_through_the_host_api,
    test_skipping_the_linear_state_rollback_breaks_losslessness,
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return Checkpoint(tmp_path_factory.mktemp("qwen-next"), TinyQwenNextSpec(), write=write_qwen_next)


def test_fixture_is_published_hybrid_and_wanders(qwen):
    index = json.loads((qwen.dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == qwen.spec.shards
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in index and "mtp.fc.weight" in index
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index and "model.layers.0.linear_attn.in_proj_qkvz.weight" in index
    assert not any("switch_mlp" in n or "gate_up_proj" in n for n in index)
    assert isinstance(qwen.target, Qwen3NextMlxLmTarget)
    assert qwen.target.linear == [True, True, True, False]
    layer = qwen.head.layers[0]
    assert isinstance(layer, qwen3_next.Qwen3NextDecoderLayer) and not layer.is_linear
    assert isinstance(layer.mlp, qwen3_next.Qwen3NextSparseMoeBlock)
    for tokens in qwen.references.values():
        assert len(set(tokens)) >= 40, tokens  # DESIGN §8: a repeating model proves nothing


def test_head_loads_as_built(qwen):
    """Per-expert head tensors stacked, (1 + w) norms shifted back, shared_expert_gate kept: the
    loaded head is the one the fixture made, array for array."""
    _, built = build(qwen.spec)
    expected, got = dict(tree_flatten(built.parameters())), dict(tree_flatten(qwen.head.parameters()))
    assert expected.keys() == got.keys()
    assert "layers.0.mlp.shared_expert_gate.weight" in got and "layers.0.mlp.switch_mlp.up_proj.weight" in got
    assert all(mx.array_equal(expected[k], got[k]).item() for k in expected)


def test_checkpoint_without_head_tensors_is_refused(tmp_path):
    directory = write_qwen_next(tmp_path / "nohead", with_head=False)
    model, _, _ = load_target(directory, with_tokenizer=False)  # the trunk alone loads
    with pytest.raises(CheckpointError, match=r"num_nextn_predict_layers: 1\) but no mtp\.\*") as error:
        load_merged_drafter(directory, wrap_target(model))
    assert str(directory) in str(error.value)


def test_the_head_is_counted_as_qwen3_next_configs_count_it():
    config = {"model_type": "qwen3_next", "num_hidden_layers": 48}
    assert qwen3_5_mtp.has_head({**config, "num_nextn_predict_layers": 1})
    assert qwen3_5_mtp.has_head(config)  # not counted: one layer, as vLLM assumes
    assert not qwen3_5_mtp.has_head({**config, "num_nextn_predict_layers": 0})


def test_plugin_loads_the_built_in_head_for_omlx(qwen, tmp_path, caplog):
    from omlx_mtp.hosts.omlx import plugin

    settings = {"mtp_enabled": True, "mtp_draft_tokens": 2}
    drafter = plugin.omlx_load_drafter(model_id="n", model_path=str(qwen.dir), model=qwen.model, settings=settings)
    assert drafter is not None
    assert plugin.omlx_decode_strategy(model_id="n", model=qwen.model, drafter=drafter, settings=settings) is not None
    bare = write_qwen_next(tmp_path / "bare", with_head=False)
    model, _, _ = load_target(bare, with_tokenizer=False)
    with caplog.at_level("WARNING", logger="omlx_mtp"):
        assert plugin.omlx_load_drafter(model_id="bare", model_path=str(bare), model=model, settings=settings) is None
    assert "MTP disabled for bare" in caplog.text and "mtp.*" in caplog.text


@pytest.mark.parametrize("mtp_bits", [None, 8], ids=["head-kept", "head-8bit"])
def test_quantized_checkpoint_keeps_a_lossless_head(qwen, tmp_path, mtp_bits):
    """``omlx-mtp quantize`` of the release: a 4-bit trunk that mlx-lm loads, and the head kept
    (or quantized per expert, then stacked with its quantization) decoding losslessly."""
    from omlx_mtp.checkpoint.quantize import QuantizeOptions, quantize
    from omlx_mtp.decode.loop import SpeculativeDecoder
    from omlx_mtp.decode.requests import Request
    from omlx_mtp.tools.session import run_plain

    out = quantize(qwen.dir, tmp_path / "q", QuantizeOptions(group_size=32, dtype="float32", mtp_bits=mtp_bits),
                   progress=False)
    model, _, _ = load_target(out, with_tokenizer=False)
    target = wrap_target(model)
    head = load_merged_drafter(out, target)
    assert type(head.layers[0].mlp.switch_mlp.up_proj).__name__ == ("SwitchLinear" if mtp_bits is None
                                                                     else "QuantizedSwitchLinear")
    if mtp_bits is not None:
        assert head.layers[0].mlp.switch_mlp.up_proj.bits == mtp_bits
        _name_overrides_per_expert(out, qwen.spec.num_experts)  # as omlx-mtp 0.2.0's quantizer wrote them
        assert load_merged_drafter(out, target).layers[0].mlp.switch_mlp.up_proj.bits == mtp_bits
    requests = [Request(list(p), max_tokens=60) for p in list(qwen.references)[:4]]
    rows = SpeculativeDecoder(target, head, draft_tokens=3).generate(requests)
    assert [row.generated for row in rows] == [run_plain(model, r).row.generated for r in requests]


def _name_overrides_per_expert(directory, experts: int) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in [k for k in config["quantization"] if ".switch_mlp." in k]:
        value = config["quantization"].pop(key)
        config["quantization"].update({key.replace(".switch_mlp.", f".experts.{e}."): value for e in range(experts)})
    path.write_text(json.dumps(config))


def test_layout_is_transformers_own(qwen, tmp_path):
    """The fixture is laid out as the release: transformers' Qwen3NextForCausalLM loads it with no
    missing, unexpected (``mtp.*`` aside, which it ignores) or mis-shaped tensor, computes
    mlx-lm's logits, and saves its trunk under exactly the fixture's names and shapes."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3NextForCausalLM"):
        pytest.skip("this transformers has no Qwen3-Next")
    from omlx_mtp.checkpoint.files import tensor_infos

    hf, info = transformers.Qwen3NextForCausalLM.from_pretrained(qwen.dir, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    ids = np.random.default_rng(0).integers(3, qwen.spec.vocab_size, (1, 40))
    with torch.no_grad():
        reference = hf.eval()(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.array(qwen.model(mx.array(ids))), reference, atol=2e-3, rtol=1e-3)
    hf.save_pretrained(tmp_path / "hf")
    shapes = lambda d: {n: s for n, (_, _, s) in tensor_infos(d).items() if not n.startswith("mtp.")}  # noqa: E731
    assert shapes(tmp_path / "hf") == shapes(qwen.dir)
