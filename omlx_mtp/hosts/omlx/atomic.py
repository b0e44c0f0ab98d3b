"""Replace a set of files in a tree all or nothing (what ``omlx-mtp patch`` writes oMLX's files with).

Every new content is first written to a temporary beside its destination (same directory, so the
rename that follows cannot cross file systems) and fsynced; only then are the temporaries renamed
in, one by one.  A failure at any step puts back the files already replaced (and removes the new
ones), so the tree is as it was.  A process killed while renaming leaves some files old and some
new, each whole: the patcher recognises that per file; the journal written before the first rename
only tells ``check`` that a run was interrupted, and the temporaries left behind have fixed names
that the next run removes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...durable import sync_directory
from ...errors import MTPError

TEMP_SUFFIX = ".omlx-mtp-new"
JOURNAL = ".omlx-mtp-patching.json"  # in the omlx package directory while files are being renamed


def temp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_SUFFIX}")


def journal_path(root: Path) -> Path:
    return root / "omlx" / JOURNAL


def read_journal(root: Path) -> dict | None:
    """What an interrupted run noted before renaming ({"action", "files"}), or None."""
    try:
        note = json.loads(journal_path(root).read_text())
    except (OSError, ValueError):
        return None if not journal_path(root).exists() else {"action": "?", "files": []}
    return note if isinstance(note, dict) else {"action": "?", "files": []}


def _real(root: Path, rel: str) -> Path:
    # Write through a symlinked file to the file itself, not over the link.
    return Path(os.path.realpath(root / rel))


def _unlink(path: Path, root: Path, rel: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise MTPError(f"{root}: cannot remove {path.name} beside {rel}: {exc.strerror}") from None


def tidy(root: Path, rels) -> None:
    """Remove what a killed run left: its temporaries beside ``rels`` and its journal."""
    for rel in rels:
        _unlink(temp_for(_real(root, rel)), root, rel)
    _unlink(journal_path(root), root, JOURNAL)


def _write_temp(dest: Path, data: bytes, like: os.stat_result | None) -> Path:
    temp = temp_for(dest)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, (like.st_mode & 0o7777) if like else 0o644)
        if like is not None:
            try:  # keep the owner when root patches a user's tree; not possible (nor needed) otherwise
                os.fchown(fd, like.st_uid, like.st_gid)
            except OSError:
                pass
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    return temp


def _why(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"


def replace_all(root: Path, changes: dict[str, bytes | None], action: str, touched) -> None:
    """Give each ``rel`` in changes its new content (None: remove the file), all or nothing.
    ``touched``: every file a patch set could touch, whose leftover temporaries are removed first."""
    tidy(root, touched)
    order = list(changes)
    old: dict[str, tuple[bytes, os.stat_result] | None] = {}
    temps: dict[str, Path] = {}
    made_dirs: list[Path] = []

    def drop_temps() -> None:
        for temp in temps.values():
            try:
                os.unlink(temp)
            except OSError:
                pass
        for directory in reversed(made_dirs):
            try:
                os.rmdir(directory)
            except OSError:
                pass

    for rel in order:  # 1: read what is there (to put back) and write every new content beside it
        dest = _real(root, rel)
        try:
            old[rel] = (dest.read_bytes(), os.stat(dest)) if os.path.lexists(dest) else None
            if changes[rel] is not None:
                missing = [p for p in reversed(dest.parents) if not p.exists()]
                for directory in missing:  # a patch that adds a file in a new directory
                    os.mkdir(directory)
                    made_dirs.append(directory)
                temps[rel] = _write_temp(dest, changes[rel], old[rel][1] if old[rel] else None)
        except BaseException as exc:
            drop_temps()
            if not isinstance(exc, OSError):
                raise
            raise MTPError(f"{root}: cannot write {rel}: {_why(exc)}; nothing was changed") from None
    try:
        fd = os.open(journal_path(root), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps({"action": action, "files": order}).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        drop_temps()
        raise MTPError(f"{root}: cannot write {journal_path(root)}: {_why(exc)}; nothing was changed") from None

    done: list[str] = []
    try:  # 2: rename them in (a deletion is an unlink); anything at all going wrong puts back `done`
        for rel in order:
            if changes[rel] is None:
                os.unlink(_real(root, rel))
            else:
                os.replace(temps[rel], _real(root, rel))
                del temps[rel]  # renamed: no longer a temporary to drop
            done.append(rel)
    except BaseException as exc:
        failed = rel
        for back in reversed(done):
            try:
                if old[back] is None:
                    os.unlink(_real(root, back))
                else:
                    os.replace(_write_temp(_real(root, back), old[back][0], old[back][1]), _real(root, back))
            except OSError as undo:
                raise MTPError(f"{root}: cannot replace {failed}: {_why(exc)}; putting back {back} failed too "
                               f"({_why(undo)}): the tree is half-patched, `omlx-mtp patch revert` or `apply` "
                               f"repairs it") from None
        drop_temps()
        _unlink(journal_path(root), root, JOURNAL)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: the tree is back as it was
        raise MTPError(f"{root}: cannot replace {failed}: {_why(exc)}; nothing was changed") from None
    top = Path(os.path.realpath(root))
    for rel in order:  # as git apply does: a directory that a removed file leaves empty goes too
        for directory in _real(root, rel).parents if changes[rel] is None else ():
            try:
                if directory == top or top not in directory.parents:
                    break
                os.rmdir(directory)
            except OSError:
                break
    for directory in {_real(root, rel).parent for rel in order}:
        sync_directory(directory)
    _unlink(journal_path(root), root, JOURNAL)
    sync_directory(journal_path(root).parent)
