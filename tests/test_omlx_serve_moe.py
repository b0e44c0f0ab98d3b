"""oMLX (0.3.8 and 0.6.2) serving the MoE families with built-in MTP layers, over HTTP: a GLM-4.5-Air-like
checkpoint (mlx-lm ``glm4_moe``, its nextn layer at ``model.layers.{N}``) quantized by ``omlx-mtp
quantize`` and by oMLX's own oQ (patched: the layer kept; on 0.6.2 where its "preserve MTP"
switch is on), and a Qwen3-Next-like one (``qwen3_next``,
``mtp.*``) quantized by ``omlx-mtp quantize``.

GLM-4.5-Air ships the layer's own ``embed_tokens`` and ``shared_head.head`` (GLM-4.6's bf16 release
is the one that leaves them out), so the GLM checkpoint has them; here they equal the trunk's.  Each model is served as ``*-mtp`` (YAML ``mtp_enabled: true``, three drafts a round)
and ``*-plain`` (no YAML) by one server: at temperature 0 every answer is the same on both,
streaming and not, four at once, and every MTP request drafts, with drafts accepted.

Random MTP layers are never accepted (one draft in the vocabulary's 512), so a served test would
never see an accepted draft.  Here each MTP layer is a copy of the trunk's last layer that reads
the token's embedding alone (``eh_proj`` / ``fc`` = [I 0]); every other output projection of the
trunk (and the last layer's attention output) is scaled by ``QUIET``.  The trunk's answer is then
mostly its last layer's on the current token, and the context moves a part of them: drafts are
accepted about a third to a half of the time and rejected otherwise, and since every layer's cache
still decides some answers, a cache the MTP path got wrong changes the text."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from omlx_mtp.tools.cli import main

from .test_omlx_patch import OQ_KEEP_MTP, _python
from .test_omlx_serve import (SERVES, chat, concurrent_requests_equal_plain, models_mtp, mtp_lines, omlx_server,
                              patched_tree)

pytestmark = SERVES
pytest.importorskip("torch")  # tiny_nextn draws its tensors through transformers
pytest.importorskip("transformers")

PROMPTS = ["def parse_args(argv):", "class Queue:", "import os\nimport sys\n", "    return self"]
# glm-oq: quantized by oMLX's own oQ, whose nextn layer only the patched oQ keeps.
MODELS = ("glm", "glm-oq", "qwen-next")
QUIET = {"glm": 1e-4, "qwen-next": 3e-4}  # half to a third of the drafts accepted (measured)
OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")  # what a layer adds to the residual
SETTINGS = "mtp_enabled: true\nmtp_draft_tokens: 3\nmtp_min_acceptance: 0\n"  # a fixed depth, never plain
MAX_TOKENS = 64
_DRAFTS = re.compile(r"(\d+) of (\d+) drafts accepted")


def _quieted(name: str, layers: int) -> bool:
    """Whether ``name`` is an output projection ``QUIET`` scales: all but the last layer's MLP."""
    parts = name.split(".")
    if not (name.startswith("model.layers.") and name.endswith(OUTPUTS) and int(parts[2]) < layers):
        return False
    return not (int(parts[2]) == layers - 1 and ".mlp." in name)


def air_like(directory: Path) -> Path:
    """A tiny GLM-4.5-Air-shaped release (published spelling, per-expert tensors, a dense first
    layer, sharded) whose nextn layer copies the trunk's last layer."""
    import torch

    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, build_config, build_tensors, write_shards
    from omlx_mtp.fixtures.tiny import write_tokenizer

    # Experts of 64: oQ then quantizes every expert matrix (mlx's CPU gather_mm runs float32 only,
    # and oQ writes float16).
    spec = TinyNextnSpec(family="glm4_moe", moe_intermediate_size=64)
    tensors, n, h = build_tensors(spec), spec.num_layers, spec.hidden_size
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors = {k: v * QUIET["glm"] if _quieted(k, n) else v for k, v in tensors.items() if not k.startswith(mtp)}
    tensors.update({mtp + k[len(last):]: v.clone() for k, v in tensors.items() if k.startswith(last)})
    tensors.update({
        mtp + "enorm.weight": torch.full((h,), spec.embed_std),  # the embedding at the trunk's scale
        mtp + "hnorm.weight": torch.ones(h),
        mtp + "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        mtp + "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })
    directory.mkdir(parents=True)
    write_shards(directory, tensors, spec.shard_bytes)
    (directory / "config.json").write_text(json.dumps(build_config(spec), indent=2))
    write_tokenizer(directory, spec.vocab_size)
    return directory


