"""Writes that never leave a half-written checkpoint: everything is staged in a directory beside
its destination, then renamed into place by ``commit``, which journals its moves first.

A staging directory is named ``.{destination}.{kind}-{pid}-{random}``.  A run that dies (SIGKILL,
power loss) leaves it behind; the next run on the same destination finds it (``recover_stale``:
its process is gone) and either removes it, or, when it died inside ``commit``, first puts every
file back where it was, so the destination is the old state or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..durable import sync_directory
from ..errors import MTPError

JOURNAL = ".commit.json"


def new_staging(destination: Path, kind: str) -> Path:
    """An empty staging directory beside ``destination`` (same file system, so renames are atomic)."""
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{destination.name}.{kind}-{os.getpid()}-", dir=destination.parent))
    except OSError as exc:
        raise MTPError(f"{destination.parent}: cannot write there ({exc.strerror})") from None


def report(message: str) -> None:
    """What a command says about the leftovers it cleaned up: a line on stderr, beside its progress."""
    print(message, file=sys.stderr)


def recover_stale(destination: Path, kinds: tuple[str, ...]) -> list[str]:
    """Undo or remove the staging directories of runs on ``destination`` that died; one message each."""
    messages = []
    for kind in kinds:
        for path in sorted(destination.parent.glob(f".{destination.name}.{kind}-*")):
            pid = path.name[len(f".{destination.name}.{kind}-"):].split("-")[0]
            if not path.is_dir() or (pid.isdigit() and _alive(int(pid))):
                continue  # a run in progress (or a name that is not ours)
            undone = _roll_back(path)
            shutil.rmtree(path, ignore_errors=True)
            what = "put back the files it had replaced and " if undone else ""
            messages.append(f"{path.name}: left by an interrupted run; {what}removed it")
    return messages


def commit(staging: Path, moves: list[tuple[Path, Path]]) -> None:
    """Rename each staged path over its destination, in order.  What was there is kept in the
    staging directory until the end; on an error every move already made is undone.  The plan is
    journalled first, so that a run killed in the middle is undone by the next (``recover_stale``)."""
    plan = [(str(staged), str(final), str(staging / f".previous-{i}")) for i, (staged, final) in enumerate(moves)]
    journal = staging / JOURNAL
    with open(journal, "w") as handle:
        json.dump(plan, handle)
        handle.flush()
        os.fsync(handle.fileno())
    sync_directory(staging)
    try:
        for staged, final, backup in plan:
            if os.path.lexists(final):
                if os.path.isdir(final):
                    os.rename(final, backup)
                else:
                    os.link(final, backup)  # the old file stays in place until the rename replaces it
            os.replace(staged, final)
        sync_directory(Path(plan[-1][1]).parent if plan else staging)
        journal.unlink()
    except BaseException:
        _roll_back(staging)
        raise


def _roll_back(staging: Path) -> bool:
    """Undo a ``commit`` journalled in ``staging`` that did not make all its moves; whether it undid one."""
    try:
        plan = json.loads((staging / JOURNAL).read_text())
    except (OSError, ValueError):
        return False
    if all(not os.path.lexists(staged) for staged, _, _ in plan):
        return False  # every move was made: the new state stands, the staging holds only the old files
    for staged, final, backup in reversed(plan):
        moved = not os.path.lexists(staged)
        if moved and os.path.lexists(final):
            if os.path.lexists(backup):
                _replace(backup, final)
            else:  # it was added: remove it
                shutil.rmtree(final) if os.path.isdir(final) and not os.path.islink(final) else os.unlink(final)
        elif os.path.lexists(backup) and not os.path.lexists(final):
            os.rename(backup, final)  # a directory moved aside, its replacement not yet in
    (staging / JOURNAL).unlink()
    return True


def _replace(source: str, final: str) -> None:
    if os.path.isdir(final) and not os.path.islink(final):
        shutil.rmtree(final)
    os.replace(source, final)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
