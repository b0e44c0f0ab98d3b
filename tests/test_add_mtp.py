"""``omlx-mtp add-mtp ORIGINAL MLX_DIR``: the MTP weights a converted quant dropped, added back from
the original release without rewriting the quant's weight files, reading only the MTP shards."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
import tqdm  # noqa: F401  (imported here, so that reading its modules is not counted as add-mtp's reads)

from omlx_mtp.checkpoint import add_mtp as add_mtp_module, shards
from omlx_mtp.checkpoint.add_mtp import add_mtp
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.checkpoint.mtp_tensors import is_mtp_tensor
from omlx_mtp.checkpoint.quantize import QuantizeOptions, quantize
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.requests import Request
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.errors import MTPError
from omlx_mtp.fixtures.tiny_qwen import TinyQwenSpec, write_qwen
from omlx_mtp.targets import wrap_target
from omlx_mtp.tools.cli import main
from omlx_mtp.tools.session import run_plain

from .conftest import prompts

INDEX = "model.safetensors.index.json"


def digests(directory) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def weight_files(found: dict) -> dict:
    """The trunk's weight files of ``digests``."""
    return {k: v for k, v in found.items() if k.startswith("model") and k.endswith(".safetensors")}


def reshard(directory, in_last) -> None:
    """Split a one-file checkpoint into two shards with an index, as releases are: the trunk's
    first tensors, then the rest with the tensors ``in_last`` picks (the MTP ones)."""
    tensors = dict(mx.load(str(directory / "model.safetensors")))
    (directory / "model.safetensors").unlink()
    late = {k for k in tensors if in_last(k) or k.startswith(("lm_head.", "model.norm."))}
    groups = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in late},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k in late}}
    for name, group in groups.items():
        mx.save_safetensors(str(directory / name), group, metadata={"format": "pt"})
    weight_map = {k: name for name, group in groups.items() for k in group}
    (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def mlx_community_quant(original, out, bits: int, group_size: int = 32):
    """MLX_DIR as mlx-community makes it: mlx-lm's converter (which drops MTP weights), float32 here.
    It converts a copy without them: mlx-lm's deepseek_v3 cannot load an MTP layer not at 61."""
    config = json.loads((original / "config.json").read_text())
    bare = out.parent / f"{out.name}-source"
    bare.mkdir()
    tensors = {}
    for file in original.glob("*.safetensors"):
        tensors.update({k: v for k, v in mx.load(str(file)).items() if not is_mtp_tensor(k, config)})
    mx.save_safetensors(str(bare / "model.safetensors"), tensors, metadata={"format": "pt"})
    for file in original.glob("*.json"):
        if file.name != INDEX:
            shutil.copy(file, bare / file.name)
    importlib.import_module("mlx_lm.convert").convert(str(bare), str(out), quantize=True, q_group_size=group_size,
                                                      q_bits=bits, dtype="float32")
    shutil.rmtree(bare)
    return out


def rchar() -> int | None:
    try:
        return int(next(line for line in open("/proc/self/io") if line.startswith("rchar")).split()[1])
    except OSError:
        return None


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("add-mtp-qwen")
    original = write_qwen(root / "original", TinyQwenSpec(moe=True))
    reshard(original, lambda name: name.startswith("mtp."))
    return original


@pytest.fixture
def quant(qwen, tmp_path):
    return mlx_community_quant(qwen, tmp_path / "q4", bits=4)


def check_decodes_losslessly(directory, vocab_size: int, count: int = 3):
    model, _, _ = load_target(directory)
    target = wrap_target(model)
    drafter = load_merged_drafter(directory, target)
    assert drafter is not None
    requests = [Request(p, max_tokens=40) for p in prompts(count, vocab_size, seed=5)]
    plain = [run_plain(target.plain_model(), Request(r.prompt, max_tokens=40)).row.generated for r in requests]
    rows = SpeculativeDecoder(target, drafter, draft_tokens=2).generate(requests)
    assert [row.generated for row in rows] == plain
    assert sum(row.stats.drafted for row in rows) > 0
    return target, drafter


def test_adds_mtp_reading_only_the_mtp_shard(qwen, quant, capsys):
    before_original, before = digests(qwen), digests(quant)
    old_config = json.loads((quant / "config.json").read_text())
    old_index = json.loads((quant / INDEX).read_text())
    start = rchar()
    assert main(["add-mtp", str(qwen), str(quant)]) == 0
    reads = None if start is None else rchar() - start
    out = capsys.readouterr().out
    assert "read " in out and "added the MTP weights" in out

    assert digests(qwen) == before_original
    after = digests(quant)
    assert set(after) == set(before) | {"mtp.safetensors"}
    assert {k: v for k, v in after.items() if k not in ("config.json", INDEX, "mtp.safetensors")} == \
        {k: v for k, v in before.items() if k not in ("config.json", INDEX)}  # weight files never rewritten
    config = json.loads((quant / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")} == \
        {k: v for k, v in old_config.items() if k not in ("quantization", "quantization_config")}
    assert config["quantization"].items() >= old_config["quantization"].items()  # only gains entries
    # the head's router gates at 8 bits, as mlx-lm's predicate keeps the trunk's
    assert config["quantization"]["mtp.layers.0.mlp.gate"]["bits"] == 8
    index = json.loads((quant / INDEX).read_text())["weight_map"]
    assert index.items() >= old_index["weight_map"].items()
    side = mx.load(str(quant / "mtp.safetensors"))
    assert {n for n, f in index.items() if f == "mtp.safetensors"} == set(side)
    assert "mtp.fc.scales" in side and side["mtp.fc.weight"].dtype == mx.uint32

    trunk_shard = qwen / "model-00001-of-00002.safetensors"
    total = sum(f.stat().st_size for f in qwen.glob("*.safetensors"))
    mtp_bytes = sum(v.nbytes for k, v in mx.load(str(qwen / "model-00002-of-00002.safetensors")).items()
                    if k.startswith("mtp."))
    assert mtp_bytes < total / 3
    if reads is not None:  # what the process read, all files together: not the trunk shard
        assert reads < trunk_shard.stat().st_size, (reads, trunk_shard.stat().st_size)
    counted = add_mtp(qwen, quant, force=True, progress=False)  # what add-mtp counts (and prints)
    assert mtp_bytes <= counted < mtp_bytes + 64_000 < total / 2  # its tensors, the headers and JSON files

    from mlx_lm.utils import load_model

    load_model(quant)  # plain mlx-lm still loads it
    check_decodes_losslessly(quant, 512)


def test_trunk_shards_are_never_read(qwen, quant, tmp_path):
    """ORIGINAL's trunk shard cut to its header (its tensors' bytes gone): only its header is read
    (for the embedding's shape), so add-mtp works as before."""
    cut = tmp_path / "cut"
    shutil.copytree(qwen, cut)
    shard = cut / "model-00001-of-00002.safetensors"
    with open(shard, "rb") as handle:
        header = 8 + int.from_bytes(handle.read(8), "little")
    os.truncate(shard, header)
    add_mtp(cut, quant, progress=False)
    check_decodes_losslessly(quant, 512, count=1)


def test_mtp_tensors_are_those_quantize_writes(qwen, tmp_path):
    """One conversion serves both: add-mtp on an 8-bit quant writes the tensors (and overrides)
    `quantize --bits 8 --mtp-bits 8 --mtp-head-bits 8` writes, and the head drafts as the
    original's does, up to 8-bit rounding."""
    q8 = mlx_community_quant(qwen, tmp_path / "q8", bits=8)
    add_mtp(qwen, q8, progress=False)
    ours = quantize(qwen, tmp_path / "ours", QuantizeOptions(bits=8, group_size=32, mtp_bits=8, mtp_head_bits=8,
                                                              dtype="float32"), progress=False)
    added, written = mx.load(str(q8 / "mtp.safetensors")), mx.load(str(ours / "mtp.safetensors"))
    assert set(added) == set(written)
    for name, value in written.items():
        assert mx.array_equal(added[name], value).item(), name
    overrides = {k: v for k, v in json.loads((q8 / "config.json").read_text())["quantization"].items()
                 if k.startswith("mtp.")}
    assert overrides == {k: v for k, v in json.loads((ours / "config.json").read_text())["quantization"].items()
                         if k.startswith("mtp.")}
    target, head = check_decodes_losslessly(q8, 512, count=1)
    assert_drafts_like_original(qwen, target, head)


def assert_drafts_like_original(original, target, head):
    reference = load_merged_drafter(original, target)  # the original's head, unquantized, on the same trunk
    tokens = mx.array([[5, 9, 13, 17, 21]])
    hidden = mx.random.normal((1, 5, target.args.hidden_size), key=mx.random.key(3))
    ours, _ = head.step(target, tokens, hidden, head.make_cache(1, 8))
    theirs, _ = reference.step(target, tokens, hidden, reference.make_cache(1, 8))
    error = (mx.abs(ours - theirs).max() / mx.abs(theirs).max()).item()
    assert error < 0.1, error


@pytest.mark.parametrize("change", ["config", "tensor"])
def test_another_model_is_refused(qwen, quant, tmp_path, capsys, change):
    if change == "config":  # another width
        other = write_qwen(tmp_path / "other", TinyQwenSpec(moe=True, hidden_size=96))
        needle = "hidden_size 64 vs 96"
    else:  # the same config, but an embedding of another vocabulary
        other = write_qwen(tmp_path / "other", TinyQwenSpec(moe=True, vocab_size=384))
        config = json.loads((other / "config.json").read_text())
        config["text_config"]["vocab_size"] = 512
        (other / "config.json").write_text(json.dumps(config))
        needle = "is [512, 64] in MLX_DIR (unpacked) and [384, 64] in ORIGINAL"
    before = digests(quant)
    assert main(["add-mtp", str(other), str(quant)]) == 2
    err = capsys.readouterr().err
    assert "is not a conversion of" in err and needle in err and "Traceback" not in err, err
    assert digests(quant) == before
    assert not list(tmp_path.glob(".q4.add-mtp-*"))


def test_existing_mtp_needs_force(qwen, quant, capsys):
    assert main(["add-mtp", str(qwen), str(quant)]) == 0
    first = digests(quant)
    assert main(["add-mtp", str(qwen), str(quant)]) == 2
    assert "already holds" in capsys.readouterr().err and digests(quant) == first
    assert main(["add-mtp", str(qwen), str(quant), "--bits", "8", "--force"]) == 0
    after = digests(quant)
    assert set(after) == set(first) and after["mtp.safetensors"] != first["mtp.safetensors"]
    assert weight_files(after) == weight_files(first)
    config = json.loads((quant / "config.json").read_text())
    assert config["quantization"]["mtp.fc"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    check_decodes_losslessly(quant, 512, count=1)


def test_no_index_gets_none(qwen, quant):
    """A quant without an index (mlx-lm globs model*.safetensors, ours every *.safetensors) gets none."""
    (quant / INDEX).unlink()
    add_mtp(qwen, quant, progress=False)
    assert not (quant / INDEX).exists() and (quant / "mtp.safetensors").is_file()
    check_decodes_losslessly(quant, 512, count=1)


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_error_leaves_mlx_dir_as_it_was(qwen, quant, monkeypatch, where):
    before = digests(quant)
    if where == "writing":
        calls = []
        write = shards._pwrite_all

        def failing(fd, data, offset):
            calls.append(1)
            if len(calls) == 5:
                raise OSError(28, "No space left on device")
            write(fd, data, offset)

        monkeypatch.setattr(shards, "_pwrite_all", failing)
    else:  # the side shard and index are in place when config.json's rename fails: both are undone
        replace = os.replace

        def failing(src, dst):
            if str(dst).endswith("config.json"):
                raise OSError(5, "I/O error")
            replace(src, dst)

        monkeypatch.setattr(add_mtp_module.os, "replace", failing)
    with pytest.raises((MTPError, OSError)):
        add_mtp(qwen, quant, progress=False)
    assert digests(quant) == before
    assert not list(quant.parent.glob(".q4.add-mtp-*"))


def test_killed_mid_write_leaves_mlx_dir_as_it_was(qwen, quant):
    before = digests(quant)
    script = textwrap.dedent(f"""
        import os, signal
        from omlx_mtp.checkpoint import shards
        from omlx_mtp.checkpoint.add_mtp import add_mtp
        write, calls = shards._pwrite_all, []
        def dying(fd, data, offset):
            calls.append(1)
            if len(calls) == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            write(fd, data, offset)
        shards._pwrite_all = dying
        add_mtp({str(qwen)!r}, {str(quant)!r}, progress=False)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert digests(quant) == before
    assert len(list(quant.parent.glob(".q4.add-mtp-*"))) == 1  # a killed run cannot clean up after itself
    add_mtp(qwen, quant, progress=False)  # the next run removes it
    assert not list(quant.parent.glob(".q4.add-mtp-*"))
    assert (quant / "mtp.safetensors").is_file()


def test_gemma4_assistant(tmp_path, capsys):
    from omlx_mtp.fixtures.tiny import TinySpec, write_pair

    target, assistant = write_pair(tmp_path / "pair", TinySpec(k_eq_v=True))
    q = mlx_community_quant(target, tmp_path / "q", bits=4)
    assert main(["add-mtp", str(target), str(q)]) == 2  # no MTP tensors of its own
    assert "no MTP tensors" in capsys.readouterr().err
    before = digests(q)
    assert main(["add-mtp", str(target), str(q), "--assistant", str(assistant)]) == 0
    config = json.loads((q / "config.json").read_text())
    assert config["mtp_assistant_config"]["model_type"] == "gemma4_assistant"
    assert weight_files(digests(q)) == weight_files(before)
    assert all(name.startswith("mtp.") for name in mx.load(str(q / "mtp.safetensors")))
    check_decodes_losslessly(q, 512, count=2)


NEXTN_FAMILIES = ["glm4_moe", "glm4_moe_lite", "deepseek_v3", "deepseek_v32"]


@pytest.mark.parametrize("family", NEXTN_FAMILIES)
def test_nextn_layer(family, tmp_path):
    """The nextn families: the MTP layer model.layers.{N} read from the release's shards, its
    decoder block converted (experts stacked, DeepSeek's kv_b_proj split) and quantized at the
    quant's 8 bits; the layer drafts as the original's does and decoding stays lossless."""
    pytest.importorskip("torch")
    pytest.importorskip("omlx_mtp.drafters.nextn", reason="the nextn drafter (drafters/nextn.py) has not landed")
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    original = write_nextn(tmp_path / "original", TinyNextnSpec(family=family, own_embed_head=family != "glm4_moe"))
    q8 = mlx_community_quant(original, tmp_path / "q8", bits=8)
    before_original, before = digests(original), digests(q8)
    read = add_mtp(original, q8, progress=False)
    assert digests(original) == before_original and weight_files(digests(q8)) == weight_files(before)
    assert read < sum(f.stat().st_size for f in original.glob("*.safetensors")) / 2
    N = json.loads((original / "config.json").read_text())["num_hidden_layers"]
    side = mx.load(str(q8 / "mtp.safetensors"))
    assert all(name.startswith(f"model.layers.{N}.") for name in side)
    assert f"model.layers.{N}.mlp.switch_mlp.gate_proj.scales" in side and f"model.layers.{N}.eh_proj.scales" in side
    assert not any(".experts." in name or "kv_b_proj" in name for name in side)
    index = json.loads((q8 / INDEX).read_text())["weight_map"]
    assert index[f"model.layers.{N}.eh_proj.weight"] == "mtp.safetensors"

    from mlx_lm.utils import load_model

    load_model(q8)  # plain mlx-lm loads the trunk, the layer in the side shard left alone
    target, layer = check_decodes_losslessly(q8, 512, count=2)
    assert layer.own_embedding == (family != "glm4_moe")
    assert_drafts_like_original(original, target, layer)


def test_multimodal_quant_gets_the_side_folder(tmp_path):
    """A multimodal quant (mlx-vlm's converter): the head goes to mtp/mtp.safetensors, which mlx-vlm
    does not load, and its index is left alone; --force with --mode replaces it inside that folder."""
    from mlx_vlm.convert import convert

    original = write_qwen(tmp_path / "original", TinyQwenSpec(vision=True))
    q = tmp_path / "q"
    convert(str(original), str(q), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    before = digests(q)
    add_mtp(original, q, progress=False)
    after = digests(q)
    assert set(after) == set(before) | {"mtp/mtp.safetensors"}
    assert {k: v for k, v in after.items() if k != "config.json" and not k.startswith("mtp/")} == \
        {k: v for k, v in before.items() if k != "config.json"}  # the index too
    check_decodes_losslessly(q, 512, count=1)
    add_mtp(original, q, mode="mxfp4", force=True, progress=False)
    assert json.loads((q / "config.json").read_text())["quantization"]["mtp.fc"]["mode"] == "mxfp4"
    assert set(digests(q)) == set(after)
    check_decodes_losslessly(q, 512, count=1)


def fp8_release(original, out, dequantized):
    """Copies of a nextn checkpoint with its MTP layer's matrices stored as DeepSeek-V3's releases
    store them (F8_E4M3, one float32 weight_scale_inv per 128 x 128 block) in ``out``, and as the
    model's sanitizer dequantizes them (bfloat16) in ``dequantized``."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    config = json.loads((original / "config.json").read_text())
    N = config["num_hidden_layers"]
    weight_map = json.loads((original / INDEX).read_text())["weight_map"]
    for directory, kind in ((out, "fp8"), (dequantized, "bf16")):
        shutil.copytree(original, directory)
        new_map = dict(weight_map)
        for file in original.glob("model-*.safetensors"):
            tensors = {}
            for name, value in mx.load(str(file)).items():
                rest = name.removeprefix(f"model.layers.{N}.")
                if rest == name or value.ndim != 2 or "norm" in rest or rest.startswith(("mlp.gate.", "embed_tokens")):
                    tensors[name] = torch.from_numpy(np.array(value))
                    continue
                m, n = value.shape
                blocks = value.astype(mx.float32)
                pad = mx.pad(blocks, ((0, -m % 128), (0, -n % 128))).reshape((m + -m % 128) // 128, 128, -1, 128)
                scale = mx.maximum(mx.abs(pad).max(axis=(1, 3)), 1e-12) / 448.0
                expanded = mx.repeat(mx.repeat(scale, 128, axis=0), 128, axis=1)[:m, :n]
                stored = mx.to_fp8(blocks / expanded)
                if kind == "fp8":
                    tensors[name] = torch.from_numpy(np.array(stored)).view(torch.float8_e4m3fn)
                    tensors[name + "_scale_inv"] = torch.from_numpy(np.array(scale))
                    new_map[name + "_scale_inv"] = file.name
                else:  # what mlx-lm's dequant gives: bfloat16 values times the float32 scale, in bfloat16
                    deq = (mx.from_fp8(stored, dtype=mx.bfloat16) * expanded).astype(mx.bfloat16)
                    tensors[name] = torch.from_numpy(np.array(deq.astype(mx.float32))).to(torch.bfloat16)
            save_file(tensors, str(directory / file.name), metadata={"format": "pt"})
        (directory / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
    return out


def test_fp8_release(tmp_path):
    """DeepSeek-V3.x releases are FP8: the MTP layer is dequantized by the model's sanitizer (the
    block and eh_proj alike) and written as from a bfloat16 release of the same values."""
    pytest.importorskip("torch")
    from omlx_mtp.fixtures.tiny_nextn import TinyNextnSpec, write_nextn

    original = write_nextn(tmp_path / "original", TinyNextnSpec(family="deepseek_v3"))
    fp8 = fp8_release(original, tmp_path / "fp8", tmp_path / "bf16")
    q8 = mlx_community_quant(original, tmp_path / "q8", bits=8)
    reference = tmp_path / "q8-reference"
    shutil.copytree(q8, reference)
    add_mtp(fp8, q8, progress=False)
    add_mtp(tmp_path / "bf16", reference, progress=False)
    added, expected = mx.load(str(q8 / "mtp.safetensors")), mx.load(str(reference / "mtp.safetensors"))
    assert set(added) == set(expected) and not any("scale_inv" in name for name in added)
    for name, value in expected.items():
        assert mx.array_equal(added[name], value).item(), name
    check_decodes_losslessly(q8, 512, count=1)

    from safetensors.torch import load_file, save_file  # an FP8 weight without its scale is refused

    scale = "model.layers.3.eh_proj.weight_scale_inv"
    shard = next(f for f in fp8.glob("model-*.safetensors") if scale in load_file(f))
    tensors = load_file(shard)
    del tensors[scale]
    save_file(tensors, str(shard))
    before = digests(reference)
    with pytest.raises(MTPError, match="eh_proj.weight is FP8 .* does not dequantize it"):
        add_mtp(fp8, reference, force=True, progress=False)
    assert digests(reference) == before


def test_qwen3_next(tmp_path):
    next_fixtures = pytest.importorskip("omlx_mtp.fixtures.tiny_qwen_next",
                                        reason="the Qwen3-Next fixture has not landed")
    original = next_fixtures.write_qwen_next(tmp_path / "original", next_fixtures.TinyQwenNextSpec())
    q8 = mlx_community_quant(original, tmp_path / "q8", bits=8)
    assert add_mtp(original, q8, progress=False) < sum(f.stat().st_size for f in original.glob("*.safetensors")) / 2
    assert json.loads((q8 / "config.json").read_text())["quantization"]["mtp.layers.0.mlp.gate"]["bits"] == 8
    target, head = check_decodes_losslessly(q8, 512, count=2)
    assert_drafts_like_original(original, target, head)
