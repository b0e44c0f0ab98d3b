"""Built-in MTP layers stored the DeepSeek way ("nextn": GLM-4.x, GLM-4.7-Flash, DeepSeek-V3.x),
decoded through the same loop: lossless in float32 for every family as published (sharded with an
index, both config spellings, with and without the layer's own embedding and head)."""

from __future__ import annotations

import importlib
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.requests import Request
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.drafters.nextn import NextnLayer
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.errors import CheckpointError
from omlx_mtp.targets import wrap_target
from omlx_mtp.tools.session import run_plain

from .conftest import prompts, sweep
from . import test_qwen3_5 as qwen_suite
from .test_sampling_lossless import CASES, PROMPT, STEPS, VOCAB, assert_samples_follow, exact_joint

pytest.importorskip("transformers")
pytest.importorskip("torch")
tiny_nextn = importlib.import_module("omlx_mtp.fixtures.tiny_nextn")
MAX_TOKENS = 150

# Each family as published; GLM-4.6's bf16 release has no own embedding/head, and configs come in
# the releases' spelling and in transformers 5's.
CASES_BY_ID = {
    "glm4_moe": dict(family="glm4_moe", own_embed_head=True, spelling="published"),
    "glm4_moe-shared-head": dict(family="glm4_moe", own_embed_head=False, spelling="transformers"),
    "glm4_moe_lite": dict(family="glm4_moe_lite", own_embed_head=True, spelling="transformers"),
    "deepseek_v3": dict(family="deepseek_v3", own_embed_head=True, spelling="published"),
    "deepseek_v32": dict(family="deepseek_v32", own_embed_head=False, spelling="published"),
}


class Checkpoint:
    def __init__(self, directory, spec):
        self.spec = spec
        self.dir = tiny_nextn.write_nextn(directory, spec)
        self.model, self.tokenizer, _ = load_target(self.dir)
        self.target = wrap_target(self.model)
        self.head = load_merged_drafter(self.dir, self.target)
        batch = prompts(20, spec.vocab_size, seed=13)
        self.references = {tuple(p): run_plain(self.model, Request(p, max_tokens=MAX_TOKENS)).row.generated
                           for p in batch}


@pytest.fixture(scope="module", params=sweep(list(CASES_BY_ID), ["glm4_moe-shared-head", "deepseek_v32"]))
def nextn(request, tmp_path_factory):
    spec = tiny_nextn.TinyNextnSpec(**CASES_BY_ID[request.param])
    return Checkpoint(tmp_path_factory.mktemp(request.param), spec)


def _generate(checkpoint, drafter, K):
    requests = [Request(list(p), max_tokens=MAX_TOKENS) for p in checkpoint.references]
    rows = SpeculativeDecoder(checkpoint.target, drafter, draft_tokens=K).generate(requests)
    mismatches = [r.prompt for r, row in zip(requests, rows) if row.generated != checkpoint.references[tuple(r.prompt)]]
    return rows, mismatches


def test_fixture_is_published_layout_and_wanders(nextn):
    index = json.loads((nextn.dir / "model.safetensors.index.json").read_text())["weight_map"]
    N = nextn.target.mtp_layer_index
    assert len(set(index.values())) >= 2
    assert f"model.layers.{N}.eh_proj.weight" in index and f"model.layers.{N + 1}.eh_proj.weight" not in index
    assert isinstance(nextn.head, NextnLayer)
    assert nextn.head.own_embedding == nextn.spec.own_embed_head == nextn.head.own_head
    for tokens in nextn.references.values():
        assert len(set(tokens)) >= 40, tokens  # DESIGN §8: a repeating model proves nothing


@pytest.mark.parametrize("K", sweep([1, 2, 4], [2]))
def test_nextn_layer_greedy_equals_plain(nextn, K):
    if K != 2 and nextn.spec.family == "glm4_moe" and not nextn.spec.own_embed_head:
        pytest.skip("the same layer as glm4_moe's but for its embedding and head: checked at K=2 (CI time)")
    rows, mismatches = _generate(nextn, nextn.head, K)
    assert not mismatches
    assert all(row.finish_reason == "length" for row in rows)
    assert sum(row.stats.drafted for row in rows) > 0


@pytest.mark.parametrize("K", sweep([1, 2, 4], [2]))
def test_oracle_with_errors_rolls_back_every_round(nextn, K):
    oracle = OracleDrafter(nextn.references, nextn.spec.vocab_size, error_rate=0.25, seed=K)
    rows, mismatches = _generate(nextn, oracle, K)
    assert not mismatches
    rate = sum(r.stats.accepted for r in rows) / sum(r.stats.drafted for r in rows)
    assert 0.3 < rate < 0.95  # partial acceptance in most rounds: rows keep different n


# The Qwen heads' tests of what their own cache holds, run on each nextn layout: they read only what
# every Checkpoint has (target, head, references).
test_layer_reads_exactly_the_committed_pairs = qwen_suite.test_head_reads_exactly_the_committed_pairs


@pytest.fixture
def qwen(nextn):
    return nextn


