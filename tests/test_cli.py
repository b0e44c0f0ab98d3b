"""The command line: JSON output, MTP vs plain agreement, and one clear error for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_mtp.tools.cli import main
from omlx_mtp.tools.peer import peer_available
from omlx_mtp.fixtures.tiny import TinySpec, write_assistant

FIELDS = {"text", "tokens", "generated_tokens", "mtp", "rounds", "drafted", "accepted", "acceptance_rate",
          "tokens_per_round", "tokens_per_second", "drafting_rounds", "plain_steps", "probes", "depths"}


def run_json(capsys, *args):
    code = main(["generate", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_generate_json_mtp_equals_plain(pair_31b, capsys):
    common = ["--model", str(pair_31b.target_dir), "--prompt", "Hello there", "--max-tokens", "24"]
    mtp = run_json(capsys, *common, "--drafter", str(pair_31b.drafter_dir), "--draft-tokens", "3")
    plain = run_json(capsys, *common, "--no-mtp")
    assert FIELDS <= set(mtp) and FIELDS <= set(plain)
    assert mtp["mtp"] is True and plain["mtp"] is False
    assert mtp["tokens"] == plain["tokens"] and mtp["text"] == plain["text"]
    assert mtp["generated_tokens"] == len(mtp["tokens"]) == 24
    assert mtp["drafted"] > 0 and mtp["rounds"] > 0


def test_generate_chat_and_sampling_options(pair_e2b, capsys):
    out = run_json(capsys, "--model", str(pair_e2b.target_dir), "--drafter", str(pair_e2b.drafter_dir),
                   "--prompt", "hi", "--chat", "--temp", "0.8", "--top-p", "0.9", "--top-k", "40",
                   "--repetition-penalty", "1.1", "--seed", "3", "--max-tokens", "16")
    again = run_json(capsys, "--model", str(pair_e2b.target_dir), "--drafter", str(pair_e2b.drafter_dir),
                     "--prompt", "hi", "--chat", "--temp", "0.8", "--top-p", "0.9", "--top-k", "40",
                     "--repetition-penalty", "1.1", "--seed", "3", "--max-tokens", "16")
    assert out["tokens"] == again["tokens"]  # seeded runs reproduce
    assert out["generated_tokens"] == 16


def test_console_script_runs(pair_31b):
    beside_python = Path(sys.executable).parent / "omlx-mtp"
    exe = str(beside_python) if beside_python.exists() else shutil.which("omlx-mtp")
    if exe is None:
        pytest.skip("the omlx-mtp console script is not installed (pip install -e .)")
    proc = subprocess.run([exe, "generate", "--model", str(pair_31b.target_dir), "--drafter",
                           str(pair_31b.drafter_dir), "--prompt", "x", "--max-tokens", "4", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["generated_tokens"] == 4


def expect_error(capsys, args, *needles):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.startswith("omlx-mtp: error:")
    assert len(err.strip().splitlines()) == 1
    for needle in needles:
        assert needle in err, err
    return err


def gen_args(target, drafter):
    return ["generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "x", "--max-tokens", "2"]


def test_missing_drafter(pair_31b, tmp_path, capsys):
    expect_error(capsys, gen_args(pair_31b.target_dir, tmp_path / "nope"), "no such checkpoint directory")


def test_missing_drafter_config(pair_31b, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    expect_error(capsys, gen_args(pair_31b.target_dir, tmp_path / "d"), "config.json", "missing")


def test_corrupt_drafter_weights(pair_31b, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(pair_31b.drafter_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    before = weights.read_bytes()
    expect_error(capsys, gen_args(pair_31b.target_dir, broken), "model.safetensors", "corrupt or truncated")
    assert weights.read_bytes() == before  # input left untouched


def test_garbage_header(pair_31b, tmp_path, capsys):
    broken = tmp_path / "garbage"
    shutil.copytree(pair_31b.drafter_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    expect_error(capsys, gen_args(pair_31b.target_dir, broken), "corrupt or truncated")


def test_mismatched_drafter_names_both_numbers(pair_31b, tmp_path, capsys):
    other = write_assistant(tmp_path / "other", TinySpec(hidden_size=96, vocab_size=384))
    expect_error(capsys, gen_args(pair_31b.target_dir, other), "backbone_hidden_size 96 != target hidden_size 64",
                 "vocab_size 384 != target vocab_size 512")


def copy_with_config(source, destination, **changes):
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_drafter_of_unknown_type(pair_31b, tmp_path, capsys):
    odd = copy_with_config(pair_31b.drafter_dir, tmp_path / "odd", model_type="llama")
    expect_error(capsys, gen_args(pair_31b.target_dir, odd), "'llama' is not a known drafter")


def test_target_of_unknown_type(pair_31b, tmp_path, capsys):
    odd = copy_with_config(pair_31b.target_dir, tmp_path / "target", model_type="mystery")
    expect_error(capsys, gen_args(odd, pair_31b.drafter_dir), "'mystery' is not supported")


def test_centroid_vocab_must_divide(pair_e2b, tmp_path, capsys):
    odd = copy_with_config(pair_e2b.drafter_dir, tmp_path / "centroid", num_centroids=24)
    expect_error(capsys, gen_args(pair_e2b.target_dir, odd), "vocab_size 512 is not a multiple of num_centroids 24")


def test_bad_json_config(pair_31b, tmp_path, capsys):
    odd = tmp_path / "badjson"
    shutil.copytree(pair_31b.drafter_dir, odd)
    (odd / "config.json").write_text("{not json")
    expect_error(capsys, gen_args(pair_31b.target_dir, odd), "not valid JSON")


def test_mtp_without_drafter(pair_31b, capsys):
    expect_error(capsys, ["generate", "--model", str(pair_31b.target_dir), "--prompt", "x"], "--drafter")


def test_bad_sampling_option(pair_31b, capsys):
    expect_error(capsys, gen_args(pair_31b.target_dir, pair_31b.drafter_dir) + ["--temp", "-1"], "--temp")


def test_python_dash_m(pair_31b):
    proc = subprocess.run([sys.executable, "-m", "omlx_mtp", "generate", "--model", str(pair_31b.target_dir),
                           "--drafter", "/nonexistent", "--prompt", "x"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_bench_json(pair_31b, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(pair_31b.target_dir), "--drafter", str(pair_31b.drafter_dir),
                 "--draft-tokens", "2,auto", "--temps", "0,0.8", "--repeats", "1", "--max-tokens", "8",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    peer = peer_available() is None  # mlx-vlm's MTP joins at fixed depths when it is installed
    # temps x depths x engines (plain, no-draft, mtp, oracle)
    assert len(results) == 2 * 2 * 4 + (2 if peer else 0)
    for entry in results:
        assert {"engine", "temp", "draft_tokens", "batch", "tokens_per_second", "speedup_vs_plain",
                "speedup_vs_no_draft"} <= set(entry)
        if entry["engine"] not in ("plain", "no-draft"):
            assert {"acceptance_rate", "tokens_per_round"} <= set(entry)
        if entry["engine"] in ("mtp", "oracle") and entry["draft_tokens"] != "auto":
            assert entry["achieved_over_bound"] > 0 and entry["verify_ms"] > 0 and entry["decode_ms"] > 0
            # a round's cost in no-draft plain steps: its tokens over its gain on the no-draft loop
            assert entry["round_plain_steps"] == pytest.approx(entry["tokens_per_round"] / entry["speedup_vs_no_draft"])
        elif entry["engine"] in ("plain", "no-draft") or entry["draft_tokens"] == "auto":
            assert "round_plain_steps" not in entry  # baselines have no rounds; auto mixes depths


def test_bench_batch_sweep_and_plot(pair_31b, tmp_path):
    """--batch runs requests together through mlx-lm's BatchGenerator and MTP behind the same API
    (greedy outputs are checked equal inside the bench); --plot writes a PNG when matplotlib is there."""
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(pair_31b.target_dir), "--drafter", str(pair_31b.drafter_dir),
            "--draft-tokens", "2", "--batch", "1,3", "--repeats", "1", "--max-tokens", "8", "--accuracy", "0.7",
            "--json", str(out)]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(tmp_path / "speedup.png")]
    except ImportError:
        pass
    assert main(args) == 0
    results = json.loads(out.read_text())["results"]
    expected = [("drafts@0.7", 1), ("drafts@0.7", 3), ("mtp", 1), ("mtp", 3), ("no-draft", 1), ("no-draft", 3),
                ("oracle", 1), ("oracle", 3), ("plain", 1), ("plain", 3)]
    if peer_available() is None:
        expected = sorted(expected + [("mlx-vlm", 1)])
    assert sorted({(e["engine"], e["batch"]) for e in results}) == expected
    assert all(e["tokens_per_second"] > 0 for e in results)
    batched = [e for e in results if e["batch"] == 3 and e["engine"] not in ("plain", "no-draft")]
    assert all(e["verify_ms"] > 0 and "achieved_over_bound" in e for e in batched)  # costs at batch 3
    if "--plot" in args:
        assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["bench", "--batch", "0"]) == 2
    assert main(["bench", "--accuracy", "1.5"]) == 2
    assert main(["bench", "--target-bits", "4"]) == 2  # only for --synthetic


# -- the nextn families (GLM-4.x, DeepSeek-V3.x) and Qwen3-Next through the command line --------------
NEW_FAMILIES = {
    # GLM-4.6's bf16 layout: the MTP layer uses the trunk's embedding and head
    "glm4_moe-shared": ("nextn", {"family": "glm4_moe", "own_embed_head": False}),
    # DeepSeek-V3.2: its own embedding and head, the indexer's second cache per layer
    "deepseek_v32": ("nextn", {"family": "deepseek_v32"}),
    "qwen3_next": ("qwen3_next", {}),
}


@pytest.fixture(scope="module", params=list(NEW_FAMILIES))
def new_family(request, tmp_path_factory):
    kind, spec = NEW_FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    if kind == "qwen3_next":
        from omlx_mtp.fixtures.tiny_qwen_next import write_qwen_next

        return request.param, write_qwen_next(directory)
    pytest.importorskip("transformers")  # tiny_nextn builds its tensors with transformers' classes
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    return request.param, write_nextn(directory, TinyNextnSpec(**spec))


def test_generate_json_on_the_new_families(new_family, capsys):
    """The checkpoint's own MTP layer or head drafts (no --drafter): greedy output equals plain
    decoding's, at a fixed depth and with auto; a seeded sampled run reproduces."""
    _, directory = new_family
    common = ["--model", str(directory), "--prompt", "Hello there", "--max-tokens", "12"]
    plain = run_json(capsys, *common, "--no-mtp")
    mtp = run_json(capsys, *common, "--draft-tokens", "3")
    auto = run_json(capsys, *common, "--draft-tokens", "auto")
    assert FIELDS <= set(mtp) and mtp["mtp"] is True and plain["mtp"] is False
    assert mtp["tokens"] == plain["tokens"] == auto["tokens"] and mtp["generated_tokens"] == 12
    assert mtp["drafted"] > 0 and mtp["rounds"] > 0
    sampled = [run_json(capsys, *common, "--temp", "0.8", "--top-p", "0.9", "--seed", "5") for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"] and sampled[0]["drafted"] > 0


def test_inspect_reports_the_mtp_layer(new_family, capsys):
    name, directory = new_family
    assert main(["inspect", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    drafter = report["drafter"]
    assert report["problems"] == [] and drafter["built_in"] is True and report["mtp"]["count"] > 0
    if name == "qwen3_next":
        assert drafter["model_type"] == "qwen3_5_mtp" and drafter["layers"] == 1
    else:
        layers = json.loads((directory / "config.json").read_text())["num_hidden_layers"]
        own = name != "glm4_moe-shared"
        assert drafter["model_type"] == "nextn" and drafter["index"] == drafter["expected_index"] == layers
        assert drafter["own_embedding"] is own and drafter["own_head"] is own
    assert main(["inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "drafter: built-in MTP" in text and "problem:" not in text
    if name != "qwen3_next":
        assert f"at model.layers.{layers}, {'its own' if own else 'the trunk' + chr(39) + 's'} embedding" in text


@pytest.mark.parametrize("counted", [True, False])
def test_qwen3_next_without_its_head(tmp_path, capsys, counted):
    """A Qwen3-Next quant that lost its head: inspect names the config entry that promises it (or the
    family, which always has one) and add-mtp; generate refuses in one line, naming add-mtp."""
    from omlx_mtp.fixtures.tiny_qwen_next import write_qwen_next

    directory = write_qwen_next(tmp_path / "nohead", with_head=False)
    if not counted:
        config = json.loads((directory / "config.json").read_text())
        del config["num_nextn_predict_layers"]
        (directory / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(directory)]) == 1
    problem = capsys.readouterr().out.splitlines()[-1]
    promise = "(num_nextn_predict_layers)" if counted else "a Qwen3-Next checkpoint carries"
    assert problem.startswith("problem:") and promise in problem and "omlx-mtp add-mtp" in problem
    assert "mtp_num_hidden_layers" not in problem
    expect_error(capsys, ["generate", "--model", str(directory), "--prompt", "x", "--max-tokens", "2"],
                 "no mtp.*", "omlx-mtp add-mtp ORIGINAL DIR")


@pytest.mark.parametrize("name, note", [
    ("glm4.5-air-shaped", "2 of 46 layers, 32 of 128 routed experts, MTP layer random"),
    ("qwen3-next-shaped", "2 of 48 layers, 64 of 512 routed experts, MTP head random"),
])
def test_bench_new_synthetic_shapes(name, note, monkeypatch, tmp_path, capsys):
    """The shapes at small widths (the real ones take gigabytes): every engine runs, the regime line
    says what was scaled down, and GLM's routers are random (mlx-lm starts them at zero, which sends
    every token to the same experts)."""
    from omlx_mtp.fixtures import synthetic

    shape = synthetic.SHAPES[name]
    small = dict(shape["target"], hidden_size=128, vocab_size=600, intermediate_size=256, moe_intermediate_size=32)
    monkeypatch.setitem(synthetic.SHAPES, name, {**shape, "target": small})
    out = tmp_path / "bench.json"
    assert main(["bench", "--synthetic", name, "--dtype", "float32", "--draft-tokens", "2", "--repeats", "1",
                 "--max-tokens", "6", "--prompt-tokens", "8", "--json", str(out)]) == 0
    regime = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("regime:"))
    assert regime.endswith(note)
    results = json.loads(out.read_text())["results"]
    assert sorted(e["engine"] for e in results) == ["mtp", "no-draft", "oracle", "plain"]
    assert all(e["tokens_per_second"] > 0 for e in results)
    assert next(e for e in results if e["engine"] == "mtp")["draft_ms"] > 0
    target, drafter = synthetic.synthetic_pair(name, 2, "float32")
    if name.startswith("glm"):
        from mlx_lm.models import glm4_moe

        gates = [m for tree in (target.model, drafter) for _, m in tree.named_modules()
                 if isinstance(m, glm4_moe.MoEGate)]
        assert len(gates) == 2 and all(float(mx.abs(g.weight).max()) > 0 for g in gates)
    assert main(["bench", "--synthetic", name, "--head-bits", "8"]) == 2
