"""``omlx-mtp serve``: mlx-lm's own HTTP server (``mlx_lm.server``'s ``main()``, its flags and its
distributed mode under ``mlx.launch``) with this package's MTP decode in place of its
``BatchGenerator`` (``hosts.mlx_lm_server``)."""

from __future__ import annotations

import sys


def serve(model: str, settings: str | None = None, host: str = "127.0.0.1", port: int = 8080,
          extra: list[str] | tuple[str, ...] = ()) -> int:
    """Run mlx-lm's server for ``model`` until it stops; ``extra``: mlx-lm server flags, passed on."""
    import mlx_lm.server as server

    from ..hosts.mlx_lm_server import install

    argv = ["--model", model, "--host", host, "--port", str(port), *extra]
    with install(server, settings_file=settings, served_model=model):
        saved, sys.argv = sys.argv, ["omlx-mtp serve", *argv]  # mlx-lm's main() parses sys.argv
        try:
            server.main()
        finally:
            sys.argv = saved
    return 0
