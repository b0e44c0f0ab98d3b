"""oMLX 0.3.8 serving Qwen3.5 with its built-in MTP head, quantized by oMLX's own oQ (patched: the
head kept), over HTTP.

The checkpoint is the shipped demo Qwen3.5 (a small target trained on the demo corpus, its head
distilled from it), twice: as published (with a vision tower: oMLX's VLM engine serves it) and
text-only (its LLM engine).  oQ level 8, float16.  Each is served as ``*-mtp`` (YAML
``mtp_enabled: true``) and ``*-plain`` (no YAML); at temperature 0 every answer is the same on
both, streaming and not, four at once, with images too, and every MTP request drafts with drafts
accepted."""

from __future__ import annotations

import shutil

import pytest

from omlx_mtp.fixtures.demo import demo_qwen
from omlx_mtp.fixtures.tiny_qwen import add_vision

from .test_omlx_patch import HOST, _python
from .test_omlx_serve import (SERVES, chat, concurrent_requests_equal_plain, equal_streaming_and_not, mtp_lines,
                              omlx_server, patched_tree)
from .test_omlx_serve_vlm import with_image

pytest.importorskip("mlx_vlm")
pytestmark = SERVES

PROMPTS = ["def parse_args(argv):", "class Queue:", "import os\nimport sys\n", "    return self"]
MODELS = {"qwen-vl": "VLMBatchedEngine", "qwen": "BatchedEngine"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-qwen")
    tree = patched_tree(root)
    text = demo_qwen(root / "demo")
    sources = {"qwen": text, "qwen-vl": add_vision(text, root / "demo-vl")}
    models, base = root / "models", root / "base"
    # oQ keeps the head: 0.3.8 through the patch, later releases when asked (their own preserve_mtp).
    keep = "" if HOST == "0.3.8" else ", preserve_mtp=True"
    quantize = "; ".join(f"quantize_oq_streaming({str(src)!r}, {str(models / (name + '-mtp'))!r}, 8, group_size=32, "
                         f"dtype='float16'{keep})" for name, src in sources.items())
    proc = _python(tree, f"from omlx.oq import quantize_oq_streaming; {quantize}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (base / "model_settings").mkdir(parents=True)
    for name in sources:
        shutil.copytree(models / f"{name}-mtp", models / f"{name}-plain")
        (base / "model_settings" / f"{name}-mtp.yaml").write_text("mtp_enabled: true\nmtp_draft_tokens: 3\n")
    with omlx_server(tree, models, base, root / "server.log") as (url, _):
        yield url, root / "server.log"


def test_both_engines_serve_the_built_in_head(server):
    url, log_path = server
    for name in MODELS:
        for kind in ("mtp", "plain"):
            chat(url, f"{name}-{kind}", PROMPTS[0], max_tokens=4)  # oMLX loads a model at its first request
    text = log_path.read_text()
    for name, engine in MODELS.items():
        assert f"{engine} loaded: " in text
        assert f"{name}-mtp decodes with omlx-mtp" in text
        assert f"{name}-plain decodes with" not in text
    assert "MTP disabled" not in text


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_equals_plain_streaming_and_not(server, name):
    url, log_path = server
    lines = equal_streaming_and_not(url, log_path, f"{name}-mtp", f"{name}-plain", PROMPTS)
    assert len(lines) == 2 * len(PROMPTS)
    assert all(" 0 of " not in line and "drafts accepted" in line for line in lines)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_four_concurrent_requests_all_run_mtp(server, name):
    concurrent_requests_equal_plain(server, f"{name}-mtp", f"{name}-plain", PROMPTS)


def test_image_requests_equal_and_draft(server):
    url, log_path = server
    before = len(mtp_lines(log_path))
    question = "What is in this picture?"
    text_only = chat(url, "qwen-vl-plain", question)[1]["prompt_tokens"]
    for seed in (0, 1):
        (mtp, usage), plain = chat(url, "qwen-vl-mtp", with_image(question, seed)), chat(
            url, "qwen-vl-plain", with_image(question, seed))[0]
        assert mtp == plain and mtp
        assert usage["prompt_tokens"] >= text_only + 4  # the image's soft tokens reached the model
    lines = mtp_lines(log_path)[before:]
    assert len(lines) == 2 and all(" 0 of " not in line for line in lines)


def test_concurrent_text_and_image_requests(server):
    contents = [PROMPTS[0], with_image("Describe it.", 2), PROMPTS[1], with_image("Colours?", 3)]
    concurrent_requests_equal_plain(server, "qwen-vl-mtp", "qwen-vl-plain", contents)
