"""oMLX 0.3.8 integration: the patches, and oMLX's own oQ quantizer keeping MTP tensors.

Runs when OMLX_SRC points at an oMLX 0.3.8 tree (read-only: every test works on a copy)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omlx_mtp.cli import main
from omlx_mtp.errors import MTPError
from omlx_mtp.patcher import run

SOURCE = os.environ.get("OMLX_SRC")
pytestmark = pytest.mark.skipif(not SOURCE or not (Path(SOURCE) / "omlx" / "_version.py").is_file(),
                                reason="OMLX_SRC does not point at an oMLX 0.3.8 tree")


import mlx_lm  # noqa: E402

# oMLX 0.3.8 itself imports only with its pinned mlx-lm 0.31.x (newer mlx-lm lacks SequenceStateMachine).
runs_omlx = pytest.mark.skipif(not mlx_lm.__version__.startswith("0.31."),
                               reason=f"oMLX 0.3.8 needs mlx-lm 0.31.x, this is {mlx_lm.__version__}")


@pytest.fixture
def tree(tmp_path):
    copy = tmp_path / "omlx-tree"
    shutil.copytree(SOURCE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
    return copy


def snapshot(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def test_apply_is_idempotent_and_revert_byte_identical(tree, capsys):
    before = snapshot(tree)
    assert main(["patch", "check", "--omlx", str(tree)]) == 0
    assert "not applied" in capsys.readouterr().out
    assert main(["patch", "apply", "--omlx", str(tree)]) == 0
    patched = snapshot(tree)
    assert patched != before
    assert main(["patch", "apply", "--omlx", str(tree)]) == 0
    assert "already applied" in capsys.readouterr().out
    assert snapshot(tree) == patched
    assert main(["patch", "revert", "--omlx", str(tree)]) == 0
    assert snapshot(tree) == before


def test_other_version_refused_untouched(tree, capsys):
    (tree / "omlx" / "_version.py").write_text('__version__ = "0.3.9"\n')
    before = snapshot(tree)
    assert main(["patch", "apply", "--omlx", str(tree)]) == 2
    assert "oMLX 0.3.9 is not supported" in capsys.readouterr().err
    assert snapshot(tree) == before


def test_modified_tree_refused_untouched(tree):
    oq = tree / "omlx" / "oq.py"
    oq.write_text(oq.read_text().replace('    cb("loading", 12.0)\n', '    cb("loading", 13.0)\n'))
    before = snapshot(tree)
    with pytest.raises(MTPError, match="nothing was changed"):
        run("apply", tree)
    assert snapshot(tree) == before


def _python(tree: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600)


@runs_omlx
def test_omlx_own_oq_tests_pass_on_patched_tree(tree):
    run("apply", tree)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_oq.py"],
                          cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    print(proc.stdout.strip().splitlines()[-1])


@runs_omlx
@pytest.mark.parametrize("plugin", [True, False])
def test_oq_keeps_mtp_only_with_plugin(tree, tmp_path, plugin):
    from .test_quantize import qwen35_checkpoint

    run("apply", tree)
    src, _ = qwen35_checkpoint(tmp_path / "qwen")
    out = tmp_path / "oq4"
    block = "" if plugin else "import sys; sys.modules['omlx_mtp'] = None  # omlx-mtp not installed"
    proc = _python(tree, f"""
        {block}
        import mlx.core as mx
        from pathlib import Path
        from omlx.oq import quantize_oq_streaming
        quantize_oq_streaming({str(src)!r}, {str(out)!r}, 4, group_size=32)
        names = set()
        for f in Path({str(out)!r}).glob("*.safetensors"):
            names |= set(mx.load(str(f)))
        print(sorted(n for n in names if n.startswith("mtp.")))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = eval(proc.stdout.strip().splitlines()[-1])
    if plugin:
        assert kept == ["mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight",
                        "mtp.layers.0.self_attn.q_proj.weight", "mtp.norm.weight"]  # kept, unquantized
    else:
        assert kept == []
