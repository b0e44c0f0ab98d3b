"""The package under damaged inputs: the shipped demo checkpoints copied and broken the ways
downloads and hand edits break them.  Every command answers with one ``omlx-mtp: error:`` line
(inspect: a report naming the problem, exit 1), leaves its inputs byte-identical and writes nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from omlx_mtp.fixtures.demo import PAIR_DIR, QWEN_DIR
from omlx_mtp.tools.cli import main

GLM_DIR = QWEN_DIR.parent / "demo_glm"
WEIGHTS = "model.safetensors"


def digests(*directories) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in directories for p in sorted(Path(d).rglob("*")) if p.is_file()}


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])  # a traceback would raise out of main and fail the test
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # not tqdm's progress
    assert len(lines) == 1 and lines[0].startswith("omlx-mtp: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- damage, each applied to a fresh copy ------------------------------------------------------

def _tensors(directory: Path) -> dict:
    return dict(mx.load(str(directory / WEIGHTS)))


def _save(directory: Path, tensors: dict) -> None:
    mx.save_safetensors(str(directory / WEIGHTS), tensors, metadata={"format": "mlx"})


def _header(directory: Path) -> tuple[dict, bytes]:
    data = (directory / WEIGHTS).read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def _write_header(directory: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    (directory / WEIGHTS).write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def truncated(d):
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[:-100])


def header_past_the_end(d):
    data = bytearray((d / WEIGHTS).read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    (d / WEIGHTS).write_bytes(bytes(data))


def lying_header(d):
    header, body = _header(d)
    name = next(n for n in header if n != "__metadata__" and len(header[n]["shape"]) == 2)
    header[name]["shape"] = [header[name]["shape"][0] * 2, header[name]["shape"][1]]
    _write_header(d, header, body)


def _trunk_matrix(tensors: dict) -> str:
    return next(n for n, v in tensors.items() if v.ndim == 2 and ".layers.0." in n and "mtp" not in n)


def wrong_trunk_shape(d):
    tensors = _tensors(d)
    name = _trunk_matrix(tensors)
    tensors[name] = tensors[name][:, :-8]
    _save(d, tensors)


def missing_trunk_tensor(d):
    tensors = _tensors(d)
    del tensors[_trunk_matrix(tensors)]
    _save(d, tensors)


def _mtp_matrix(d: Path, tensors: dict) -> str:
    """A matrix of the MTP head (``mtp.*``) or of the nextn layer (``model.layers.{num_hidden_layers}``)."""
    config = json.loads((d / "config.json").read_text())
    layer = f"model.layers.{(config.get('text_config') or config)['num_hidden_layers']}."
    return next(n for n, v in sorted(tensors.items()) if v.ndim == 2 and n.startswith(("mtp.", layer)))


def wrong_mtp_shape(d):
    tensors = _tensors(d)
    name = _mtp_matrix(d, tensors)
    tensors[name] = tensors[name][:-4]
    _save(d, tensors)


def missing_mtp_tensor(d):
    tensors = _tensors(d)
    del tensors[_mtp_matrix(d, tensors)]
    _save(d, tensors)


def _edit_config(d, change):
    config = json.loads((d / "config.json").read_text())
    change(config)
    (d / "config.json").write_text(json.dumps(config))


def config_not_json(d):
    (d / "config.json").write_text('{"model_type": "qwen3_5",')


def config_not_utf8(d):
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')


def config_a_list(d):
    (d / "config.json").write_text("[1, 2]")


def unknown_model_type(d):
    _edit_config(d, lambda c: c.update(model_type="frobnicator"))


def missing_width(d):
    _edit_config(d, lambda c: (c.get("text_config") or c).pop("hidden_size"))


def _index(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def index_not_json(d):
    (d / "model.safetensors.index.json").write_text("{not json")


def index_values_not_strings(d):
    _index(d, {name: [WEIGHTS] for name in _tensors(d)})


def index_names_a_missing_shard(d):
    _index(d, {name: "model-00009-of-00009.safetensors" for name in _tensors(d)})


def index_lies_about_a_tensor(d):
    _index(d, {**{name: WEIGHTS for name in _tensors(d)}, "model.layers.0.made_up.weight": WEIGHTS})


def index_escapes_the_directory(d):
    _index(d, {name: "../" + WEIGHTS for name in _tensors(d)})


DAMAGE = [truncated, header_past_the_end, lying_header, wrong_trunk_shape, missing_trunk_tensor, wrong_mtp_shape,
          missing_mtp_tensor, config_not_json, config_not_utf8, config_a_list, unknown_model_type, missing_width,
          index_not_json, index_values_not_strings, index_names_a_missing_shard, index_lies_about_a_tensor,
          index_escapes_the_directory]


@pytest.fixture(params=DAMAGE, ids=lambda f: f.__name__)
def damaged_qwen(request, tmp_path):
    directory = tmp_path / "qwen"
    shutil.copytree(QWEN_DIR, directory)
    request.param(directory)
    return directory


def test_every_command_refuses_a_damaged_checkpoint(damaged_qwen, tmp_path, capsys):
    before = digests(damaged_qwen)
    out = tmp_path / "out"
    code, _, err = run(capsys, "quantize", damaged_qwen, out)
    assert code == 2, err
    one_error_line(err)
    assert not out.exists() and not list(tmp_path.glob(".out.*")), "quantize left output behind"
    code, _, err = run(capsys, "generate", "--model", damaged_qwen, "--prompt", "def f(", "--max-tokens", "2")
    assert code == 2, err
    one_error_line(err)
    code, report, err = run(capsys, "inspect", damaged_qwen)
    assert code == 1 and "Traceback" not in err
    assert any(line.startswith("problem: ") for line in report.splitlines()), report
    assert digests(damaged_qwen) == before


@pytest.mark.parametrize("damage", [wrong_mtp_shape, missing_mtp_tensor, wrong_trunk_shape], ids=lambda f: f.__name__)
def test_a_damaged_nextn_layer_or_trunk_is_refused(damage, tmp_path, capsys):
    """The GLM demo keeps its MTP layer as model.layers.{num_hidden_layers}: the same pass reads it."""
    src = tmp_path / "glm"
    shutil.copytree(GLM_DIR, src)
    damage(src)
    before = digests(src)
    code, _, err = run(capsys, "quantize", src, tmp_path / "out")
    assert code == 2, err
    one_error_line(err)
    code, report, _ = run(capsys, "inspect", src)
    assert code == 1 and "problem: " in report
    assert digests(src) == before and not (tmp_path / "out").exists()


def test_intact_demos_pass_the_same_pass(capsys):
    """The pass refuses the damage, not the checkpoints: every shipped demo inspects clean."""
    for directory in (QWEN_DIR, GLM_DIR, PAIR_DIR / "target", PAIR_DIR / "assistant"):
        code, report, _ = run(capsys, "inspect", directory)
        assert code == 0 and "problem:" not in report, report


# -- mismatched pairs ----------------------------------------------------------------------------

def _assistant_with(tmp_path, change=None, drop=None) -> Path:
    directory = tmp_path / "assistant"
    shutil.copytree(PAIR_DIR / "assistant", directory)
    if change is not None:
        _edit_config(directory, change)
    if drop is not None:
        tensors = _tensors(directory)
        del tensors[next(n for n in sorted(tensors) if drop in n)]
        _save(directory, tensors)
    return directory


def _text(change):
    return lambda config: change(config["text_config"])


MISMATCHES = {
    "sliding window": dict(change=_text(lambda t: t.update(sliding_window=t["sliding_window"] // 2))),
    "head_dim": dict(change=_text(lambda t: t.update(head_dim=t["head_dim"] * 2))),
    "vocabulary": dict(change=_text(lambda t: t.update(vocab_size=t["vocab_size"] * 2))),
    "backbone width": dict(change=lambda c: c.update(backbone_hidden_size=c["backbone_hidden_size"] * 2)),
    "missing tensor": dict(drop="layers.0.mlp.down_proj"),
}


@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_a_mismatched_assistant_is_never_merged(kind, tmp_path, capsys):
    assistant = _assistant_with(tmp_path, **MISMATCHES[kind])
    target = PAIR_DIR / "target"
    before = digests(assistant, target)
    out = tmp_path / "merged"
    code, _, err = run(capsys, "quantize", target, out, "--assistant", assistant)
    assert code == 2, err
    one_error_line(err)
    code, _, err = run(capsys, "generate", "--model", target, "--drafter", assistant, "--prompt", "x",
                       "--max-tokens", "2")
    assert code == 2, err
    one_error_line(err)
    assert not out.exists() and digests(assistant, target) == before


@pytest.mark.parametrize("target", [QWEN_DIR, GLM_DIR], ids=["qwen3_5", "glm4_moe"])
def test_a_gemma_assistant_is_refused_by_other_families(target, tmp_path, capsys):
    out = tmp_path / "merged"
    code, _, err = run(capsys, "quantize", target, out, "--assistant", PAIR_DIR / "assistant")
    assert code == 2 and "Gemma 4" in one_error_line(err), err
    assert not out.exists()


def test_a_sound_pair_still_merges_and_inspects_as_fitting(tmp_path, capsys):
    out = tmp_path / "merged"
    code, _, err = run(capsys, "quantize", PAIR_DIR / "target", out, "--assistant", PAIR_DIR / "assistant",
                       "--bits", "8")
    assert code == 0, err
    code, report, _ = run(capsys, "inspect", out)
    assert code == 0 and "fits the target" in report, report


# -- add-mtp checks the MTP tensors it writes ------------------------------------------------------

@pytest.fixture(scope="module")
def quant_without_mtp(tmp_path_factory):
    """demo_qwen quantized, then its MTP weights dropped, as mlx-lm's converter drops them."""
    root = tmp_path_factory.mktemp("quant")
    quant = root / "quant"
    assert main(["quantize", str(QWEN_DIR), str(quant), "--bits", "8"]) == 0
    config = json.loads((quant / "config.json").read_text())
    index = json.loads((quant / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (quant / "model.safetensors.index.json").write_text(json.dumps(index))
    (quant / "mtp.safetensors").unlink()
    config["quantization"] = {k: v for k, v in config["quantization"].items() if not k.startswith("mtp.")}
    config["quantization_config"] = config["quantization"]
    (quant / "config.json").write_text(json.dumps(config))
    (quant / ".omlx-mtp-output.json").unlink()
    return quant


@pytest.mark.parametrize("damage", [wrong_mtp_shape, missing_mtp_tensor], ids=lambda f: f.__name__)
def test_add_mtp_refuses_mtp_tensors_that_do_not_fit(damage, quant_without_mtp, tmp_path, capsys):
    original = tmp_path / "original"
    shutil.copytree(QWEN_DIR, original)
    damage(original)
    mlx_dir = tmp_path / "mlx"
    shutil.copytree(quant_without_mtp, mlx_dir)
    before = digests(original, mlx_dir)
    code, _, err = run(capsys, "add-mtp", original, mlx_dir)
    assert code == 2, err
    assert "MTP head" in one_error_line(err)
    assert digests(original, mlx_dir) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_add_mtp_adds_a_sound_head(quant_without_mtp, tmp_path, capsys):
    mlx_dir = tmp_path / "mlx"
    shutil.copytree(quant_without_mtp, mlx_dir)
    code, _, err = run(capsys, "add-mtp", QWEN_DIR, mlx_dir)
    assert code == 0, err
    code, report, _ = run(capsys, "inspect", mlx_dir)
    assert code == 0 and "built-in MTP head" in report, report


def _text_entry(key, value):
    return lambda d: _edit_config(d, lambda c: (c.get("text_config") or c).update({key: value}))


@pytest.mark.parametrize("damage", [
    lambda d: _edit_config(d, lambda c: c.update(text_config=5)),
    _text_entry("num_hidden_layers", "four"),
    _text_entry("vocab_size", -1),
    _text_entry("hidden_size", True),
    lambda d: _edit_config(d, lambda c: c.update(quantization=[1])),
    lambda d: _edit_config(d, lambda c: c.update(quantization={"bits": "x", "group_size": 64})),
    lambda d: _edit_config(d, lambda c: c.update(model_type=["qwen3_5"])),
], ids=["text_config", "layers", "vocab", "width", "quantization", "bits", "model_type"])
@pytest.mark.parametrize("base", [QWEN_DIR, GLM_DIR, PAIR_DIR / "assistant"], ids=["qwen", "glm", "assistant"])
def test_config_entries_of_the_wrong_kind_are_named(base, damage, tmp_path, capsys):
    directory = tmp_path / "model"
    shutil.copytree(base, directory)
    damage(directory)
    for args in (["quantize", directory, tmp_path / "out"], ["inspect", directory],
                 ["generate", "--model", directory, "--prompt", "x", "--max-tokens", "2"]):
        code, out, err = run(capsys, *args)
        if args[0] == "inspect":
            assert code == 1 and "must be" in out, out
        else:
            assert code == 2 and "must be" in one_error_line(err), err
    assert not (tmp_path / "out").exists()
