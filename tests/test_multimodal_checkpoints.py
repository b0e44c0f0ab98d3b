"""Multimodal Gemma 4 checkpoints (vision, and audio for the E2B style): quantized keeping every
tower tensor the way mlx-vlm's conversion does, the assistant merged where mlx-vlm does not trip
over it, loadable by mlx-vlm; the plugin wraps the VLM model oMLX's engine holds, and says why
when it cannot."""

from __future__ import annotations

import json
import logging
import os
import types

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from omlx_mtp.checkpoint.files import tensor_infos  # noqa: E402
from omlx_mtp.tools.cli import main  # noqa: E402
from omlx_mtp.hosts.omlx.call_sites import attach_decode_strategy, engine_built  # noqa: E402
from omlx_mtp.fixtures.tiny import TinySpec, write_assistant  # noqa: E402
from omlx_mtp.fixtures.tiny_vlm import write_tiny_vlm  # noqa: E402

from .test_quantize import digest, run  # noqa: E402

TOWERS = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
SPECS = {"31b": (TinySpec(layout="31b", model_type="gemma4", k_eq_v=True), False),
         "e2b-audio": (TinySpec(layout="e2b", model_type="gemma4", num_layers=6, centroid_head=True), True)}


@pytest.fixture(scope="module", params=sorted(SPECS))
def source(request, tmp_path_factory):
    spec, audio = SPECS[request.param]
    root = tmp_path_factory.mktemp(f"mm{request.param}")
    return write_tiny_vlm(root / "target", spec, audio=audio), write_assistant(root / "assistant", spec), audio


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    target, assistant, _ = source
    out = tmp_path_factory.mktemp("mmq") / "q4"
    before = digest(target)
    assert main(["quantize", str(target), str(out), "--bits", "4", "--group-size", "32", "--dtype", "float32",
                 "--assistant", str(assistant)]) == 0
    assert digest(target) == before  # SRC untouched
    return out


def _tower(name: str) -> bool:
    return name.removeprefix("model.").startswith(TOWERS)


def test_every_tower_tensor_kept_as_mlx_vlm_converts_it(source, quantized):
    from mlx_vlm.utils import skip_multimodal_module

    target, _, audio = source
    src = {n.removeprefix("model.") for n in mx.load(str(target / "model.safetensors")) if _tower(n)}
    out = tensor_infos(quantized)
    kept = {n for n in out if _tower(n)}
    # mlx-vlm's sanitizers may transpose convolutions, never drop a tensor; a quantized one gains scales/biases
    assert {n for n in kept if not n.endswith((".scales", ".biases"))} == src
    quantized_modules = {n.removesuffix(".scales") for n in kept if n.endswith(".scales")}
    assert not [m for m in quantized_modules if skip_multimodal_module(m)]  # what mlx-vlm keeps in float
    assert not [m for m in quantized_modules if m.startswith(("vision_tower.", "audio_tower."))]
    assert all(out[n][1] == "F32" for n in kept if n.removesuffix(".weight") not in quantized_modules)
    assert any(n.startswith("audio_tower.") for n in kept) == audio
    assert any(n.endswith(".scales") and n.startswith("language_model.") for n in out)  # the text model is quantized
    config = json.loads((quantized / "config.json").read_text())
    assert config["vision_config"] and bool(config.get("audio_config")) == audio


