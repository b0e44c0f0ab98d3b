"""Plain input mistakes end in one ``omlx-mtp: error:`` line and exit 2, never a traceback: numeric
options out of range (checked before any model loads), a Gemma 4 assistant paired with another
family's target, a settings file that is not UTF-8; and the shipped bf16 GLM demo, which mlx's CPU
gather_mm (float32 only) used to kill, generates."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_mtp import fixtures
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.hosts import settings
from omlx_mtp.tools.cli import main

FIXTURES = Path(fixtures.__file__).resolve().parent
PAIR, QWEN, GLM = FIXTURES / "demo_pair", FIXTURES / "demo_qwen", FIXTURES / "demo_glm"
GEN = ["generate", "--model", str(PAIR / "target"), "--drafter", str(PAIR / "assistant"), "--prompt", "hi",
       "--max-tokens", "2"]
LATIN1 = "mtp_enabled: true\nmtp_drafter: café\n".encode("latin-1")  # 0xe9 is no UTF-8 sequence


def gather_mm_takes_bf16() -> bool:
    """Whether this device runs gather_mm in bfloat16: mlx's CPU backend does not (0.31 and 0.32).
    Not probed by running one: on mlx 0.31 the error leaves the heap corrupted and the process aborts."""
    return mx.default_device() != mx.cpu


def expect_error(capsys, argv, *needles) -> str:
    """main(argv) returns 2 with one error line naming each needle (a traceback would raise here)."""
    code = main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("omlx-mtp: error:"), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# (arguments, what the error line must say).  Each of these used to raise out of main (a TypeError
# from mx.random.key, mlx-lm's ValueError, a ZeroDivisionError or an empty median), ran on with a
# meaningless value (--temp nan, --prompt-tokens 0), or complained of something else first.
NUMERIC = [
    (GEN + ["--seed", "-1"], ["--seed", "between 0 and 18446744073709551615", "-1"]),
    (GEN + ["--seed", str(2**64)], ["--seed", str(2**64)]),
    (GEN + ["--temp", "nan"], ["--temp", "finite", "nan"]),
    (GEN + ["--temp", "inf"], ["--temp", "finite", "inf"]),
    (GEN + ["--top-p", "nan"], ["--top-p", "between 0 and 1", "nan"]),
    (GEN + ["--min-p", "-0.5"], ["--min-p", "between 0 and 1"]),
    (GEN + ["--top-k", "-3"], ["--top-k", "at least 0"]),
    (GEN + ["--repetition-penalty", "-1"], ["--repetition-penalty", "greater than 0", "-1"]),
    (GEN + ["--repetition-penalty", "0"], ["--repetition-penalty", "greater than 0"]),
    (GEN + ["--repetition-penalty", "nan"], ["--repetition-penalty", "nan"]),
    (GEN + ["--max-tokens", "0"], ["--max-tokens", "at least 1"]),
    (GEN + ["--max-draft-tokens", "0"], ["--max-draft-tokens", "between 1 and 16"]),
    (["demo", "--max-tokens", "0"], ["--max-tokens", "at least 1", "got 0"]),
    (["demo", "--draft-tokens", "-1"], ["--draft-tokens", "between 0 and 16", "-1"]),
    (["bench", "--repeats", "0"], ["--repeats", "at least 1"]),
    (["bench", "--max-tokens", "0"], ["--max-tokens", "at least 1"]),
    (["bench", "--prompt-tokens", "0"], ["--prompt-tokens", "at least 1"]),
    (["bench", "--synthetic", "qwen3.5-27b-shaped", "--synthetic-layers", "0"], ["--synthetic-layers", "between 1"]),
    (["bench", "--synthetic-layers", "100000"], ["--synthetic-layers", "100000"]),
    (["bench", "--draft-tokens", "1,-2"], ["--draft-tokens", "between 0 and 16", "-2"]),
    (["bench", "--temps", "0,nan"], ["--temps", "nan"]),
    (["timeline", "--max-tokens", "0"], ["--max-tokens", "at least 1"]),
    (["timeline", "--repeats", "-5"], ["--repeats", "at least 1", "-5"]),
    (["timeline", "--draft-tokens", "-1"], ["--draft-tokens", "between 0 and 16"]),
    (["quantize", str(PAIR / "target"), "OUT", "--shard-size-mb", "0"], ["--shard-size-mb", "at least 1"]),
    (["serve", "--model", "/nonexistent", "--port", "70000"], ["--port", "between 0 and 65535"]),
]


@pytest.mark.parametrize("argv,needles", NUMERIC, ids=[" ".join(a[-2:]) if a[0] == "generate" else
                                                       " ".join(w for w in a if "/" not in w) for a, _ in NUMERIC])
def test_numeric_option_out_of_range(capsys, tmp_path, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)  # quantize's OUT, were it ever written, lands here
    expect_error(capsys, argv, *needles)


def test_top_k_beyond_the_vocabulary(capsys):
    # known only once the model is loaded (demo pair: 1024 tokens); mlx-lm raised a ValueError
    expect_error(capsys, GEN + ["--temp", "1", "--top-k", "5000"], "--top-k", "between 0 and 1023", "5000")


@pytest.mark.parametrize("target,kind", [(QWEN, "qwen3_5"), (GLM, "glm4_moe")])
def test_gemma_assistant_for_another_family(capsys, target, kind):
    # check_fits read the Gemma 4 target's kv_owner: an AttributeError on these targets
    line = expect_error(capsys, ["generate", "--model", str(target), "--drafter", str(PAIR / "assistant"),
                                 "--prompt", "hi", "--max-tokens", "2"], "gemma4_assistant", "Gemma 4", kind)
    assert str(PAIR / "assistant") in line


def test_settings_file_not_utf8(capsys, tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(LATIN1)
    expect_error(capsys, ["settings", "validate", str(path)], str(path), "not UTF-8")


def test_settings_loaders_not_utf8(capsys, tmp_path, monkeypatch):
    # the files a model id resolves to (show, and the hosts' loaders) are read by the same code
    (tmp_path / "model_settings").mkdir()
    path = tmp_path / "model_settings" / "org--model.yaml"
    path.write_bytes(LATIN1)
    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path))
    with pytest.raises(settings.SettingsError, match="not UTF-8"):
        settings.resolve("org/model")
    expect_error(capsys, ["settings", "show", "org/model"], str(path), "not UTF-8")


def test_bf16_glm_generates_on_cpu(capsys, caplog):
    # its routed experts run through gather_mm, which mlx's CPU backend takes in float32 only
    caplog.set_level(logging.WARNING, logger="omlx_mtp")
    code = main(["generate", "--model", str(GLM), "--prompt", "def f(x):", "--max-tokens", "4", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["generated_tokens"] == 4
    if not gather_mm_takes_bf16():
        notes = [r.getMessage() for r in caplog.records if "gather_mm" in r.getMessage()]
        assert len(notes) == 1 and str(GLM) in notes[0] and "float32" in notes[0], notes


def test_upcast_only_where_needed(tmp_path, capsys):
    """A dense bf16 model and a quantized MoE (gather_qmm takes bf16) keep their dtype; only
    unquantized experts the backend refuses are upcast."""
    dense = tmp_path / "dense_bf16"
    shutil.copytree(PAIR / "target", dense)
    weights = mx.load(str(dense / "model.safetensors"))
    mx.save_safetensors(str(dense / "model.safetensors"),
                        {k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
                         for k, v in weights.items()}, metadata={"format": "mlx"})
    assert main(["quantize", str(GLM), str(tmp_path / "glm_q4"), "--bits", "4", "--group-size", "32"]) == 0
    capsys.readouterr()
    for directory, expected in ((dense, mx.bfloat16), (tmp_path / "glm_q4", mx.bfloat16),
                                (GLM, mx.bfloat16 if gather_mm_takes_bf16() else mx.float32)):
        model, _, _ = load_target(directory, with_tokenizer=False)
        assert model.model.norm.weight.dtype == expected, directory
