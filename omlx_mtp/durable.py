"""What makes a rename survive a power cut: the directory that holds it synced to disk.  Shared by
the checkpoint writers (``checkpoint.staging``) and the oMLX patcher (``hosts.omlx.atomic``)."""

from __future__ import annotations

import os
from pathlib import Path


def sync_directory(directory: Path) -> None:
    """fsync a directory, so that the renames made in it are on disk; where the file system cannot
    sync a directory (or it cannot be opened), the renames stand anyway."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
