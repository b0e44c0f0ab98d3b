"""What a non-editable install ships: every subpackage and the embedded checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed():
    listed = set(_setuptools()["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "omlx_mtp").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


def test_embedded_checkpoints_are_package_data():
    globs = _setuptools()["package-data"]["omlx_mtp"]
    for directory in ("demo_pair/target", "demo_pair/assistant", "demo_qwen"):
        files = [p for p in (ROOT / "omlx_mtp" / directory).iterdir() if p.is_file()]
        assert files and all(any(p.relative_to(ROOT / "omlx_mtp").match(g) for g in globs) for p in files), directory
