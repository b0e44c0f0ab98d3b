"""Which directory a command may write, and which one ``--force`` may replace.

OUT is never the input or a directory above it (SRC, an assistant, the working directory), never
inside SRC, and ``--force`` replaces only what this package wrote: a directory holding its marker
(``MARKER``, written into every output), an empty one, or a checkpoint of an earlier release whose
every file is one a quantizer writes.  Anything else is refused, naming a file it did not write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import __version__
from ..errors import MTPError

MARKER = ".omlx-mtp-output.json"
# What a checkpoint written by ``omlx-mtp quantize`` holds besides the marker (earlier releases
# wrote no marker): weights, index, config and the side files copied from SRC.
WRITTEN_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".tiktoken", ".txt")


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_output(out: Path, force: bool, inputs: dict[str, Path | None]) -> None:
    """Refuse an OUT that would overwrite or remove what the user has; ``inputs``: name -> path."""
    resolved = out.resolve()
    guarded = {**inputs, "the working directory": Path.cwd()}
    for name, path in guarded.items():
        if path is not None and _inside(path.resolve(), resolved):
            what = "is" if path.resolve() == resolved else "contains"
            raise MTPError(f"{out}: OUT {what} {name} ({path}); choose another OUT (nothing was written)")
    src = inputs.get("SRC")
    if src is not None and _inside(resolved, src.resolve()):
        raise MTPError(f"{out}: OUT is inside SRC ({src}); SRC is never modified: choose another OUT")
    if not os.path.lexists(out):
        return
    if not force:
        raise MTPError(f"{out} exists (pass --force to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise MTPError(f"{out} exists and is not a directory omlx-mtp wrote; --force replaces only those")
    stranger = _not_written_here(out)
    if stranger is not None:
        raise MTPError(f"{out} holds {stranger}, which omlx-mtp did not write; --force replaces only a directory "
                       "omlx-mtp wrote (remove it yourself, or choose another OUT)")


def _not_written_here(directory: Path) -> str | None:
    """A file of ``directory`` this package did not write, or None when it wrote them all."""
    marker = directory / MARKER
    if marker.is_file():
        try:
            listed = set(json.loads(marker.read_text()).get("files", []))
        except (ValueError, OSError, AttributeError):
            listed = None
        if listed is not None:
            extra = sorted(p for p in _files(directory) if p != MARKER and p not in listed)
            return extra[0] if extra else None
    files = _files(directory)
    if not files:
        return None
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        return f"{sorted(files)[0]} (and no checkpoint)"
    odd = sorted(f for f in files if not f.endswith(WRITTEN_SUFFIXES) or f.startswith("."))
    return odd[0] if odd else None


def _files(directory: Path) -> list[str]:
    return [str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir() or p.is_symlink()]


def write_marker(directory: Path, command: str) -> None:
    """Record in an output what this package wrote there, so that ``--force`` may later replace it."""
    files = sorted(_files(directory))
    (directory / MARKER).write_text(json.dumps({"written_by": f"omlx-mtp {__version__} {command}", "files": files},
                                               indent=2))
