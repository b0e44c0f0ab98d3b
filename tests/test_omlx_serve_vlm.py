"""oMLX 0.3.8 serving a multimodal Gemma 4 (its VLM engine, mlx-vlm underneath) with MTP, over HTTP.

The model is the demo pair's trained target with a vision tower (``tiny_vlm.demo_vlm``), merged with
its assistant by ``omlx-mtp quantize --assistant``: ``demo-vlm-mtp`` (YAML ``mtp_enabled: true``)
against the same files as ``demo-vlm-plain``.  At temperature 0 text and image requests, alone and
together, streaming and not, answer the same with MTP on and off, and every MTP request drafts with
drafts accepted.  A drafter for another width serves plain and says why.  Memory: MTP on holds no
second copy of the target (RSS of one-model servers after the same requests)."""

from __future__ import annotations

import base64
import io
import shutil
from pathlib import Path

import numpy as np
import pytest

from omlx_mtp.tools.cli import main
from omlx_mtp.fixtures.tiny import TinySpec, write_assistant
from omlx_mtp.fixtures.tiny_vlm import add_towers, demo_vlm

from .test_omlx_serve import (SERVES, chat, concurrent_requests_equal_plain, equal_streaming_and_not, httpx, mtp_lines,
                              omlx_server, patched_tree)

pytest.importorskip("mlx_vlm")
pytestmark = SERVES

TEXT = ["def parse_args(argv):", "class Queue:", "import os\nimport sys\n", "    return self"]


def image_part(seed: int) -> dict:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def with_image(text: str, seed: int) -> list:
    return [image_part(seed), {"type": "text", "text": text}]


def vlm_models(root: Path) -> tuple[Path, Path, Path]:
    """The demo target with a vision tower merged with its assistant, served twice from one base
    path: ``demo-vlm-mtp`` (YAML ``mtp_enabled: true``) and ``demo-vlm-plain``.  (tree, models, base)."""
    target, assistant = demo_vlm(root / "pair")
    models = root / "models"
    assert main(["quantize", str(target), str(models / "demo-vlm-mtp"), "--assistant", str(assistant),
                 "--bits", "8", "--dtype", "float32"]) == 0
    shutil.copytree(models / "demo-vlm-mtp", models / "demo-vlm-plain")
    base = root / "base"
    (base / "model_settings").mkdir(parents=True)
    (base / "model_settings" / "demo-vlm-mtp.yaml").write_text("mtp_enabled: true\nmtp_draft_tokens: 3\n")
    return patched_tree(root), models, base


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-vlm")
    tree, models, base = vlm_models(root)
    shutil.copytree(models / "demo-vlm-mtp", models / "demo-vlm-bad")
    other = write_assistant(root / "other-width", TinySpec(hidden_size=96))
    (base / "model_settings" / "demo-vlm-bad.yaml").write_text(f"mtp_enabled: true\nmtp_drafter: {other}\n")
    return root, tree, models, base


@pytest.fixture(scope="module")
def server(root):
    root, tree, models, base = root
    with omlx_server(tree, models, base, root / "server.log") as (url, _):
        yield url, root / "server.log"


def test_vlm_engine_serves_mtp(server):
    url, log_path = server
    for model in ("demo-vlm-mtp", "demo-vlm-plain"):  # oMLX loads a model at its first request
        chat(url, model, TEXT[0], max_tokens=4)
    text = log_path.read_text()
    assert "VLMBatchedEngine loaded: " in text
    assert "demo-vlm-mtp decodes with omlx-mtp" in text
    assert "demo-vlm-plain decodes with" not in text


def test_text_requests_equal_streaming_and_not(server):
    url, log_path = server
    lines = equal_streaming_and_not(url, log_path, "demo-vlm-mtp", "demo-vlm-plain", TEXT)
    assert len(lines) == 2 * len(TEXT)
    assert all(" 0 of " not in line and "drafts accepted" in line for line in lines)


def test_image_requests_equal_and_draft(server):
    url, log_path = server
    before = len(mtp_lines(log_path))
    answers = []
    for seed in (0, 1):
        content = with_image("What is in this picture?", seed)
        mtp, plain = chat(url, "demo-vlm-mtp", content)[0], chat(url, "demo-vlm-plain", content)[0]
        assert mtp == plain and mtp
        answers.append(mtp)
    assert answers[0] != answers[1]  # the image reaches the model
    lines = mtp_lines(log_path)[before:]
    assert len(lines) == 2 and all(" 0 of " not in line for line in lines)


def test_concurrent_text_and_image_requests(server):
    contents = [TEXT[0], with_image("Describe it.", 2), TEXT[1], with_image("Colours?", 3)]
    concurrent_requests_equal_plain(server, "demo-vlm-mtp", "demo-vlm-plain", contents)


def test_drafter_of_another_width_serves_plain_and_says_why(server):
    url, log_path = server
    assert chat(url, "demo-vlm-bad", TEXT[0])[0] == chat(url, "demo-vlm-plain", TEXT[0])[0]
    text = log_path.read_text()
    assert "MTP disabled for demo-vlm-bad" in text and "backbone_hidden_size 96 != target hidden_size" in text
    assert "demo-vlm-bad decodes with" not in text


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_mtp_holds_no_second_copy_of_the_target(root, tmp_path):
    """One-model servers, MTP on and off, after the same requests: RSS grows by at most the drafter
    and a tenth of the target's weights.  The target is big enough (float32, random weights: only
    memory is measured) that a second copy of it would show."""
    from omlx_mtp.fixtures.tiny import write_target

    _, tree, _, _ = root
    big = TinySpec(hidden_size=1024, vocab_size=65536, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                   global_head_dim=128, drafter_hidden=64)
    models = tmp_path / "models"
    add_towers(write_target(tmp_path / "text", big), models / "big", big)
    assistant = write_assistant(tmp_path / "assistant", big)
    rss = {}
    for name, yaml in (("off", None), ("on", f"mtp_enabled: true\nmtp_drafter: {assistant}\n")):
        base = tmp_path / f"base-{name}"
        (base / "model_settings").mkdir(parents=True)
        if yaml:
            (base / "model_settings" / "big.yaml").write_text(yaml)
        with omlx_server(tree, models, base, tmp_path / f"{name}.log") as (url, pid):
            for prompt in TEXT:  # only memory is measured: random weights may say nothing (0.6.2 then sends no content)
                reply = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                    "model": "big", "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0})
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0, reply.text
            rss[name] = _rss_bytes(pid)
        assert ("big decodes with omlx-mtp" in (tmp_path / f"{name}.log").read_text()) == (yaml is not None)
    weights = sum(f.stat().st_size for f in (models / "big").glob("*.safetensors"))
    drafter = sum(f.stat().st_size for f in assistant.glob("*.safetensors"))
    print(f"RSS MTP off {rss['off'] / 1e6:.0f} MB, on {rss['on'] / 1e6:.0f} MB (+{(rss['on'] - rss['off']) / 1e6:.0f} "
          f"MB); target weights {weights / 1e6:.0f} MB, drafter {drafter / 1e6:.1f} MB")
    assert rss["on"] - rss["off"] <= drafter + 0.1 * weights
