"""The shipped GLM-4.5-shaped demo checkpoint (``omlx_mtp/fixtures/demo_glm``, trained by
``scripts/train_demo_glm.py``) and its trained MTP ("nextn") layer: lossless greedy decoding, real
acceptance, and the mistakes that must cost it — the layer's inputs concatenated in the wrong
order, the trunk's state read before its final norm, the layer looked for at the wrong index.

mlx's CPU gather_mm (the routed experts) runs float32 only, so the bf16 checkpoint runs upcast."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from omlx_mtp import fixtures
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.decode.requests import Request
from omlx_mtp.drafters import load_merged_drafter, nextn
from omlx_mtp.drafters.nextn import NextnLayer
from omlx_mtp.errors import CheckpointError
from omlx_mtp.targets import Glm4MoeTarget, wrap_target
from omlx_mtp.tools.session import run_plain
from omlx_mtp.training.glm4_moe import CODE_PROMPTS, acceptance

GLM_DIR = Path(fixtures.__file__).resolve().parent / "demo_glm"
MAX_TOKENS = 64
# Measured on the shipped checkpoint over these prompts at K=1, T=0: the trained layer accepts 0.73,
# with its inputs concatenated the other way round 0.00, fed the pre-norm state 0.15.
TRAINED_AT_LEAST = 0.6
MUTATED_BELOW = 0.3


class Checkpoint:
    def __init__(self):
        self.model, self.tokenizer, self.config = load_target(GLM_DIR)
        self.model.set_dtype(mx.float32)
        self.target = wrap_target(self.model)
        self.layer = load_merged_drafter(GLM_DIR, self.target)
        self.layer.set_dtype(mx.float32)
        self.prompts = [self.tokenizer.encode(p) for p in CODE_PROMPTS]
        self.plain = [run_plain(self.model, Request(p, max_tokens=MAX_TOKENS)).row.generated for p in self.prompts]

    def greedy(self, target=None, K: int = 1):
        return acceptance(target or self.target, self.layer, self.prompts, K, 0.0, MAX_TOKENS)


@pytest.fixture(scope="module")
def glm():
    return Checkpoint()


@pytest.fixture(scope="module")
def trained(glm):
    return glm.greedy()


def test_checkpoint_is_glm_shaped(glm):
    assert isinstance(glm.target, Glm4MoeTarget) and isinstance(glm.layer, NextnLayer)
    assert glm.config["num_nextn_predict_layers"] == 1 and glm.config["partial_rotary_factor"] == 0.5
    assert not glm.layer.own_embedding and not glm.layer.own_head  # the trunk's, as GLM-4.6's bf16 release
    for tokens in glm.plain:
        assert len(set(tokens)) >= 16, tokens  # a model repeating a token or two would accept anything


@pytest.mark.parametrize("K", [1, 3])
def test_greedy_mtp_equals_plain(glm, trained, K):
    rate, rows = trained if K == 1 else glm.greedy(K=K)
    assert [r.generated for r in rows] == glm.plain
    assert sum(r.stats.drafted for r in rows) > 0


def test_trained_layer_is_accepted(trained):
    rate, _ = trained
    assert rate > TRAINED_AT_LEAST


class _SwappedConcat:
    """mlx.core as nextn sees it, except that concatenate takes its arrays in reverse order:
    [hnorm(h), enorm(embedding)] instead of the order the weights were trained in."""

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def concatenate(arrays, axis=0):
        return mx.concatenate(list(arrays)[::-1], axis=axis)


def test_swapped_concatenation_is_rejected(glm, trained, monkeypatch):
    monkeypatch.setattr(nextn, "mx", _SwappedConcat())
    rate, rows = glm.greedy()
    assert [r.generated for r in rows] == glm.plain  # still lossless: only the drafts are wrong
    assert rate < MUTATED_BELOW < trained[0]


class PreNormTarget(Glm4MoeTarget):
    """The trunk as it is, but the hidden state handed on (to the MTP layer) is the body's output
    before its final norm; the head applies the norm, so the target's own logits are unchanged."""

    def hidden(self, tokens, cache):
        norm, self.body.norm = self.body.norm, nn.Identity()
        try:
            return super().hidden(tokens, cache)
        finally:
            self.body.norm = norm

    def head(self, hidden):
        return super().head(self.body.norm(hidden))


def test_pre_norm_state_is_rejected(glm, trained):
    rate, rows = glm.greedy(target=PreNormTarget(glm.model))
    assert [r.generated for r in rows] == glm.plain
    assert rate < MUTATED_BELOW < trained[0]


def _with_layers(tmp_path, shift: int):
    """A copy of the checkpoint whose config.json counts ``shift`` more trunk layers."""
    copy = tmp_path / "glm"
    shutil.copytree(GLM_DIR, copy)
    config = json.loads((copy / "config.json").read_text())
    config["num_hidden_layers"] += shift
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_mtp_layer_looked_for_at_the_wrong_index_is_refused(tmp_path):
    """One layer fewer: the trunk loads (its last layer dropped as if it were the MTP layer), and
    the layer at index num_hidden_layers, a trunk layer without enorm/hnorm, is refused."""
    copy = _with_layers(tmp_path, -1)
    model, _, _ = load_target(copy, with_tokenizer=False)
    with pytest.raises(CheckpointError, match="is not an MTP layer .* num_hidden_layers"):
        load_merged_drafter(copy, wrap_target(model))


def test_mtp_layer_taken_for_a_trunk_layer_is_refused(tmp_path):
    """One layer more: the MTP layer's own tensors have no place in a trunk layer."""
    with pytest.raises(CheckpointError, match="do not match config.json"):
        load_target(_with_layers(tmp_path, 1), with_tokenizer=False)