def qwen_next_like(directory: Path) -> Path:
    """A tiny Qwen3-Next-shaped release (three Gated DeltaNet layers, then full attention; MoE with a
    shared expert) whose ``mtp.*`` head copies the trunk's last layer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from omlx_mtp.fixtures import tiny_qwen_next as tqn

    spec = tqn.TinyQwenNextSpec()
    model, head = tqn.build(spec)
    n, h = spec.num_layers, spec.hidden_size
    params = {k: v * QUIET["qwen-next"] if _quieted(k, n) else v for k, v in tree_flatten(model.parameters())}
    model.load_weights(list(params.items()))
    last = f"model.layers.{n - 1}."
    head.load_weights([("layers.0." + k[len(last):], v) for k, v in params.items() if k.startswith(last)] + [
        ("pre_fc_norm_embedding.weight", mx.full((h,), spec.embed_std)),
        ("pre_fc_norm_hidden.weight", mx.ones((h,))),
        ("fc.weight", mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)),
        ("norm.weight", params["model.norm.weight"]),
    ])
    directory.mkdir(parents=True)
    tqn.write_shards(directory, tqn.published_tensors(model, head), spec.shards)
    (directory / "config.json").write_text(json.dumps(tqn.published_config(spec), indent=2))
    tqn.write_tokenizer(directory, spec.vocab_size)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-moe")
    tree = patched_tree(root)
    glm, qwen_next = air_like(root / "src" / "glm"), qwen_next_like(root / "src" / "qwen-next")
    models, base = root / "models", root / "base"
    for name, src in (("glm", glm), ("qwen-next", qwen_next)):  # float32: mlx's CPU gather_mm
        assert main(["quantize", str(src), str(models / f"{name}-mtp"), "--bits", "8", "--dtype", "float32"]) == 0
    proc = _python(tree, "from omlx.oq import quantize_oq_streaming; "
                         f"quantize_oq_streaming({str(glm)!r}, {str(models / 'glm-oq-mtp')!r}, 8, dtype='float16'"
                         f"{OQ_KEEP_MTP})")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (base / "model_settings").mkdir(parents=True)
    for name in MODELS:
        shutil.copytree(models / f"{name}-mtp", models / f"{name}-plain")
        (base / "model_settings" / f"{name}-mtp.yaml").write_text(SETTINGS)
    with omlx_server(tree, models, base, root / "server.log") as (url, _):
        yield url, root / "server.log"


def drafts(lines: list[str]) -> list[tuple[int, int]]:
    """(accepted, drafted) of each finished MTP request's log line."""
    return [tuple(int(g) for g in _DRAFTS.search(line).groups()) for line in lines]


def test_every_model_decodes_with_its_layer(server):
    url, log_path = server
    for name in MODELS:
        for kind in ("mtp", "plain"):
            chat(url, f"{name}-{kind}", PROMPTS[0], max_tokens=4)  # oMLX loads a model at its first request
    text = log_path.read_text()
    for name in MODELS:
        assert f"MTP drafter loaded for {name}-mtp" in text
        assert f"{name}-mtp decodes with omlx-mtp" in text
        assert f"{name}-plain decodes with" not in text
    assert "BatchedEngine loaded: " in text and "MTP disabled" not in text


@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_plain_streaming_and_not(server, name):
    url, log_path = server
    before = len(mtp_lines(log_path))
    for stream in (False, True):
        for prompt in PROMPTS:
            mtp = chat(url, f"{name}-mtp", prompt, stream, max_tokens=MAX_TOKENS)[0]
            assert mtp == chat(url, f"{name}-plain", prompt, stream, max_tokens=MAX_TOKENS)[0]
            assert len(set(mtp)) >= 8  # the trunk wanders: it does not repeat one token
    counts = drafts(mtp_lines(log_path)[before:])
    assert len(counts) == 2 * len(PROMPTS)
    assert all(drafted > 0 for _, drafted in counts)  # every request drafted
    accepted, drafted = map(sum, zip(*counts))
    assert 0 < accepted < drafted  # drafts accepted and drafts rejected


@pytest.mark.parametrize("name", MODELS)
def test_four_concurrent_requests_all_run_mtp(server, name):
    concurrent_requests_equal_plain(server, f"{name}-mtp", f"{name}-plain", PROMPTS, MAX_TOKENS)


def test_counters_show_drafting(server):
    """GET /v1/models/status carries each MTP model's counters, and one more request moves them:
    its rounds drafted, drafts were accepted; the plain models have no entry."""
    url, _ = server
    for name in MODELS:
        chat(url, f"{name}-mtp", PROMPTS[0], max_tokens=4)  # loaded: the pool reports loaded models
    before = models_mtp(url)
    for name in MODELS:
        chat(url, f"{name}-mtp", PROMPTS[1], max_tokens=MAX_TOKENS)
    after = models_mtp(url)
    for name in MODELS:
        old, new = before[f"{name}-mtp"], after[f"{name}-mtp"]
        assert new["enabled"] is True and new["running"] == 0 and new["requests"] == old["requests"] + 1
        rounds = new["rounds"] - old["rounds"]
        assert 2 * rounds <= new["drafted"] - old["drafted"] <= 3 * rounds  # three a round; fewer near max_tokens
        assert new["accepted"] > old["accepted"] and 0 < new["acceptance_rate"] < 1
        assert new["tokens_per_round"] > 1
        assert new["fallbacks"] == {"cache": 0, "sampler": 0, "logits_processor": 0}
        assert after[f"{name}-plain"] is None
