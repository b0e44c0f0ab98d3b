"""``omlx-mtp patch`` all or nothing: a file that cannot be written leaves the oMLX tree as it was, and
a tree a killed run left half-patched is recognised file by file (``check`` says so, ``revert``
restores the release, ``apply`` completes it).

Runs when OMLX_SRC points at an oMLX tree this package serves (read-only: every test works on a copy).  Trees are
compared by hashing every file in them (so a temporary or journal left behind counts too)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from omlx_mtp.errors import MTPError
from omlx_mtp.hosts.omlx import atomic
from omlx_mtp.hosts.omlx.patcher import _git_apply, files_of, patches_for, patches_root, run
from omlx_mtp.tools.cli import main

from .test_omlx_patch import HOST, SOURCE, only_on

pytestmark = pytest.mark.skipif(HOST is None, reason="OMLX_SRC does not point at an oMLX tree")

# The files the host's patches touch, in the order they are replaced.
FILES = list(dict.fromkeys(rel for patch in patches_for(HOST) for rel in files_of(patch))) if HOST else []
ROUTES = "omlx/admin/routes.py"  # the last file the patches touch, so the others are replaced first
NOBODY = 65534


def copy_tree(dest: Path) -> Path:
    shutil.copytree(SOURCE, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
    return dest


def hashes(root: Path) -> dict:
    """Every file (and directory) under root -> (sha256, permission bits)."""
    seen = {}
    for path in sorted(root.rglob("*")):
        data = b"<dir>" if path.is_dir() else path.read_bytes()
        seen[str(path.relative_to(root))] = (hashlib.sha256(data).hexdigest(), path.lstat().st_mode & 0o7777)
    return seen


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return hashes(copy_tree(tmp_path_factory.mktemp("release") / "omlx-tree"))


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    tree = copy_tree(tmp_path_factory.mktemp("applied") / "omlx-tree")
    run("apply", tree)
    return hashes(tree)


@pytest.fixture
def tree(tmp_path):
    return copy_tree(tmp_path / "omlx-tree")


def cli(tree: Path, action: str, prelude: str = "", **kwargs) -> subprocess.CompletedProcess:
    """``omlx-mtp patch ACTION --omlx TREE`` in a fresh interpreter, after running prelude."""
    program = ("import os, signal, sys\nfrom omlx_mtp.tools.cli import main\n"
               "import omlx_mtp.hosts.omlx.patcher  # imported before the prelude (it may drop privileges)\n"
               f"{prelude}\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", program, "patch", action, "--omlx", str(tree)],
                          capture_output=True, text=True, timeout=120, **kwargs)


def killed(tree: Path, action: str, renames: int) -> subprocess.CompletedProcess:
    """A run SIGKILLed as it is about to rename its (renames + 1)th file into place."""
    prelude = f"""
renamed, real_replace = 0, os.replace
def replace(src, dst, *args, **kwargs):
    global renamed
    if str(dst).endswith(".py"):
        if renamed == {renames}:
            os.kill(os.getpid(), signal.SIGKILL)
        renamed += 1
    return real_replace(src, dst, *args, **kwargs)
os.replace = replace
"""
    proc = cli(tree, action, prelude)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def patch(action: str, tree: Path, capsys) -> tuple[int, str, str]:
    code = main(["patch", action, "--omlx", str(tree)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- a file that cannot be written -------------------------------------------------------------------

@pytest.fixture
def shared_tree():
    """A copy in a directory another user can reach (pytest's own temporary directory is private)."""
    base = Path(tempfile.mkdtemp(prefix="omlx-mtp-atomic-"))
    os.chmod(base, 0o755)
    yield copy_tree(base / "omlx-tree")
    shutil.rmtree(base)


@pytest.mark.parametrize("block", ["read-only directory", "sticky directory"])
def test_unwritable_file_leaves_the_tree_as_it_was(shared_tree, block, release, applied):
    """omlx/admin/ (routes.py's directory) read-only: no temporary can be made beside routes.py, so the
    run stops before renaming anything.  Sticky and foreign-owned, with routes.py foreign-owned: the
    temporary is made but renaming it over routes.py is refused, after the other five files were
    replaced, which are put back.  Root ignores both, so as root the run is made as nobody."""
    tree, admin = shared_tree, shared_tree / "omlx" / "admin"
    as_root = os.geteuid() == 0
    if as_root:
        for path in [tree, *tree.rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)
        os.chown(admin, 0, 0)
        if block == "sticky directory":
            os.chown(admin / "routes.py", 0, 0)
    elif block == "sticky directory":
        pytest.skip("needs root, to own routes.py and its directory as another user")
    os.chmod(admin, 0o555 if block == "read-only directory" else 0o1777)
    before = hashes(tree)
    drop = f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})" if as_root else ""
    proc = cli(tree, "apply", drop, cwd=tree.parent, env={**os.environ, "HOME": str(tree.parent)})
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    error = proc.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("omlx-mtp: error: "), proc.stderr
    reason = "Permission denied" if block == "read-only directory" else "Operation not permitted"
    assert ROUTES in error[0] and reason in error[0] and "nothing was changed" in error[0], error[0]
    assert hashes(tree) == before
    os.chmod(admin, 0o755)
    assert run("apply", tree).startswith("applied ")
    assert hashes(tree) == applied


