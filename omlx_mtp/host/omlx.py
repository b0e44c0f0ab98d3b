"""Called from the call sites that ``patches/omlx-0.3.8`` adds to oMLX; asks every installed
``omlx`` plugin (omlx-mtp's own and third-party ones) through the pluggy hooks."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

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


def in_side_shard(name: str, config: dict | None = None) -> bool:
    """For oq's writer: whether a tensor plugins keep goes to a side shard instead of the model's
    shards — MTP tensors of a multimodal checkpoint, which mlx-vlm would load strictly (it reads
    every ``*.safetensors`` beside config.json) without a place for them."""
    from ..models import is_multimodal

    config = config or {}
    return is_multimodal(config) and skip_tensor(name, config) is False


def write_side_shard(output, tensors: dict, config: dict) -> None:
    """Write the side shard where omlx-mtp's loaders look for it (``mtp/mtp.safetensors``)."""
    import mlx.core as mx

    from ..mtp_tensors import mtp_shard

    path = Path(output) / mtp_shard(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})
    log.info("omlx-mtp: %d MTP tensors written to %s (beside the shards a multimodal loader reads)",
             len(tensors), path.relative_to(output))


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


# oMLX engines whose start() has the call sites of patches/omlx-0.3.8 (text and multimodal models).
ENGINES_WITH_MTP = ("BatchedEngine", "VLMBatchedEngine")


def engine_built(engine, model_id: str, model_path: str | None = None) -> None:
    """At engine creation: a model whose settings ask for MTP but that oMLX serves with an engine
    without MTP call sites (embeddings, reranker, audio, DFlash) says so once, and serves plain."""
    kind = type(engine).__name__
    if kind in ENGINES_WITH_MTP:
        return
    try:
        settings = plugin_manager().hook.omlx_model_settings(
            model_id=model_id, model_path=str(model_path) if model_path else None, base_path=_base_path())
    except Exception:  # never keep a model from serving
        return
    if settings and settings.get("mtp_enabled"):
        log.warning("omlx-mtp: MTP disabled for %s: oMLX serves it with %s, which has no MTP support; "
                    "it decodes plain", model_id, kind)


def attach_decode_strategy(scheduler, model, model_path: str, model_id: str | None = None):
    """At engine start: the plugins' settings, drafter and decode strategy for this model, handed
    to the scheduler.  Whatever goes wrong is logged and the model serves with plain decoding."""
    model_id = model_id or Path(str(model_path)).name
    hook = plugin_manager().hook
    try:
        settings = hook.omlx_model_settings(model_id=model_id, model_path=str(model_path), base_path=_base_path())
        if not settings:
            return None
        drafter = hook.omlx_load_drafter(model_id=model_id, model_path=str(model_path), model=model,
                                         settings=settings)
        strategy = hook.omlx_decode_strategy(model_id=model_id, model=model, drafter=drafter, settings=settings)
    except Exception as exc:  # a plugin must never keep a model from serving
        log.warning("omlx-mtp: %s decodes plain: %s: %s", model_id, type(exc).__name__, exc)
        return None
    scheduler.decode_strategy = strategy
    scheduler.batch_generator = None  # the next request makes one through the strategy
    if strategy is not None:
        describe = getattr(strategy, "describe", lambda: "")()
        log.info("omlx-mtp: %s decodes with %s (%s)", model_id, strategy.name, describe)
    return strategy


def batch_generator(scheduler, factory, **kwargs):
    """For the scheduler's _create_batch_generator: the strategy's generator, or ``factory``'s."""
    strategy = getattr(scheduler, "decode_strategy", None)
    if strategy is not None:
        try:
            return strategy.batch_generator(factory, **kwargs)
        except Exception as exc:
            log.warning("omlx-mtp: %s failed to start (%s: %s); decoding plain", strategy.name,
                        type(exc).__name__, exc)
    return factory(**kwargs)


def _base_path() -> str | None:
    """oMLX's base path (its --base-path) when oMLX's settings are initialised."""
    try:
        from omlx.settings import get_settings

        return str(get_settings().base_path)
    except Exception:  # not running inside oMLX, or settings not initialised yet
        return None