def test_assistant_merged_out_of_mlx_vlms_sight(source, quantized):
    index = json.loads((quantized / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [n for n in index if ".mtp." in n or n.startswith("mtp.")]
    merged = mx.load(str(quantized / "mtp" / "mtp.safetensors"))
    assistant = mx.load(str(source[1] / "model.safetensors"))
    assert set(merged) == {"language_model.mtp." + n for n in assistant}
    assert json.loads((quantized / "config.json").read_text())["text_config"]["mtp_assistant_config"]


def test_inspect_reports_towers(source, quantized, capsys):
    code, out, _ = run(capsys, "inspect", quantized, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    vision = report["towers"]["vision"]
    assert vision["count"] > 0 and vision["precision"]["float32"] > 0
    assert set(vision["precision"]) <= {"float32", "4-bit affine"}  # mlx-vlm 0.5 quantizes the projector
    assert (report["towers"]["audio"]["count"] > 0) == source[2]
    assert report["drafter"]["merged"] and report["drafter"]["fits_target"]
    code, text, _ = run(capsys, "inspect", quantized)
    assert "vision tower:" in text


def test_inspect_flags_a_tower_the_config_promises_but_lacks(source, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(source[0], broken)
    weights = {n: v for n, v in mx.load(str(broken / "model.safetensors")).items() if not _tower(n)}
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    _, out, _ = run(capsys, "inspect", broken, "--json")
    assert any("vision tower" in p for p in json.loads(out)["problems"])


def test_mlx_vlm_loads_it_and_answers_an_image_prompt(quantized):
    from mlx_vlm.utils import load
    from PIL import Image

    from omlx_mtp.tools.multimodal import embedded_request
    from omlx_mtp.tools.session import run_plain
    from omlx_mtp.targets import wrap_target

    model, processor = load(str(quantized))
    target = wrap_target(model)
    answers = []
    for seed in (0, 1):
        pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        request = embedded_request(model, processor, "What is this?", [Image.fromarray(pixels)], max_tokens=12)
        answers.append(run_plain(target.plain_model(), request).row.generated)
    assert all(len(a) == 12 for a in answers) and answers[0] != answers[1]


def test_generate_image_json_equals_no_mtp(source, quantized, tmp_path, capsys):
    from PIL import Image

    image = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (80, 64, 3), dtype=np.uint8)).save(image)
    results = []
    for extra in ([], ["--no-mtp"]):
        code, out, err = run(capsys, "generate", "--model", quantized, "--prompt", "Describe it", "--image", image,
                             "--max-tokens", "24", "--json", *extra)
        assert code == 0, err
        results.append(json.loads(out))
    mtp, plain = results
    assert mtp["tokens"] == plain["tokens"] and mtp["mtp"] and mtp["drafted"] > 0
    assert {"text", "generated_tokens", "prompt_tokens", "acceptance_rate", "tokens_per_round"} <= set(mtp)


def test_generate_image_refused_for_a_text_checkpoint(tmp_path, capsys):
    from omlx_mtp.fixtures.tiny import write_pair

    target, _ = write_pair(tmp_path / "text", TinySpec())
    code, _, err = run(capsys, "generate", "--model", target, "--prompt", "x", "--image", tmp_path / "none.png",
                       "--no-mtp")
    assert code == 2 and "not a multimodal checkpoint" in err


class _Adapter:
    """The one thing of oMLX's VLMModelAdapter the plugin relies on: the mlx-vlm model it wraps."""

    def __init__(self, model):
        self._vlm_model = model


def _settings(base, model_id, text):
    (base / "model_settings").mkdir(parents=True, exist_ok=True)
    (base / "model_settings" / f"{model_id}.yaml").write_text(text)


def test_plugin_attaches_to_the_vlm_engine_model(quantized, tmp_path, monkeypatch):
    from mlx_vlm.utils import load

    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path))
    _settings(tmp_path, "mm-mtp", "mtp_enabled: true\n")
    model, _ = load(str(quantized))
    scheduler = types.SimpleNamespace()
    strategy = attach_decode_strategy(scheduler, _Adapter(model), str(quantized), "mm-mtp")
    assert strategy is not None and scheduler.decode_strategy is strategy
    assert strategy.decoder.target.family == "Gemma 4 (mlx-vlm)"


def test_mismatched_assistant_serves_plain_and_says_why(source, tmp_path, monkeypatch, caplog):
    from mlx_vlm.utils import load

    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path))
    other = write_assistant(tmp_path / "other", TinySpec(hidden_size=96))
    _settings(tmp_path, "mm-bad", f"mtp_enabled: true\nmtp_drafter: {other}\n")
    model, _ = load(str(source[0]))
    scheduler = types.SimpleNamespace()
    with caplog.at_level(logging.INFO):
        assert attach_decode_strategy(scheduler, _Adapter(model), str(source[0]), "mm-bad") is None
    assert "MTP disabled for mm-bad" in caplog.text and "backbone_hidden_size 96 != target hidden_size 64" in caplog.text


def test_unknown_family_and_uncovered_engine_are_logged(tmp_path, monkeypatch, caplog):
    import mlx.nn as nn

    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path))
    _settings(tmp_path, "other-model", "mtp_enabled: true\nmtp_drafter: /nowhere\n")
    with caplog.at_level(logging.INFO):
        assert attach_decode_strategy(types.SimpleNamespace(), nn.Linear(2, 2), str(tmp_path), "other-model") is None
        EmbeddingEngine = type("EmbeddingEngine", (), {})
        engine_built(EmbeddingEngine(), "other-model", str(tmp_path))
        engine_built(type("BatchedEngine", (), {})(), "other-model", str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if "other-model" in r.getMessage()]
    assert any("is not a model family omlx-mtp drafts for" in line for line in lines)
    assert sum("EmbeddingEngine, which has no MTP support" in line for line in lines) == 1
    assert not any("BatchedEngine, which" in line for line in lines)


def test_bench_runs_on_a_merged_multimodal_checkpoint(quantized, tmp_path):
    """bench --model alone: the merged assistant, the mlx-vlm target path; greedy output is checked equal
    to plain decoding inside the bench."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(quantized), "--draft-tokens", "2", "--repeats", "1", "--max-tokens", "8",
                 "--prompt-tokens", "16", "--json", str(out)]) == 0
    engines = {entry["engine"] for entry in json.loads(out.read_text())["results"]}
    assert {"plain", "no-draft", "mtp", "oracle"} <= engines
