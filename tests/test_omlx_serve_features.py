"""oMLX 0.3.8 serving MTP with its own per-model accelerators on: SpecPrefill and TurboQuant KV.

Both models (``demo-mtp`` with YAML ``mtp_enabled``, ``demo-plain`` without) get the same oMLX
settings in ``model_settings.json``: SpecPrefill with the demo target as its scorer (threshold 512,
so a few-thousand-token prompt is prefilled sparsely) and TurboQuant KV at 4 bits.  The server runs
with ``--no-cache``: with the prefix cache on, a repeat is served from blocks the sparse request
stored, and the two models would no longer see the same prefill.

oMLX 0.3.8's scorer *samples* its lookahead tokens (``score_tokens``' temperature 0.6), so identical
requests keep different chunks and answer differently even with MTP off; the copy of the tree used
here makes the lookahead greedy, which pins the kept chunks — the comparison is then MTP on vs off after the same
sparse prefill."""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
import time

import pytest

from omlx_mtp.fixtures.demo import demo_pair

from .test_omlx_serve import SERVES, chat, mtp_lines, omlx_server, patched_tree

pytestmark = SERVES

SCORER_TEMPERATURE = "    temp: float = 0.6,\n"  # score_tokens' default, used by the scheduler
# About 4,000 tokens of Python standard-library source (what the demo pair was trained on): far above
# the threshold, many sliding windows long.
SPARSE_PROMPT = "Continue this module:\n" + inspect.getsource(argparse)[:14000]
SHORT = ["def parse_args(argv):", "class Queue:"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The float32 demo target twice (``demo-mtp`` drafting with the demo assistant, ``demo-plain``),
    so MTP on and off must agree token for token."""
    root = tmp_path_factory.mktemp("features")
    tree = patched_tree(root)
    specprefill = tree / "omlx" / "patches" / "specprefill.py"
    source = specprefill.read_text()
    assert source.count(SCORER_TEMPERATURE) == 1
    specprefill.write_text(source.replace(SCORER_TEMPERATURE, SCORER_TEMPERATURE.replace("0.6", "0.0")))
    target, assistant, _ = demo_pair(root / "pair")
    base, models = root / "base", root / "base" / "models"
    for name in ("demo-mtp", "demo-plain"):
        shutil.copytree(target, models / name)
    (base / "model_settings").mkdir()
    (base / "model_settings" / "demo-mtp.yaml").write_text(
        f"mtp_enabled: true\nmtp_drafter: {assistant}\nmtp_draft_tokens: 3\n")
    features = {"specprefill_enabled": True, "specprefill_draft_model": str(models / "demo-plain"),
                "specprefill_threshold": 512, "turboquant_kv_enabled": True, "turboquant_kv_bits": 4}
    (base / "model_settings.json").write_text(json.dumps(
        {"version": 1, "models": {"demo-mtp": features, "demo-plain": features}}))
    log_path = root / "server.log"
    with omlx_server(tree, models, base, log_path, extra_args=["--no-cache"]) as (url, _):
        yield url, log_path


def test_specprefill_then_mtp_equals_specprefill_alone(server):
    url, log_path = server
    plain, _ = chat(url, "demo-plain", SPARSE_PROMPT, stream=True, max_tokens=96)
    mtp, _ = chat(url, "demo-mtp", SPARSE_PROMPT, stream=True, max_tokens=96)
    assert mtp == plain and len(set(plain.split())) > 10
    for _ in range(50):  # the server's log reaches the file a little after the answer on a loaded machine
        text = log_path.read_text()
        sparse = re.findall(r"SpecPrefill: sparse prefill (\d+)/(\d+) conv tokens", text)
        if len(sparse) >= 2:
            break
        time.sleep(0.2)
    assert len(sparse) == 2 and sparse[0] == sparse[1]  # both requests kept the same chunks
    kept, total = map(int, sparse[0])
    assert total > 3000 and kept < total / 2
    assert "prefilled sparsely (SpecPrefill): RoPE positions shifted by" in text
    assert "drafts accepted" in mtp_lines(log_path)[-1] and " 0 of " not in mtp_lines(log_path)[-1]


def test_turboquant_on_mtp_equals_off(server):
    url, log_path = server
    for prompt in SHORT:
        for stream in (False, True):
            assert chat(url, "demo-mtp", prompt, stream)[0] == chat(url, "demo-plain", prompt, stream)[0]
    text = log_path.read_text()
    assert "TurboQuant KV cache enabled: 4.0 bits" in text
    assert "demo-mtp has TurboQuant KV (4 bits) on" in text
