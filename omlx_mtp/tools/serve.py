"""``omlx-mtp serve``: mlx-lm's own HTTP server (``mlx_lm.server``'s ``main()``, its flags and its
distributed mode under ``mlx.launch``) with this package's MTP decode in place of its
``BatchGenerator`` and its requests checked (``hosts.mlx_lm_server``, ``hosts.server_guards``)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import MTPError


def serve(model: str, settings: str | None = None, host: str = "127.0.0.1", port: int = 8080,
          extra: list[str] | tuple[str, ...] = ()) -> int:
    """Run mlx-lm's server for ``model`` until it stops; ``extra``: mlx-lm server flags, passed on.
    Raises ``MTPError``, before the server listens, where ``model`` can't be loaded."""
    path = Path(model).expanduser()
    # A Hugging Face repo id never starts so: mlx-lm would say the id is malformed.
    if model.startswith(("/", ".", "~")) and not path.is_dir():
        raise MTPError(f"cannot load the model {model}: no such directory")
    import mlx_lm.server as server

    from ..hosts.mlx_lm_server import install

    argv = ["--model", model, "--host", host, "--port", str(port), *extra]
    with install(server, settings_file=settings, served_model=model):
        saved, sys.argv = sys.argv, ["omlx-mtp serve", *argv]  # mlx-lm's main() parses sys.argv
        try:
            server.main()  # loads the model (an MTPError where it can't), then listens
        finally:
            sys.argv = saved
    return 0
