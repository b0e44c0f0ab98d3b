"""``omlx-mtp patch {apply,check,revert}``: add (or remove) the hook call sites in an oMLX tree.

The patches in ``patches/omlx-<version>/`` are applied with ``git apply`` as a plain patch tool:
every hunk of every patch is checked first and all of them land or none does; applying twice
changes nothing; reverting restores the files byte for byte.  Another oMLX version, or a tree
whose patched lines were edited, is refused without touching anything.  A tree patched by an
earlier omlx-mtp whose call sites imported other module paths (kept in ``superseded/<release>/``) is
upgraded by ``apply``: those patches are reverted and the current ones applied, or the tree is put
back as it was.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from ...errors import MTPError


def patches_root() -> Path:
    """``patches/`` of the source tree, installed as the ``omlx_mtp.patches`` package."""
    spec = importlib.util.find_spec("omlx_mtp.patches")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return Path(__file__).resolve().parents[3] / "patches"


def find_omlx(path: str | Path | None) -> Path:
    """The directory that holds the ``omlx`` package (the tree root for a checkout)."""
    if path is None:
        spec = importlib.util.find_spec("omlx")
        if spec is None or not spec.submodule_search_locations:
            raise MTPError("no importable omlx package here; pass --omlx PATH (the directory holding omlx/)")
        return Path(list(spec.submodule_search_locations)[0]).parent
    path = Path(path)
    if (path / "omlx" / "_version.py").is_file():
        return path
    if (path / "_version.py").is_file() and path.name == "omlx":
        return path.parent
    raise MTPError(f"{path}: not an oMLX tree (no omlx/_version.py)")


def omlx_version(root: Path) -> str:
    match = re.search(r'__version__\s*=\s*["\']([^"\']+)["\']', (root / "omlx" / "_version.py").read_text())
    if not match:
        raise MTPError(f"{root / 'omlx' / '_version.py'}: no __version__")
    return match.group(1)


def patches_for(version: str) -> list[Path]:
    directory = patches_root() / f"omlx-{version}"
    found = sorted(directory.glob("*.patch"))
    if not found:
        known = sorted(p.name.removeprefix("omlx-") for p in patches_root().glob("omlx-*") if p.is_dir())
        raise MTPError(f"oMLX {version} is not supported by this omlx-mtp (patches exist for: {', '.join(known)})")
    return found


def _git_apply(root: Path, patches: list[Path], *flags: str) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        raise MTPError("git is needed to apply patches (used as a plain patch tool); install git")
    # Stop git from treating an enclosing repository as the place the patch paths are relative to.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve().parent)}
    return subprocess.run([git, "apply", *flags, *map(str, patches)], cwd=root, env=env, capture_output=True, text=True)


def states(root: Path) -> dict[Path, str]:
    """Each patch for the oMLX tree at root -> "applied" | "clean" | "conflict", checked on its own, so
    a tree patched by an earlier omlx-mtp (fewer patches) shows which ones it still lacks."""
    return {patch: _one_state(root, patch) for patch in patches_for(omlx_version(root))}


def _one_state(root: Path, patch: Path) -> str:
    if _git_apply(root, [patch], "--check", "-R").returncode == 0:
        return "applied"
    if _git_apply(root, [patch], "--check").returncode == 0:
        return "clean"
    return "conflict"


def _conflict(root: Path, bad: list[Path]) -> MTPError:
    detail = _git_apply(root, bad[:1], "--check").stderr.strip().splitlines()
    return MTPError(f"{root}: the oMLX {omlx_version(root)} files differ from the release where the patches go "
                    f"({detail[0] if detail else 'hunks do not apply'}); nothing was changed")


def superseded(root: Path) -> tuple[str, list[Path]] | None:
    """(release, patches) of an earlier omlx-mtp whose own patches are applied to the tree at root:
    those that differ from the current set (an unchanged one is the current one's state)."""
    directory = patches_root() / f"omlx-{omlx_version(root)}"
    for release in sorted((directory / "superseded").glob("*"), reverse=True):
        distinct = [p for p in sorted(release.glob("*.patch"))
                    if not (directory / p.name).is_file() or (directory / p.name).read_bytes() != p.read_bytes()]
        applied = [p for p in distinct if _one_state(root, p) == "applied"]
        if applied:
            return release.name, applied
    return None


def run(action: str, path=None) -> str:
    root = find_omlx(path)
    older = superseded(root)
    if older is not None and action == "check":
        return (f"oMLX {omlx_version(root)} at {root}: patched by omlx-mtp {older[0]} "
                f"({', '.join(p.name for p in older[1])}); `omlx-mtp patch apply` upgrades it")
    if older is not None and action in ("apply", "revert"):
        release, old_patches = older
        result = _git_apply(root, old_patches, "-R")
        if result.returncode != 0:
            raise MTPError(f"{root}: could not revert omlx-mtp {release}'s patches: {result.stderr.strip()}")
        try:
            message = run(action, root)
        except MTPError:
            _git_apply(root, old_patches)  # put the earlier release's call sites back as they were
            raise
        return f"took off omlx-mtp {release}'s patches; {message}"
    current = states(root)
    by_state = {kind: [p for p, s in current.items() if s == kind] for kind in ("applied", "clean", "conflict")}
    if by_state["conflict"]:
        raise _conflict(root, by_state["conflict"])
    applied, clean = by_state["applied"], by_state["clean"]
    if action == "check":
        listed = ", ".join(f"{p.name} ({'applied' if s == 'applied' else 'not applied'})" for p, s in current.items())
        return f"oMLX {omlx_version(root)} at {root}: {listed}"
    if action == "apply":
        if not clean:
            return f"already applied to {root}"
        todo, result = clean, _git_apply(root, clean)
    elif action == "revert":
        if not applied:
            return f"not applied to {root}; nothing to revert"
        todo, result = applied, _git_apply(root, applied, "-R")
    else:
        raise MTPError(f"unknown patch action {action!r}")
    if result.returncode != 0:
        raise MTPError(f"{root}: git apply failed: {result.stderr.strip()}")
    return f"{'applied' if action == 'apply' else 'reverted'} {', '.join(p.name for p in todo)} in {root}"
