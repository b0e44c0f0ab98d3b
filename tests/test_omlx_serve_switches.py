"""oMLX 0.6.2's own MTP switches, served: ``mtp_enabled`` (+ ``mtp_num_draft_tokens``) in its
``model_settings.json`` turns omlx-mtp on for a family it serves, and oMLX's own MTP stands aside
for that model; ``vlm_mtp_enabled`` + ``vlm_mtp_draft_model`` make omlx-mtp draft with that
Gemma 4 assistant (here on oMLX's LLM engine, where oMLX's own VLM MTP does not reach);
``mtp_engine: omlx`` in the YAML hands the model to oMLX's own MTP, untouched.
At temperature 0 every answer equals the plain model's; the status API says who drafts."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from omlx_mtp.fixtures.demo import demo_pair, demo_qwen

from .test_omlx_patch import OQ_KEEP_MTP, _python, only_on
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
                         f"dtype='float16'{OQ_KEEP_MTP})")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("qwen-own", "qwen-fallback", "qwen-plain"):
        shutil.copytree(models / "qwen-switch", models / name)
    gemma, assistant, _ = demo_pair(root / "demo")
    for name in ("gemma-vlm-switch", "gemma-plain"):
        shutil.copytree(gemma, models / name)
    shutil.copytree(assistant, models / "gemma-assistant")
    base.mkdir(parents=True)
    # oMLX's switches: no YAML for qwen-switch; qwen-own asks for oMLX's engine in its YAML.
    (base / "model_settings.json").write_text(json.dumps({"version": 1, "models": {
        "qwen-switch": {"mtp_enabled": True, "mtp_num_draft_tokens": 2},
        "qwen-own": {"mtp_enabled": True},
        "qwen-fallback": {"mtp_enabled": True},
        "gemma-vlm-switch": {"vlm_mtp_enabled": True, "vlm_mtp_draft_model": "gemma-assistant"}}}))
    (base / "model_settings").mkdir()
    (base / "model_settings" / "qwen-own.yaml").write_text("mtp_engine: omlx\n")
    # a drafter omlx-mtp can't load: as a family it does not serve, the model goes to oMLX's own MTP
    (base / "model_settings" / "qwen-fallback.yaml").write_text("mtp_drafter: /no/such/assistant\n")
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


# oMLX's own MTP logs each finished request: "MTP[<uid>] finish=<reason> tokens=<n> cycles=<c> ..."
_HOST_MTP = re.compile(r"MTP\[[^\]]+\] finish=\S+ tokens=\d+ cycles=(\d+)")


def host_mtp_cycles(log_path) -> list[int]:
    return [int(c) for c in _HOST_MTP.findall(log_path.read_text())]


@pytest.mark.parametrize("model, why", [
    ("qwen-own", "its settings say mtp_engine: omlx"),
    ("qwen-fallback", "omlx-mtp can't draft for it (MTP disabled for qwen-fallback: "),
])
def test_models_omlx_mtp_does_not_draft_for_run_omlx_own_mtp(server, model, why):
    """Equal to plain at T=0; oMLX's own MTP drafted (its log's counters moved), this package's
    did not; the log and the status API say why."""
    url, log_path = server
    before, host_before = len(mtp_lines(log_path)), len(host_mtp_cycles(log_path))
    for prompt in PROMPTS:
        assert chat(url, model, prompt)[0] == chat(url, "qwen-plain", prompt)[0]
    text = log_path.read_text()
    assert f"{model} decodes with omlx-mtp" not in text
    assert f"{model}: oMLX's own MTP drafts: {why}" in text
    assert len(mtp_lines(log_path)) == before  # none of this package's rounds ran
    cycles = host_mtp_cycles(log_path)[host_before:]
    assert len(cycles) == len(PROMPTS) and all(c > 0 for c in cycles)
    status = models_mtp(url)[model]
    assert status["enabled"] is True and status["engine"] == "omlx" and status["reason"].startswith(why)


def test_vlm_switch_drafts_with_the_assistant_it_names(server):
    url, log_path = server
    lines = equal_streaming_and_not(url, log_path, "gemma-vlm-switch", "gemma-plain", PROMPTS)
    assert len(lines) == 2 * len(PROMPTS) and all("drafts accepted" in line for line in lines)
    assert "gemma-vlm-switch decodes with omlx-mtp" in log_path.read_text()
    status = models_mtp(url)
    assert status["gemma-vlm-switch"]["engine"] == "omlx-mtp" and status["gemma-plain"] is None
