"""``omlx-mtp quantize`` / ``inspect``: quantized checkpoints keep their MTP weights."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx_mtp.errors import CheckpointError
from omlx_mtp.tools.cli import main
from omlx_mtp.fixtures.tiny import TinySpec, write_pair


def digest(directory) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def run(capsys, *args):
    code = main(list(map(str, args)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate(capsys, model, *extra):
    code, out, err = run(capsys, "generate", "--model", model, "--prompt", "hello world", "--max-tokens", "40",
                         "--json", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("q31b"), TinySpec(k_eq_v=True))


def test_gemma4_round_trip(gemma_pair, tmp_path, capsys):
    target, assistant = gemma_pair
    before = digest(target.parent)
    out = tmp_path / "q4"
    code, _, err = run(capsys, "quantize", target, out, "--bits", "4", "--group-size", "32", "--dtype", "float32",
                       "--assistant", assistant)
    assert code == 0, err
    assert digest(target.parent) == before  # SRC untouched

    code, report, _ = run(capsys, "inspect", out, "--json")
    report = json.loads(report)
    assert code == 0 and report["problems"] == []
    assert report["quantization"]["bits"] == 4
    source = mx.load(str(assistant / "model.safetensors"))
    assert report["mtp"]["count"] == len(source)
    kept = mx.load(str(out / "mtp.safetensors"))
    for name, value in source.items():
        entry = report["mtp"]["tensors"]["mtp." + name]
        assert entry["precision"] in ("float32", "int64")
        assert mx.array_equal(kept["mtp." + name], value).item(), name  # bit-identical
    assert report["drafter"]["merged"] and report["drafter"]["fits_target"]

    from mlx_lm import load  # plain mlx-lm loads the quantized trunk

    model, _ = load(str(out))
    assert any(name.endswith(".scales") for name, _ in tree_flatten(model.parameters()))

    with_mtp = generate(capsys, out)  # no --drafter: the merged assistant is used
    without = generate(capsys, out, "--no-mtp")
    assert with_mtp["mtp"] and with_mtp["drafted"] > 0
    assert with_mtp["tokens"] == without["tokens"]


def test_merged_centroid_assistant_with_quantized_mtp(tmp_path, capsys):
    spec = TinySpec(layout="e2b", model_type="gemma4", spelling="per_layer", num_layers=6, centroid_head=True)
    target, assistant = write_pair(tmp_path / "pair", spec)
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", target, out, "--group-size", "32", "--dtype", "float32",
                       "--mtp-bits", "8", "--mtp-head-bits", "4", "--assistant", assistant)
    assert code == 0, err
    code, report, _ = run(capsys, "inspect", out, "--json")
    tensors = json.loads(report)["mtp"]["tensors"]
    assert tensors["language_model.mtp.model.embed_tokens.weight"]["precision"] == "4-bit affine"
    assert tensors["language_model.mtp.pre_projection.weight"]["precision"] == "8-bit affine"
    assert tensors["language_model.mtp.model.norm.weight"]["precision"] == "float32"
    with_mtp = generate(capsys, out)
    without = generate(capsys, out, "--no-mtp")
    assert with_mtp["drafted"] > 0 and with_mtp["tokens"] == without["tokens"]


def qwen35_checkpoint(directory, mtp: bool = True):
    """A tiny Qwen3.5 (hybrid linear attention) checkpoint with mtp.* tensors, MLX layout, bf16."""
    from mlx_lm.models import qwen3_5

    config = {
        "model_type": "qwen3_5", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1,
    }
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    rng = np.random.default_rng(0)
    weights = {k: mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32)).astype(mx.bfloat16)
               for k, v in tree_flatten(model.parameters())}
    if mtp:  # a whole head, as the release ships it: every tensor the drafter reads
        from omlx_mtp.drafters.qwen3_5_mtp import Qwen35MTPHead

        head = Qwen35MTPHead(model.language_model.args if hasattr(model, "language_model") else model.args)
        for name, value in tree_flatten(head.parameters()):
            weights["mtp." + name] = mx.array(rng.normal(0, 0.05, value.shape).astype(np.float32)).astype(mx.bfloat16)
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory, weights


@pytest.mark.parametrize("mtp_bits", [None, 8])
def test_qwen35_keeps_mtp(tmp_path, capsys, mtp_bits):
    src, weights = qwen35_checkpoint(tmp_path / "qwen")
    out = tmp_path / "out"
    args = ["quantize", src, out, "--group-size", "32"] + (["--mtp-bits", str(mtp_bits)] if mtp_bits else [])
    code, _, err = run(capsys, *args)
    assert code == 0, err
    code, report, _ = run(capsys, "inspect", out, "--json")
    mtp = json.loads(report)["mtp"]
    assert set(mtp["tensors"]) >= {"mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight", "mtp.norm.weight"}
    assert mtp["families"] == {"mtp-module": mtp["count"]}
    kept = mx.load(str(out / "mtp.safetensors"))
    if mtp_bits is None:
        assert mtp["tensors"]["mtp.fc.weight"]["precision"] == "bfloat16"
        assert mx.array_equal(kept["mtp.fc.weight"], weights["mtp.fc.weight"]).item()
    else:
        assert mtp["tensors"]["mtp.fc.weight"]["precision"] == "8-bit affine"
        assert "mtp.fc.scales" in kept
        assert mtp["tensors"]["mtp.norm.weight"]["precision"] == "bfloat16"
    from mlx_lm import load

    load(str(out))  # plain mlx-lm still loads the trunk


def expect_failure(capsys, *args, needle):
    code, _, err = run(capsys, *args)
    assert code == 2 and "Traceback" not in err and needle in err, err
    return err


def test_refuses_existing_out_without_force(gemma_pair, tmp_path, capsys):
    target, _ = gemma_pair
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    expect_failure(capsys, "quantize", target, out, needle="--force")
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only what omlx-mtp wrote: a directory of someone else's files stays
    expect_failure(capsys, "quantize", target, out, "--force", needle="keep.txt")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    code, _, err = run(capsys, "quantize", target, out, "--group-size", "32", "--force")  # an empty one is fine
    assert code == 0, err
    first = digest(out)
    code, _, err = run(capsys, "quantize", target, out, "--group-size", "64", "--force")  # its own output too
    assert code == 0, err
    assert digest(out) != first and (out / "config.json").exists()


def corrupt_copy(source, tmp_path, name):
    broken = tmp_path / name
    shutil.copytree(source, broken)
    return broken


def test_truncated_safetensors(gemma_pair, tmp_path, capsys):
    src = corrupt_copy(gemma_pair[0], tmp_path, "trunc")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 100])
    before = digest(src)
    expect_failure(capsys, "quantize", src, tmp_path / "out", needle="corrupt or truncated")
    assert not (tmp_path / "out").exists() and digest(src) == before
    assert not list(tmp_path.glob(".out.partial-*"))


def test_missing_config(gemma_pair, tmp_path, capsys):
    src = corrupt_copy(gemma_pair[0], tmp_path, "noconfig")
    (src / "config.json").unlink()
    expect_failure(capsys, "quantize", src, tmp_path / "out", needle="config.json")
    assert not (tmp_path / "out").exists()


def test_unsupported_dtype(gemma_pair, tmp_path, capsys):
    src = corrupt_copy(gemma_pair[0], tmp_path, "f8")
    header = json.dumps({"odd": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}).encode()
    (src / "extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    expect_failure(capsys, "quantize", src, tmp_path / "out", needle="unsupported dtype F8_E4M3")


def test_assistant_that_does_not_fit(gemma_pair, tmp_path, capsys):
    from omlx_mtp.fixtures.tiny import write_assistant

    other = write_assistant(tmp_path / "other", TinySpec(hidden_size=96))
    err = expect_failure(capsys, "quantize", gemma_pair[0], tmp_path / "out", "--assistant", other,
                         needle="backbone_hidden_size 96 != target hidden_size 64")
    assert str(other) in err
    assert not (tmp_path / "out").exists()


def test_interrupt_leaves_nothing(gemma_pair, tmp_path, monkeypatch):
    from omlx_mtp.checkpoint import shards

    calls = {"n": 0}
    real = shards._convert

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        yield from real(*args)

    monkeypatch.setattr(shards, "_convert", interrupted)
    assert main(["quantize", str(gemma_pair[0]), str(tmp_path / "out"), "--group-size", "32"]) == 130
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.parametrize("mode, shard_bytes", [("affine", 5 << 30), ("mxfp4", 20_000)])
def test_pieces_of_a_few_rows_write_the_same_bytes(gemma_pair, tmp_path, monkeypatch, mode, shard_bytes):
    from omlx_mtp.checkpoint import quantize as quantize_module, shards

    target, assistant = gemma_pair
    options = quantize_module.QuantizeOptions(mode=mode, group_size=32, mtp_bits=8, shard_bytes=shard_bytes)
    whole = quantize_module.quantize(target, tmp_path / "whole", options, assistant=assistant, progress=False)
    monkeypatch.setattr(shards, "PIECE_BYTES", 1)  # one row per piece, many pieces in flight
    rows = quantize_module.quantize(target, tmp_path / "rows", options, assistant=assistant, progress=False)
    assert digest(rows) == digest(whole)


def writer_threads():
    return [t for t in threading.enumerate() if t.name == "omlx-mtp-quantize-writer"]


@pytest.mark.parametrize("failure, code, needle", [
    ("source truncated", 2, "truncated (tensor"),
    ("disk full", 2, "writing the quantized checkpoint failed"),
    ("interrupt", 130, "interrupted; nothing was written"),
])
def test_failure_late_in_the_pipeline_leaves_nothing(gemma_pair, tmp_path, capsys, monkeypatch, failure, code,
                                                     needle):
    """A failure while pieces are being read, quantized and written (here after most of them):
    a clear error, no output, no staging directory, no writer thread left running."""
    from omlx_mtp.checkpoint import shards

    src = corrupt_copy(gemma_pair[0], tmp_path, "src")
    before = digest(src)
    monkeypatch.setattr(shards, "PIECE_BYTES", 512)  # ~1800 pieces
    calls = {"read": 0, "write": 0}
    read, write = shards._Reader.read_rows, shards._pwrite_all

    def reading(self, tensor, first, last):
        calls["read"] += 1
        if calls["read"] == 1500 and failure == "source truncated":
            os.truncate(tensor.file, tensor.start)  # the file shrinks under the quantizer
        if calls["read"] == 1500 and failure == "interrupt":
            raise KeyboardInterrupt
        return read(self, tensor, first, last)

    def writing(fd, data, offset):
        if threading.current_thread() in writer_threads():
            calls["write"] += 1
            if calls["write"] == 4000 and failure == "disk full":
                raise OSError(errno.ENOSPC, "No space left on device")
        write(fd, data, offset)

    monkeypatch.setattr(shards._Reader, "read_rows", reading)
    monkeypatch.setattr(shards, "_pwrite_all", writing)
    got, _, err = run(capsys, "quantize", src, tmp_path / "out", "--group-size", "32")
    assert got == code and needle in err and "Traceback" not in err, err
    assert calls["read"] > 1000 and calls["write"] > 1000  # it failed mid-pipeline, not before
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    assert writer_threads() == []
    if failure != "source truncated":
        assert digest(src) == before


def test_inspect_broken_checkpoint(gemma_pair, tmp_path, capsys):
    src = corrupt_copy(gemma_pair[0], tmp_path, "broken")
    (src / "model.safetensors").write_bytes(b"\x00" * 16)
    code, out, _ = run(capsys, "inspect", src)
    assert code != 0 and "problem:" in out


def test_small_shards_and_mxfp4(gemma_pair, tmp_path):
    from mlx_lm import load

    from omlx_mtp.checkpoint.quantize import QuantizeOptions, quantize

    target, assistant = gemma_pair
    out = quantize(target, tmp_path / "mx", QuantizeOptions(mode="mxfp4", dtype="bfloat16", shard_bytes=20_000),
                   assistant=assistant, progress=False)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == set(shards) | {"mtp.safetensors"}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["mode"] == "mxfp4" and config["quantization"]["group_size"] == 32
    model, _ = load(str(out))
    assert model(mx.array([[3, 4, 5]])).shape == (1, 3, 512)


def test_already_quantized_source_is_refused(gemma_pair, tmp_path, capsys):
    first = tmp_path / "q"
    assert main(["quantize", str(gemma_pair[0]), str(first), "--group-size", "32"]) == 0
    expect_failure(capsys, "quantize", first, tmp_path / "again", needle="already quantized")


@pytest.mark.parametrize("name, config, family", [
    ("mtp.layers.0.mlp.gate_proj.weight", {}, "mtp-module"),
    ("model.mtp.fc.weight", {}, "mtp-module"),
    ("language_model.mtp.pre_projection.weight", {}, "mtp-module"),
    ("model.mtp_layers.0.input_proj.weight", {}, "mimo"),
    ("mtp_block.0.mlp.up_proj.weight", {}, "ernie"),
    ("mtp_linear_proj.0.weight", {}, "ernie"),
    ("model.layers.61.eh_proj.weight", {"num_hidden_layers": 61, "num_nextn_predict_layers": 1}, "deepseek-v3"),
    ("model.layers.60.mlp.gate_proj.weight", {"num_hidden_layers": 61, "num_nextn_predict_layers": 1}, None),
    ("model.layers.3.self_attn.q_proj.weight", {}, None),
    ("model.embed_tokens.weight", {}, None),
    ("model.smtp.weight", {}, None),
])
def test_mtp_registry(name, config, family):
    from omlx_mtp.checkpoint.mtp_tensors import mtp_family

    assert mtp_family(name, config) == family


def test_tensors_read_whole_go_one_at_a_time(gemma_pair, tmp_path, monkeypatch):
    """A tensor without a file region (transformed by a sanitizer, or a multimodal trunk that
    mlx-vlm loads itself) is read whole: it is never in flight beside another, so memory stays
    near one tensor; the bytes are those of the piece-wise path."""
    from omlx_mtp.checkpoint import quantize as quantize_module, shards

    target, assistant = gemma_pair
    options = quantize_module.QuantizeOptions(group_size=32, mtp_bits=8)
    pieces = quantize_module.quantize(target, tmp_path / "pieces", options, assistant=assistant, progress=False)
    monkeypatch.setattr(shards, "file_tensors", lambda directory: {})  # every tensor read whole
    in_flight, most = [0], [0]
    start, finish = shards._start_piece, shards._finish_piece

    def counting_start(*args, **kwargs):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return start(*args, **kwargs)

    def counting_finish(*args, **kwargs):
        in_flight[0] -= 1
        return finish(*args, **kwargs)

    monkeypatch.setattr(shards, "_start_piece", counting_start)
    monkeypatch.setattr(shards, "_finish_piece", counting_finish)
    whole = quantize_module.quantize(target, tmp_path / "whole", options, assistant=assistant, progress=False)
    assert most[0] == 1
    assert digest(whole) == digest(pieces)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_nextn_layer_kept_and_converted(family, tmp_path, capsys):
    """The nextn MTP layer model.layers.{N} goes to the side shard, its decoder block converted as a
    trunk layer (experts stacked, kv_b_proj split) at the trunk's 4 bits, its own parts by the MTP
    knobs (--mtp-bits for eh_proj, --mtp-head-bits for embed_tokens / shared_head.head)."""
    pytest.importorskip("torch")
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    src = write_nextn(tmp_path / "src", TinyNextnSpec(family=family, num_layers=2))
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", src, out, "--group-size", "32", "--dtype", "float32", "--mtp-bits", "8",
                       "--mtp-head-bits", "6")
    assert code == 0, err
    N, layer = 2, "model.layers.2."
    side = mx.load(str(out / "mtp.safetensors"))
    assert all(name.startswith(layer) for name in side)
    trunk = {k for f in out.glob("model*.safetensors") for k in mx.load(str(f))}
    assert not any(name.startswith(layer) for name in trunk)
    assert layer + "mlp.switch_mlp.gate_proj.scales" in side and not any(".experts." in n for n in side)
    if family == "deepseek_v3":
        assert layer + "self_attn.embed_q.scales" in side and not any("kv_b_proj" in n for n in side)
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    assert q[layer + "eh_proj"]["bits"] == 8 and q[layer + "shared_head.head"]["bits"] == 6
    assert q[layer + "embed_tokens"]["bits"] == 6 and layer + "mlp.switch_mlp.gate_proj" not in q  # the trunk's
    assert side[layer + "enorm.weight"].dtype == mx.float32
    assert config["num_nextn_predict_layers"] == 1

    code, report, _ = run(capsys, "inspect", out, "--json")
    drafter = json.loads(report)["drafter"]
    assert code == 0 and drafter["model_type"] == "nextn" and drafter["family"] == "deepseek-v3"
    assert drafter["index"] == N and drafter["own_embedding"] and drafter["own_head"]
    assert set(drafter["precision"]) == {"4-bit affine", "8-bit affine", "6-bit affine", "float32"}

    from mlx_lm import load

    load(str(out))  # plain mlx-lm loads the trunk


def test_nextn_layer_loads_and_decodes(tmp_path, capsys):
    pytest.importorskip("torch")
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    src = write_nextn(tmp_path / "src", TinyNextnSpec(family="glm4_moe_lite", own_embed_head=False))
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", src, out, "--group-size", "32", "--dtype", "float32")
    assert code == 0, err
    with_mtp, without = generate(capsys, out), generate(capsys, out, "--no-mtp")
    assert with_mtp["drafted"] > 0 and with_mtp["tokens"] == without["tokens"]


def test_nextn_layer_with_its_own_bits_decodes(tmp_path, capsys):
    """The layer's own parts off the trunk's scheme (per-module overrides) load and draft."""
    pytest.importorskip("torch")
    from omlx_mtp.checkpoint.loading import load_target
    from omlx_mtp.drafters import load_merged_drafter
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn
    from omlx_mtp.targets import wrap_target

    src = write_nextn(tmp_path / "src", TinyNextnSpec(family="glm4_moe", num_layers=2))
    out = tmp_path / "q"
    code, _, err = run(capsys, "quantize", src, out, "--group-size", "32", "--dtype", "float32", "--mtp-bits", "8",
                       "--mtp-head-bits", "6")
    assert code == 0, err
    model, _, _ = load_target(out)
    load_merged_drafter(out, wrap_target(model))
    with_mtp, without = generate(capsys, out), generate(capsys, out, "--no-mtp")
    assert with_mtp["drafted"] > 0 and with_mtp["tokens"] == without["tokens"]


def test_inspect_nextn_problems(tmp_path, capsys):
    """A layer the config promises but the shards lack, or one at another index than num_hidden_layers."""
    pytest.importorskip("torch")
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    src = write_nextn(tmp_path / "src", TinyNextnSpec(family="glm4_moe"))
    config = json.loads((src / "config.json").read_text())
    code, report, _ = run(capsys, "inspect", src)
    assert code == 0 and "built-in MTP layer (deepseek-v3) at model.layers.3" in report
    config["num_hidden_layers"] = 2  # the layer at 3 is now one past what the config says
    (src / "config.json").write_text(json.dumps(config))
    code, report, _ = run(capsys, "inspect", src)
    assert code == 1 and "sit at model.layers.3, not at model.layers.2" in report
    config["num_hidden_layers"] = 4  # the config puts it past the trunk's last layer
    (src / "config.json").write_text(json.dumps(config))
    code, report, _ = run(capsys, "inspect", src)
    assert code == 1 and "sit at model.layers.3, not at model.layers.4" in report
    config["num_hidden_layers"] = 3  # right, but the layer dropped (as mlx-lm's converter drops it)
    (src / "config.json").write_text(json.dumps(config))
    tensors = {k: v for f in src.glob("model-*.safetensors") for k, v in mx.load(str(f)).items()
               if not k.startswith("model.layers.3.")}
    for f in src.glob("model*.safetensors*"):
        f.unlink()
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    code, report, _ = run(capsys, "inspect", src)
    assert code == 1 and "(num_nextn_predict_layers: 1) but there are no model.layers.3.* tensors" in report


def test_trunk_layer_the_sanitizer_drops_is_kept():
    """deepseek_v3's sanitize drops model.layers.61* whatever the depth: a deeper variant's real
    layer 61 is converted on its own and kept (and an MTP layer at 62 never reaches it)."""
    from omlx_mtp.checkpoint.conversion import model_for, sanitize_trunk

    config = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "moe_intermediate_size": 16, "num_hidden_layers": 62, "num_attention_heads": 2,
              "num_key_value_heads": 2, "n_routed_experts": 2, "n_shared_experts": 1, "num_experts_per_tok": 1,
              "first_k_dense_replace": 0, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
              "qk_nope_head_dim": 8, "v_head_dim": 8, "num_nextn_predict_layers": 1}
    model = model_for(config, "test")
    trunk = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight": mx.zeros((16, 32))
             for i in (60, 61) for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    trunk.update({f"model.layers.{i}.self_attn.kv_b_proj.weight": mx.zeros((2 * 16, 16)) for i in (60, 61)})
    assert not any(k.startswith("model.layers.61.") for k in model.sanitize(dict(trunk)))  # what it does alone
    kept = sanitize_trunk(model, trunk, config)
    assert kept["model.layers.61.mlp.switch_mlp.gate_proj.weight"].shape == (2, 16, 32)
    assert "model.layers.61.self_attn.embed_q.weight" in kept
    assert {k.replace(".61.", ".60.") for k in kept if ".61." in k} == {k for k in kept if ".60." in k}
