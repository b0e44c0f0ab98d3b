"""``omlx-mtp patch {apply,check,revert}``: add (or remove) the hook call sites in an oMLX tree.

The patches in ``patches/omlx-<version>/`` are applied with ``git apply`` as a plain patch tool,
file by file: each file a patch touches is worked out in a scratch copy (its release content, with
whatever patches it carries taken off, and its patched content), and only then are the files that
change replaced, all or nothing (``atomic.replace_all``): a file that cannot be written leaves the
tree as it was.  Applying twice changes nothing; reverting restores the files byte for byte.

Each file is judged on its own: as released, patched, partly patched (an earlier omlx-mtp with
fewer patches), patched by an earlier omlx-mtp whose call sites imported other module paths (kept
in ``superseded/<release>/``; ``apply`` upgrades it), or edited where the patches go (refused,
named, nothing touched).  So a tree an interrupted run left with some files patched and others not
is recognised: ``check`` calls it half-applied, ``revert`` restores the release, ``apply``
completes it.  Another oMLX version is refused without touching anything.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...errors import MTPError
from . import atomic


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


RELEASES_FILE = "releases"  # beside a set's patches: the oMLX releases it serves, one a line


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in re.split(r"[.+-]", version))


def patch_sets() -> dict[str, list[str]]:
    """Each patch set (``patches/omlx-<name>/``) -> the oMLX releases it was tried on and serves:
    its own release and those listed in its ``releases`` file (their call sites are where the
    set's patches go, and they served with them); newest set first."""
    sets = {}
    for directory in patches_root().glob("omlx-*"):
        if not directory.is_dir() or not any(directory.glob("*.patch")):
            continue
        name = directory.name.removeprefix("omlx-")
        listed = directory / RELEASES_FILE
        others = listed.read_text().split() if listed.is_file() else []
        sets[name] = sorted({name, *others}, key=_version_key)
    return dict(sorted(sets.items(), key=lambda item: _version_key(item[0]), reverse=True))


def set_for(version: str) -> str | None:
    """The patch set that serves this oMLX release, or None."""
    return next((name for name, releases in patch_sets().items() if version in releases), None)


def not_supported(version: str) -> str:
    releases = "; ".join(", ".join(listed) for listed in patch_sets().values())
    return f"oMLX {version} is not supported by this omlx-mtp (it serves oMLX {releases})"


def patches_for(version: str) -> list[Path]:
    name = set_for(version)
    if name is None:
        raise MTPError(not_supported(version))
    return sorted((patches_root() / f"omlx-{name}").glob("*.patch"))


def older_sets(version: str) -> dict[str, list[Path]]:
    """Release of an earlier omlx-mtp -> its patches for this oMLX version, newest release first."""
    name = set_for(version) or version
    directory = patches_root() / f"omlx-{name}" / "superseded"
    return {d.name: sorted(d.glob("*.patch")) for d in sorted(directory.glob("*"), reverse=True) if d.is_dir()}


def moved_call_site(root: Path, version: str) -> str:
    """For a release no set serves: where the set that fits it furthest stops fitting (the patch,
    and git's file:line), worked out in a scratch copy; "" where some set fits whole."""
    best = (-1, "")
    for name in patch_sets():  # newest first, so a tie names the newer set
        fitted, moved = _fit(root, patches_for(name))
        if not moved:
            return ""
        if fitted > best[0]:
            best = (fitted, f"the omlx-{name} set's {moved}")
    return best[1]


def _fit(root: Path, stack: list[Path]) -> tuple[int, str]:
    """How many of stack's patches apply in order to a scratch copy of root's files, and where the
    next one stops fitting ("" when all do)."""
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-patch-") as scratch:
        for rel in dict.fromkeys(rel for patch in stack for rel in files_of(patch)):
            path = root / rel
            _put(Path(scratch), rel, path.read_bytes() if path.is_file() else None)
        for fitted, patch in enumerate(stack):
            result = _git_apply(Path(scratch), [patch])
            if result.returncode != 0:
                where = re.findall(r"patch failed: (\S+)", result.stderr)
                return fitted, f"{patch.name} does not fit {where[0] if where else 'its files'}"
    return len(stack), ""


def _git_apply(root: Path, patches: list[Path], *flags: str) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        raise MTPError("git is needed to apply patches (used as a plain patch tool); install git")
    # Stop git from treating an enclosing repository as the place the patch paths are relative to.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.resolve().parent)}
    return subprocess.run([git, "apply", *flags, *map(str, patches)], cwd=root, env=env, capture_output=True, text=True)


@lru_cache(maxsize=None)
def files_of(patch: Path) -> tuple[str, ...]:
    """The paths a patch touches, in its order (``git apply --numstat`` reads the patch, not a tree)."""
    result = _git_apply(patch.parent, [patch], "--numstat", "-z")
    if result.returncode != 0:
        raise MTPError(f"{patch}: not a patch git can read: {result.stderr.strip()}")
    paths = [entry.split("\t", 2)[2] for entry in result.stdout.split("\0") if entry.count("\t") >= 2]
    if any(not p for p in paths):  # -z gives a rename's two paths as separate fields after an empty one
        raise MTPError(f"{patch}: renames and copies are not supported in omlx-mtp's patches")
    return tuple(paths)


# --- one file, worked out in a scratch directory (the tree is only read) --------------------------

def _only(rel: str) -> str:
    return "--include=" + re.sub(r"([*?\[\\])", r"\\\1", rel)  # the path itself, not a pattern


def _put(scratch: Path, rel: str, data: bytes | None) -> None:
    path = scratch / rel
    if data is None:
        path.unlink(missing_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _get(scratch: Path, rel: str) -> bytes | None:
    path = scratch / rel
    return path.read_bytes() if path.exists() else None


def _scratch_failed(rel: str, result: subprocess.CompletedProcess) -> MTPError:
    return MTPError(f"git apply could not write its scratch copy of {rel} ({tempfile.gettempdir()}): "
                    f"{result.stderr.strip()}")


def _peel(scratch: Path, rel: str, stack: list[Path]) -> list[Path]:
    """Take off, last first, each patch of stack that the file carries; the ones taken off."""
    peeled = []
    for patch in reversed(stack):
        if _git_apply(scratch, [patch], _only(rel), "--check", "-R").returncode == 0:
            result = _git_apply(scratch, [patch], _only(rel), "-R")
            if result.returncode != 0:
                raise _scratch_failed(rel, result)
            peeled.append(patch)
    return peeled


def _forward(scratch: Path, rel: str, stack: list[Path]) -> str | None:
    """Apply stack in order; None, or git's first complaint where a patch does not fit."""
    for patch in stack:
        result = _git_apply(scratch, [patch], _only(rel))
        if result.returncode != 0:
            if _git_apply(scratch, [patch], _only(rel), "--check").returncode == 0:
                raise _scratch_failed(rel, result)
            lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
            return f"{patch.name}: {lines[0] if lines else f'{rel} does not fit'}"
    return None


@dataclass
class FileState:
    rel: str
    kind: str  # "release" | "patched" | "partial" | "superseded" | "other"
    current: bytes | None
    release: bytes | None = None  # the file as released (with the user's edits elsewhere kept)
    patched: bytes | None = None  # ... with every current patch applied
    applied: tuple[Path, ...] = ()  # current patches it carries
    older: str | None = None  # the earlier omlx-mtp whose call sites it carries
    detail: str = ""  # why it is "other"


def _explain(scratch: Path, rel: str, current: bytes | None, mine: list[Path],
             older: dict[str, list[Path]]) -> FileState:
    _put(scratch, rel, current)
    peeled = _peel(scratch, rel, mine)
    release = _get(scratch, rel)
    error = _forward(scratch, rel, mine)
    patched = _get(scratch, rel)
    if mine and error is None and patched == current:
        return FileState(rel, "patched", current, release, patched, tuple(mine))
    for name, stack in older.items():  # carrying an earlier omlx-mtp's patches, all of them?
        _put(scratch, rel, current)
        if not stack or not _peel(scratch, rel, stack):
            continue
        old_release = _get(scratch, rel)
        if _forward(scratch, rel, stack) is not None or _get(scratch, rel) != current:
            continue
        _put(scratch, rel, old_release)
        if _forward(scratch, rel, mine) is None:
            return FileState(rel, "superseded", current, old_release, _get(scratch, rel), older=name)
    if error is not None:
        return FileState(rel, "other", current, detail=error)
    return FileState(rel, "partial" if peeled else "release", current, release, patched, tuple(peeled))


# --- the whole tree ---------------------------------------------------------------------------------

@dataclass
class Survey:
    root: Path
    version: str
    patches: list[Path]
    older: dict[str, list[Path]]
    files: dict[str, FileState]

    def patch_state(self, patch: Path) -> str:
        """"applied" | "clean" | "half" (on some of its files: an interrupted run) | "conflict" |
        "superseded" (an earlier omlx-mtp's form of it is on some of its files)."""
        files = [self.files[rel] for rel in files_of(patch)]
        if any(f.kind == "other" for f in files):
            return "conflict"
        if any(f.kind == "superseded" for f in files):
            return "superseded"
        carried = [f.kind == "patched" or patch in f.applied for f in files]
        return "applied" if all(carried) else "half" if any(carried) else "clean"


def survey(root: Path) -> Survey:
    version = omlx_version(root)
    if set_for(version) is None:
        moved = moved_call_site(root, version)
        raise MTPError(not_supported(version) + (f": {moved}" if moved else ": its call sites fit, but it has not been tried")
                       + "; nothing was changed")
    mine, older = patches_for(version), older_sets(version)
    rels = list(dict.fromkeys(rel for patch in [*mine, *(p for s in older.values() for p in s)]
                              for rel in files_of(patch)))
    files = {}
    with tempfile.TemporaryDirectory(prefix="omlx-mtp-patch-") as scratch:
        for rel in rels:
            path = root / rel
            try:
                current = path.read_bytes() if os.path.lexists(path) else None
            except OSError as exc:
                raise MTPError(f"{root}: cannot read {rel}: {exc.strerror}; nothing was changed") from None
            files[rel] = _explain(Path(scratch), rel, current, [p for p in mine if rel in files_of(p)],
                                  {n: [p for p in s if rel in files_of(p)] for n, s in older.items()})
    return Survey(root, version, mine, older, files)


def states(root: Path) -> dict[Path, str]:
    """Each patch for the oMLX tree at root -> its ``Survey.patch_state``, so a tree
    patched by an earlier omlx-mtp (fewer patches) shows which ones it still lacks."""
    found = survey(root)
    return {patch: found.patch_state(patch) for patch in found.patches}


def _refusal(found: Survey, others: list[FileState]) -> MTPError:
    # Each detail is git's complaint about that file (it names the file): neither released nor patched.
    return MTPError(f"{found.root}: the oMLX {found.version} files differ from the release where the patches go "
                    f"({'; '.join(f.detail for f in others)}); nothing was changed")


def _report(found: Survey, older: list[str], half: bool, note: dict | None) -> str:
    head = f"oMLX {found.version} at {found.root}: "
    if older:
        carrying = {rel for rel, f in found.files.items() if f.older}
        names = sorted({p.name for r in older for p in found.older[r] if carrying & set(files_of(p))})
        text = f"patched by omlx-mtp {', '.join(older)} ({', '.join(names)})"
        if note is not None:
            text += ", half-upgraded by an interrupted `omlx-mtp patch apply`"
        return head + text + "; `omlx-mtp patch apply` upgrades it (`omlx-mtp patch revert` restores the release)"
    if half:
        groups = {"patched": [], "partly patched": [], "as released": []}
        for rel, f in found.files.items():
            groups[{"patched": "patched", "partial": "partly patched"}.get(f.kind, "as released")].append(rel)
        action = (note or {}).get("action")
        run_was = f"`omlx-mtp patch {action}`" if action in ("apply", "revert") else "`omlx-mtp patch` run"
        left = "; ".join(f"{kind}: {', '.join(rels)}" for kind, rels in groups.items() if rels)
        return (head + f"half-applied, an interrupted {run_was} left it so ({left}); "
                "`omlx-mtp patch revert` restores the release, `omlx-mtp patch apply` completes it")
    listed = ", ".join(f"{p.name} ({'applied' if found.patch_state(p) == 'applied' else 'not applied'})"
                       for p in found.patches)
    return head + listed


def run(action: str, path=None) -> str:
    if action not in ("check", "apply", "revert"):
        raise MTPError(f"unknown patch action {action!r}")
    root = find_omlx(path)
    found = survey(root)
    others = [f for f in found.files.values() if f.kind == "other"]
    if others:
        raise _refusal(found, others)
    older = sorted({f.older for f in found.files.values() if f.older}, reverse=True)
    note = atomic.read_journal(root)
    kinds = {f.kind for f in found.files.values()}
    # An interrupted run: a patch on some of its files only, or a journal left beside a mixed tree.
    half = any(found.patch_state(p) == "half" for p in found.patches) or (note is not None and len(kinds) > 1)
    if action == "check":
        return _report(found, older, half, note)
    target = {rel: f.patched if action == "apply" else f.release for rel, f in found.files.items()}
    changes = {rel: data for rel, data in target.items() if data != found.files[rel].current}
    if not changes:
        atomic.tidy(root, found.files)  # what a run killed after its last rename left
        return f"already applied to {root}" if action == "apply" else f"not applied to {root}; nothing to revert"
    atomic.replace_all(root, changes, action, found.files)
    took_off = f"took off omlx-mtp {', '.join(older)}'s patches; " if older else ""
    finished = " (it was half-applied)" if half else ""
    if action == "apply":
        names = [p.name for p in found.patches if found.patch_state(p) != "applied"]
        return took_off + (f"applied {', '.join(names)} in {root}" if names else f"upgraded {root}") + finished
    names = [p.name for p in found.patches if found.patch_state(p) in ("applied", "half")]
    return took_off + (f"reverted {', '.join(names)} in {root}" if names else f"restored {root}") + finished
