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

    from omlx_mtp.hosts.omlx.patcher import patch_sets, patches_for

    for release in patch_sets():
        found = 0
        for patch in patches_for(release):
            for module, names in re.findall(r"^\+\s*from (omlx_mtp[\w.]*) import (\w+)", patch.read_text(), re.M):
                found += 1
                imported = importlib.import_module(module)
                assert hasattr(imported, names) or importlib.util.find_spec(f"{module}.{names}"), (patch.name, module, names)
        assert found >= 5, release


def test_each_patch_set_ships_with_the_releases_it_serves():
    """The patch sets and their ``releases`` lists are package data: a wheel that left a list out
    would refuse releases the set was tried on."""
    from omlx_mtp.hosts.omlx.patcher import patch_sets

    globs = _setuptools()["package-data"]["omlx_mtp.patches"]
    sets = patch_sets()
    assert {"0.3.8", "0.6.2"} <= set(sets) and {"0.5.4", "0.6.1"} <= set(sets["0.6.2"])
    for path in (ROOT / "patches").rglob("*"):
        if path.is_file() and path.suffix not in (".py", ".pyc"):
            assert any(path.relative_to(ROOT / "patches").match(g) for g in globs), path