def test_rows_joining_late_through_the_host_api(nextn):
    """oMLX's path: prefilled outside, inserted with mlx-lm caches (V3.2: a CacheList per layer),
    rows joining while others run; finished caches go back as the host's classes."""
    if tuple(int(v) for v in mx.__version__.split(".")[:2]) < (0, 32) and not nextn.spec.own_embed_head:
        # Not understood yet: in this test only, a prefill after an insert dies with SIGFPE inside
        # mlx 0.31.2's CPU scatter (ContiguousIterator::seek dividing by a zero extent); the same
        # prefill run alone passes, and the test passes with mlx 0.32.
        pytest.skip("mlx 0.31.2's CPU scatter crashes (SIGFPE) in this test for layers sharing the trunk's head")
    qwen_suite.test_rows_joining_late_through_the_host_api(nextn)


def test_trunk_loads_at_any_depth(tmp_path):
    """mlx-lm's deepseek_v3 sanitizer drops a fixed ``model.layers.61``: a trunk of another depth
    loads only because the MTP layer is left out by config."""
    directory = tiny_nextn.write_nextn(tmp_path / "ds", tiny_nextn.TinyNextnSpec(family="deepseek_v3", num_layers=2))
    model, _, _ = load_target(directory, with_tokenizer=False)
    assert len(model.model.layers) == 2
    assert isinstance(load_merged_drafter(directory, wrap_target(model)), NextnLayer)


def _copy_with_config(source, destination, **changes):
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_missing_layer_is_refused_naming_it(tmp_path):
    directory = tiny_nextn.write_nextn(tmp_path / "src", tiny_nextn.TinyNextnSpec())
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    N = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
    # A converter that drops the layer: its tensors are gone from the shards and the index.
    for shard in sorted(set(index["weight_map"].values())):
        tensors = mx.load(str(directory / shard))
        mx.save_safetensors(str(directory / shard), {k: v for k, v in tensors.items()
                                                     if not k.startswith(f"model.layers.{N}.")})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(f"model.layers.{N}.")}
    index_file.write_text(json.dumps(index))
    model, _, _ = load_target(directory, with_tokenizer=False)
    with pytest.raises(CheckpointError, match=f"no model.layers.{N}"):
        load_merged_drafter(directory, wrap_target(model))


def test_wrong_layer_index_is_refused(tmp_path):
    """A config whose num_hidden_layers points past the stored layer, or at a trunk layer."""
    source = tiny_nextn.write_nextn(tmp_path / "src", tiny_nextn.TinyNextnSpec(num_layers=3))
    fewer = _copy_with_config(source, tmp_path / "fewer", num_hidden_layers=2)  # layer 2 is a trunk layer
    model, _, _ = load_target(fewer, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="model.layers.2 is not an MTP layer"):
        load_merged_drafter(fewer, wrap_target(model))


def test_layer_that_does_not_fit_is_refused(tmp_path):
    directory = tiny_nextn.write_nextn(tmp_path / "misfit", tiny_nextn.TinyNextnSpec())
    other = tiny_nextn.write_nextn(tmp_path / "wide", tiny_nextn.TinyNextnSpec(hidden_size=96))
    N = 3
    index = json.loads((other / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(index.values())):
        tensors.update({k: v for k, v in mx.load(str(other / shard)).items() if k.startswith(f"model.layers.{N}.")})
    mx.save_safetensors(str(directory / "mtp.safetensors"), tensors)  # found before the trunk's shards
    model, _, _ = load_target(directory, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="does not fit"):
        load_merged_drafter(directory, wrap_target(model))


@pytest.fixture(scope="module")
def small_glm(tmp_path_factory):
    spec = tiny_nextn.TinyNextnSpec(vocab_size=VOCAB, embed_std=0.15, own_embed_head=False)
    directory = tiny_nextn.write_nextn(tmp_path_factory.mktemp("small-glm"), spec, seed=3, with_tokenizer=False)
    model, _, _ = load_target(directory, with_tokenizer=False)
    target = wrap_target(model)
    return model, target, load_merged_drafter(directory, target)


@pytest.mark.slow
@pytest.mark.parametrize("params", CASES[:2], ids=["T1", "T0.7"])
def test_sampling_matches_exact_distribution(small_glm, params):
    model, target, head = small_glm
    joint = exact_joint(model, params)
    rows = SpeculativeDecoder(target, head, draft_tokens=2).generate(
        [Request(PROMPT, params, max_tokens=STEPS) for _ in range(2000)], seed=99)
    samples = np.array([r.generated for r in rows])
    accepted = sum(r.stats.accepted for r in rows)
    assert 0 < accepted < sum(r.stats.drafted for r in rows)
    assert_samples_follow(samples, joint)


def test_plugin_loads_the_layer_for_omlx(nextn, tmp_path, caplog):
    """What oMLX's patched engine asks for: settings with mtp_enabled -> the layer -> a strategy."""
    from omlx_mtp.hosts.omlx import plugin

    settings = {"mtp_enabled": True, "mtp_draft_tokens": 2}
    drafter = plugin.omlx_load_drafter(model_id="g", model_path=str(nextn.dir), model=nextn.model, settings=settings)
    assert isinstance(drafter, NextnLayer)
    assert plugin.omlx_decode_strategy(model_id="g", model=nextn.model, drafter=drafter, settings=settings) is not None
    wrong = _copy_with_config(nextn.dir, tmp_path / "wrong", num_hidden_layers=nextn.spec.num_layers - 1)
    model, _, _ = load_target(wrong, with_tokenizer=False)
    with caplog.at_level("WARNING", logger="omlx_mtp"):
        assert plugin.omlx_load_drafter(model_id="wrong", model_path=str(wrong), model=model, settings=settings) is None
    assert "MTP disabled for wrong" in caplog.text and "not an MTP layer" in caplog.text
