"""oMLX 0.6.2's own MTP switches, served: ``mtp_enabled`` (+ ``mtp_num_draft_tokens``) in its
``model_settings.json`` turns omlx-mtp on for a family it serves, and oMLX's own MTP stands aside
for that model; ``mtp_engine: omlx`` in the YAML hands the model to oMLX's own MTP, untouched.
At temperature 0 every answer equals the plain model's; the status API says who drafts."""

from __future__ import annotations

import json
import shutil

import pytest

from omlx_mtp.fixtures.demo import demo_qwen

from .test_omlx_patch import _python, only_on
from .test_omlx_serve import SERVES, chat, equal_streaming_and_not, models_mtp, mtp_lines, omlx_server, patched_tree

pytestmark = [*SERVES, only_on("0.6.2")]

PROMPTS = ["def parse_args(argv):", "class Queue:"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-switches")
    tree = patched_tree(root)
    text = demo_qwen(root / "demo")
    models, base = root / "models", root / "base"
    # oQ keeps the head when asked (oMLX's own preserve_mtp), as oMLX's own MTP needs it too.
    proc = _python(tree, "from omlx.oq import quantize_oq_streaming; "
                         f"quantize_oq_streaming({str(text)!r}, {str(models / 'qwen-switch')!r}, 8, group_size=32, "
                         "dtype='float16', preserve_mtp=True)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("qwen-own", "qwen-plain"):
        shutil.copytree(models / "qwen-switch", models / name)
    base.mkdir(parents=True)
    # oMLX's switches: no YAML for qwen-switch; qwen-own asks for oMLX's engine in its YAML.
    (base / "model_settings.json").write_text(json.dumps({"version": 1, "models": {
        "qwen-switch": {"mtp_enabled": True, "mtp_num_draft_tokens": 2},
        "qwen-own": {"mtp_enabled": True}}}))
    (base / "model_settings").mkdir()
    (base / "model_settings" / "qwen-own.yaml").write_text("mtp_engine: omlx\n")
    (base / "settings.json").write_text(json.dumps({"auth": {"skip_api_key_verification": True}}))
    with omlx_server(tree, models, base, root / "server.log") as (url, _):
        yield url, root / "server.log"


def test_omlx_switch_drafts_with_omlx_mtp_and_equals_plain(server):
    url, log_path = server
    lines = equal_streaming_and_not(url, log_path, "qwen-switch", "qwen-plain", PROMPTS)
    text = log_path.read_text()
    # oMLX's largest depth became auto's largest depth
    assert "qwen-switch decodes with omlx-mtp (draft tokens auto up to 2" in text
    assert "qwen-switch: oMLX's own MTP stands aside" in text
    assert len(lines) == 2 * len(PROMPTS) and all("drafts accepted" in line for line in lines)
    status = models_mtp(url)
    assert status["qwen-switch"]["engine"] == "omlx-mtp" and status["qwen-switch"]["requests"] >= 2 * len(PROMPTS)
    assert status["qwen-plain"] is None


def test_mtp_engine_omlx_leaves_the_model_to_omlx_own_mtp(server):
    url, log_path = server
    before = len(mtp_lines(log_path))
    for prompt in PROMPTS:
        assert chat(url, "qwen-own", prompt)[0] == chat(url, "qwen-plain", prompt)[0]
    text = log_path.read_text()
    assert "qwen-own decodes with omlx-mtp" not in text
    assert "qwen-own: oMLX's own MTP drafts: its settings say mtp_engine: omlx" in text
    assert len(mtp_lines(log_path)) == before  # none of this package's rounds ran
    assert models_mtp(url)["qwen-own"] == {"enabled": True, "engine": "omlx",
                                           "reason": "its settings say mtp_engine: omlx"}
