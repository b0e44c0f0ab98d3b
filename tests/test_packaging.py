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
    globs = _setuptools()["package-data"]["omlx_mtp.fixtures"]
    fixtures = ROOT / "omlx_mtp" / "fixtures"
    for directory in ("demo_pair/target", "demo_pair/assistant", "demo_qwen", "demo_glm"):
        files = [p for p in (fixtures / directory).iterdir() if p.is_file()]
        assert files and all(any(p.relative_to(fixtures).match(g) for g in globs) for p in files), directory


def test_call_sites_import_what_the_package_has():
    """Every module and name the patches import exists (a moved module would make oMLX decode
    plainly without a word: the call sites catch ImportError)."""
    import importlib
    import re

    from omlx_mtp.hosts.omlx.patcher import patches_for

    found = 0
    for patch in patches_for("0.3.8"):
        for module, names in re.findall(r"^\+\s*from (omlx_mtp[\w.]*) import (\w+)", patch.read_text(), re.M):
            found += 1
            imported = importlib.import_module(module)
            assert hasattr(imported, names) or importlib.util.find_spec(f"{module}.{names}"), (patch.name, module, names)
    assert found >= 5