@pytest.mark.parametrize("failure", [PermissionError(13, "Permission denied"), KeyboardInterrupt()])
@pytest.mark.parametrize("action", ["apply", "revert"])
def test_failed_rename_puts_back_the_files_already_replaced(tree, monkeypatch, failure, action, release):
    """The third rename fails (or Ctrl-C lands there): the two files already replaced are put back."""
    if action == "revert":
        run("apply", tree)
    before = hashes(tree)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise failure
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(MTPError if isinstance(failure, OSError) else KeyboardInterrupt) as raised:
        run(action, tree)
    if isinstance(failure, OSError):
        assert str(raised.value).count("\n") == 0 and f"{FILES[2]}: Permission denied" in str(raised.value)
        assert "nothing was changed" in str(raised.value)
    assert len(calls) == 5  # three renames tried, two put back
    assert hashes(tree) == before
    monkeypatch.undo()
    run(action, tree)
    if action == "revert":
        assert hashes(tree) == release


# --- a run killed halfway ----------------------------------------------------------------------------

@pytest.mark.parametrize("renames, keep_journal", [(1, True), (2, False), (-1, False)])
def test_killed_apply_is_recognised_reverted_and_completed(tree, renames, keep_journal, release, applied, capsys):
    renames %= len(FILES)  # -1: all but the last file
    killed(tree, "apply", renames)
    if not keep_journal:  # what the files say on their own is enough
        atomic.journal_path(tree).unlink()
    mixed = hashes(tree)
    assert mixed != release and mixed != applied
    code, out, _ = patch("check", tree, capsys)
    assert code == 0 and "half-applied" in out, out
    assert "`omlx-mtp patch revert` restores the release, `omlx-mtp patch apply` completes it" in out
    assert hashes(tree) == mixed  # check only looks
    assert patch("revert", tree, capsys)[0] == 0
    assert hashes(tree) == release  # temporaries and journal gone too

    killed(tree, "apply", renames - 1)
    assert patch("apply", tree, capsys)[0] == 0
    assert hashes(tree) == applied
    assert patch("apply", tree, capsys)[1].startswith("already applied")
    assert hashes(tree) == applied


def test_killed_before_or_after_renaming_and_killed_revert(tree, release, applied, capsys):
    killed(tree, "apply", 0)  # every temporary written, nothing renamed yet
    code, out, _ = patch("revert", tree, capsys)
    assert code == 0 and "nothing to revert" in out
    assert hashes(tree) == release
    killed(tree, "apply", 0)
    assert patch("apply", tree, capsys)[0] == 0
    assert hashes(tree) == applied

    killed(tree, "revert", 3)
    code, out, _ = patch("check", tree, capsys)
    assert code == 0 and "half-applied, an interrupted `omlx-mtp patch revert`" in out, out
    assert patch("apply", tree, capsys)[0] == 0
    assert hashes(tree) == applied
    killed(tree, "revert", 2)
    assert patch("revert", tree, capsys)[0] == 0
    assert hashes(tree) == release


@only_on("0.3.8")
def test_killed_upgrade_from_0_1_0(tree, release, applied, capsys):
    """A killed upgrade leaves files with 0.1.0's call sites and files with the current ones."""
    old = sorted((patches_root() / "omlx-0.3.8" / "superseded" / "0.1.0").glob("*.patch"))
    for finish in ("revert", "apply"):
        assert _git_apply(tree, old).returncode == 0
        killed(tree, "apply", 2)
        assert "omlx_mtp.host.omlx" in (tree / "omlx" / "engine_pool.py").read_text()  # not reached yet
        assert "omlx_mtp.host.omlx" not in (tree / "omlx" / "oq.py").read_text()  # upgraded
        code, out, _ = patch("check", tree, capsys)
        assert code == 0 and "patched by omlx-mtp 0.1.0" in out and "half-upgraded" in out, out
        if finish == "revert":  # without the journal the files still say what they are
            atomic.journal_path(tree).unlink()
            code, out, _ = patch("check", tree, capsys)
            assert code == 0 and "patched by omlx-mtp 0.1.0" in out and "`omlx-mtp patch apply` upgrades it" in out
        assert patch(finish, tree, capsys)[0] == 0
        assert hashes(tree) == (release if finish == "revert" else applied)
        if finish == "apply":
            assert patch("revert", tree, capsys)[0] == 0
            assert hashes(tree) == release


# --- a patched file the user edited ------------------------------------------------------------------

EDITED = "omlx/engine_pool.py"
CALL_SITE = "engine_built(engine, model_id, entry.model_path)"


def edit_call_site(tree: Path) -> None:
    path = tree / EDITED
    assert path.read_text().count(CALL_SITE) == 1
    path.write_text(path.read_text().replace(CALL_SITE, "engine_built(engine, model_id, None)"))


def refused_untouched(tree: Path, capsys) -> None:
    before = hashes(tree)
    for action in ("check", "apply", "revert"):
        code, out, err = patch(action, tree, capsys)
        assert code == 2 and out == "" and err.count("\n") == 1, (action, out, err)
        assert "files differ from the release where the patches go" in err and "nothing was changed" in err, err
        assert f"patch failed: {EDITED}:" in err  # git's complaint about the edited file, and only that one
        assert err.count("patch failed") == 1 and "vlm.py" not in err and "scheduler.py" not in err, err
    assert hashes(tree) == before


def test_edited_patched_line_refused_untouched(tree, capsys):
    run("apply", tree)
    edit_call_site(tree)
    refused_untouched(tree, capsys)


def test_edited_patched_line_in_a_half_applied_tree_refused_untouched(tree, release, capsys):
    killed(tree, "apply", FILES.index(EDITED) + 1)  # engine_pool.py patched, routes.py (the last) not
    edit_call_site(tree)
    refused_untouched(tree, capsys)
    path = tree / EDITED  # the user puts the line back: revert now repairs the tree
    path.write_text(path.read_text().replace("engine_built(engine, model_id, None)", CALL_SITE))
    assert patch("revert", tree, capsys)[0] == 0
    assert hashes(tree) == release
