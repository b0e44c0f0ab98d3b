"""Outputs that never destroy: ``--force`` replaces only what omlx-mtp wrote, never an input or the
working directory; a run killed at any point leaves the old state or the new one, and the next run
recovers (undoes a half-made commit, removes the leftovers and says so)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omlx_mtp.checkpoint.staging import recover_stale
from omlx_mtp.fixtures.demo import PAIR_DIR, QWEN_DIR
from omlx_mtp.tools.cli import main


def digests(*directories) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in directories for p in sorted(Path(d).rglob("*")) if p.is_file()}


def refused(capsys, *args, needle: str) -> str:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err, err
    return err


@pytest.fixture
def src(tmp_path):
    directory = tmp_path / "models" / "qwen"
    shutil.copytree(QWEN_DIR, directory)
    return directory


def test_force_never_deletes_an_input_or_the_working_directory(src, tmp_path, capsys, monkeypatch):
    assistant = tmp_path / "assistant"
    shutil.copytree(PAIR_DIR / "assistant", assistant)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    before = digests(tmp_path)
    refused(capsys, "quantize", src, src.parent, "--force", needle="contains SRC")
    refused(capsys, "quantize", src, src, "--force", needle="is SRC")
    refused(capsys, "quantize", src, src / "inside", "--force", needle="inside SRC")
    refused(capsys, "quantize", PAIR_DIR / "target", assistant, "--assistant", assistant, "--force",
            needle="is the assistant")
    monkeypatch.chdir(work)
    refused(capsys, "quantize", src, ".", "--force", needle="is the working directory")
    refused(capsys, "quantize", src, tmp_path, "--force", needle="contains")
    refused(capsys, "quantize", src, "notes.txt", "--force", needle="not a directory omlx-mtp wrote")
    refused(capsys, "quantize", src, work, "--force", needle="is the working directory")
    monkeypatch.chdir(tmp_path)
    refused(capsys, "quantize", src, work, "--force", needle="notes.txt")  # not a checkpoint: never wiped
    assert digests(tmp_path) == before


CHILD = textwrap.dedent("""
    import os, signal, sys
    # Kill this process outright at the Nth call of a function (a power cut at that point).
    module, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import importlib
    owner = importlib.import_module(module)
    real, calls = getattr(owner, name), [0]
    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= count:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(owner, name, dying)
    from omlx_mtp.tools.cli import main
    sys.exit(main(sys.argv[4:]))
""")


def killed(where: str, count: int, *args) -> None:
    module, name = where.rsplit(".", 1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", CHILD, module, name, str(count), *map(str, args)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == -9, result.stderr  # it was killed where asked, not finished or failed


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}."))


@pytest.mark.parametrize("pieces", [1, 4])
def test_quantize_killed_while_writing_leaves_nothing_and_the_next_run_cleans_up(pieces, src, tmp_path, capsys):
    out = tmp_path / "out"
    killed("omlx_mtp.checkpoint.shards._pwrite_all", pieces, "quantize", src, out)
    assert not out.exists() and leftovers(out), "a killed run leaves only its hidden staging directory"
    assert main(["quantize", str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert "left by an interrupted run; removed it" in err
    assert leftovers(out) == [] and main(["inspect", str(out)]) == 0


def test_quantize_force_killed_inside_the_swap_keeps_the_old_output(src, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--bits", "8"]) == 0
    old = digests(out)
    # The old output is moved aside, then the new one renamed in: killed between the two.
    killed("os.replace", 1, "quantize", src, out, "--bits", "4", "--force")
    assert not out.exists() and leftovers(out)
    recover_stale(out, ("partial",))
    assert digests(out) == old and leftovers(out) == []
    assert main(["quantize", str(src), str(out), "--bits", "4", "--force"]) == 0
    assert digests(out) != old and json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4


@pytest.fixture
def quant_without_mtp(src, tmp_path):
    """demo_qwen quantized, its MTP weights then dropped as mlx-lm's converter drops them."""
    quant = tmp_path / "quant"
    assert main(["quantize", str(src), str(quant), "--bits", "8"]) == 0
    (quant / "mtp.safetensors").unlink()
    index = json.loads((quant / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (quant / "model.safetensors.index.json").write_text(json.dumps(index))
    return quant


@pytest.mark.parametrize("where, count", [("os.replace", 2), ("os.replace", 3),
                                          ("omlx_mtp.checkpoint.shards._pwrite_all", 2)],
                         ids=["after-the-side-shard", "after-the-index", "while-writing"])
def test_add_mtp_killed_anywhere_leaves_mlx_dir_as_it_was(where, count, src, quant_without_mtp, capsys):
    before = digests(quant_without_mtp)
    killed(where, count, "add-mtp", src, quant_without_mtp)
    assert leftovers(quant_without_mtp)
    assert recover_stale(quant_without_mtp, ("add-mtp",))
    assert digests(quant_without_mtp) == before and leftovers(quant_without_mtp) == []
    capsys.readouterr()
    assert main(["add-mtp", str(src), str(quant_without_mtp)]) == 0
    assert main(["inspect", str(quant_without_mtp)]) == 0


def test_a_full_disk_or_an_unwritable_place_is_one_line_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    import errno

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    refused(capsys, "quantize", src, blocker / "out", needle="cannot write there")
    real = Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name == "config.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "out"
    refused(capsys, "quantize", src, out, needle="No space left on device")
    assert not out.exists() and leftovers(out) == []
