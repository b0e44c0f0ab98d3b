"""Called from the call sites that ``patches/omlx-0.3.8`` adds to oMLX; asks every installed
``omlx`` plugin (omlx-mtp's own and third-party ones) through the pluggy hooks."""

from __future__ import annotations

import logging
from functools import lru_cache

log = logging.getLogger("omlx_mtp.host")


@lru_cache(maxsize=1)
def plugin_manager():
    from .. import get_plugin_manager

    return get_plugin_manager()


def skip_tensor(name: str, config: dict | None = None) -> bool | None:
    """For oq._should_skip_tensor: True drop, False keep, None let oMLX decide."""
    return plugin_manager().hook.omlx_skip_tensor_in_quantization(name=name, config=config or {})


def keep_unquantized(name: str, shape: tuple, config: dict | None = None) -> bool:
    """For oq._should_quantize_tensor: True when a plugin wants the tensor left unquantized."""
    return plugin_manager().hook.omlx_tensor_quantization(name=name, shape=tuple(shape), config=config or {}) is False


def preserving_sanitizer(sanitize, config: dict):
    """Wrap a model's sanitize() so the tensors plugins want kept (MTP heads) survive it."""

    def sanitize_keeping(weights):
        keep = {}
        for found in plugin_manager().hook.omlx_tensors_to_preserve(weights=weights, config=config):
            keep.update(found)
        out = sanitize(weights)
        missing = {name: value for name, value in keep.items() if name not in out}
        if missing:
            log.info("omlx-mtp: keeping %d MTP tensors that sanitize() dropped", len(missing))
            out.update(missing)
        return out

    return sanitize_keeping
