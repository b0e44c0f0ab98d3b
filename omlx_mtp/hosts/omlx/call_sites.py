"""Called from the call sites that ``patches/omlx-0.3.8`` adds to oMLX; asks every installed
``omlx`` plugin (omlx-mtp's own and third-party ones) through the pluggy hooks."""

from __future__ import annotations

import inspect
import logging
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from ..settings import ENGINE_HOST, ENGINE_PLUGIN
from . import host_switches
from .response_waves import process_in_waves
from .turboquant import note_turboquant

log = logging.getLogger("omlx_mtp.hosts.omlx")


@lru_cache(maxsize=1)
def plugin_manager():
    from .hookspecs import load_plugin_manager

    return load_plugin_manager()


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
    from ...checkpoint.loading import is_multimodal

    config = config or {}
    return is_multimodal(config) and skip_tensor(name, config) is False


def write_side_shard(output, tensors: dict, config: dict) -> None:
    """Write the side shard where omlx-mtp's loaders look for it (``mtp/mtp.safetensors``)."""
    import mlx.core as mx

    from ...checkpoint.mtp_tensors import mtp_shard

    path = Path(output) / mtp_shard(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), tensors, metadata={"format": "mlx"})
    log.info("omlx-mtp: %d MTP tensors written to %s (beside the shards a multimodal loader reads)",
             len(tensors), path.relative_to(output))


def preserving_sanitizer(sanitize, config: dict):
    """Wrap a model's sanitize() so the tensors plugins want kept (MTP heads) survive it."""
    from ...checkpoint.mtp_tensors import is_mtp_tensor

    def sanitize_keeping(weights):
        keep = {}
        for found in plugin_manager().hook.omlx_tensors_to_preserve(weights=weights, config=config):
            keep.update(found)
        out = sanitize(weights)
        # A host whose sanitize keeps the MTP module itself (oMLX 0.6.2's, for Qwen3.5) may rename
        # it (``mtp.*`` -> ``language_model.mtp.*``): its tensors stand, and adding the old names
        # back would give a loader names it has no place for.
        if any(is_mtp_tensor(name, config) for name in out):
            return out
        missing = {name: value for name, value in keep.items() if name not in out}
        if missing:
            log.info("omlx-mtp: keeping %d MTP tensors that sanitize() dropped", len(missing))
            out.update(missing)
        return out

    return sanitize_keeping


# oMLX engines whose start() has the call sites of patches/omlx-0.3.8 (text and multimodal models).
ENGINES_WITH_MTP = ("BatchedEngine", "VLMBatchedEngine")

# model id -> why MTP is off for a model whose settings ask for it, where oMLX serves it with an
# engine without a scheduler for the strategy (reported in the pool's status by model id).
_unavailable: dict[str, str] = {}
_stats_failures: set[str] = set()


def engine_built(engine, model_id: str, model_path: str | None = None) -> None:
    """At engine creation: a model whose settings ask for MTP but that oMLX serves with an engine
    without MTP call sites (embeddings, reranker, audio, DFlash) says so once, and serves plain."""
    kind = type(engine).__name__
    _unavailable.pop(model_id, None)  # a model loaded again starts afresh
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
        _unavailable[model_id] = f"oMLX serves it with {kind}, which has no MTP support"


def attach_decode_strategy(scheduler, model, model_path: str, model_id: str | None = None, host_settings=None):
    """At engine start: the plugins' settings, drafter and decode strategy for this model, handed
    to the scheduler.  Whatever goes wrong is logged and the model serves with plain decoding.
    ``model_id``: oMLX's id for the model (0.6.2 passes it; 0.3.8's id is the directory's name);
    ``host_settings``: oMLX's own ``ModelSettings`` for it (0.6.2), whose MTP switches count too."""
    model_id = model_id or Path(str(model_path)).name
    hook = plugin_manager().hook
    scheduler.mtp_unavailable = settings = None  # why a model whose settings ask for MTP decodes plain
    scheduler.mtp_host_engine = None  # why oMLX's own MTP drafts for this model instead (0.3.9 on)
    try:
        settings = hook.omlx_model_settings(model_id=model_id, model_path=str(model_path), base_path=_base_path())
        settings, switched_by = host_switches.merged(settings, host_settings, model_path)
        if not settings:
            if switched_by and host_switches.host_drafts(model, scheduler, host_settings):  # mtp_engine: omlx
                _hand_to_host(scheduler, model_id, "its settings say mtp_engine: omlx")
            return None
        with _warnings_logged() as warned:
            drafter = hook.omlx_load_drafter(model_id=model_id, model_path=str(model_path), model=model,
                                             settings=settings)
        strategy = hook.omlx_decode_strategy(model_id=model_id, model=model, drafter=drafter, settings=settings)
    except Exception as exc:  # a plugin must never keep a model from serving
        log.warning("omlx-mtp: %s decodes plain: %s: %s", model_id, type(exc).__name__, exc)
        if settings is None or settings.get("mtp_enabled"):
            scheduler.mtp_unavailable = f"{type(exc).__name__}: {exc}"
        return None
    if strategy is None and settings.get("mtp_enabled"):
        if drafter is not None:
            scheduler.mtp_unavailable = "no plugin gave a decode strategy"
        else:  # the plugin logged why
            scheduler.mtp_unavailable = warned[-1] if warned else "no drafter was loaded"
        if host_switches.host_drafts(model, scheduler, host_settings):
            _hand_to_host(scheduler, model_id, f"omlx-mtp can't draft for it ({scheduler.mtp_unavailable})")
            scheduler.mtp_unavailable = None
    elif strategy is not None and host_switches.stand_aside(model, scheduler):
        log.info("omlx-mtp: %s: oMLX's own MTP stands aside (omlx-mtp drafts for this model)", model_id)
    scheduler.decode_strategy = strategy
    scheduler.batch_generator = None  # the next request makes one through the strategy
    if strategy is not None:
        describe = getattr(strategy, "describe", lambda: "")()
        log.info("omlx-mtp: %s decodes with %s (%s)", model_id, strategy.name, describe)
        process_in_waves(scheduler)  # several tokens per request per step, read as the host reads them
        try:  # a note must never keep the model from serving
            turboquant = note_turboquant(scheduler, model_id)
            if turboquant is not None and hasattr(getattr(strategy, "stats", None), "note"):
                strategy.stats.note("turboquant_kv", turboquant)
        except Exception as exc:
            log.warning("omlx-mtp: %s: TurboQuant setting unreadable: %s: %s", model_id, type(exc).__name__, exc)
    return strategy


def _hand_to_host(scheduler, model_id: str, why: str) -> None:
    log.info("omlx-mtp: %s: oMLX's own MTP drafts: %s", model_id, why)
    scheduler.mtp_host_engine = why


def insert_kwargs(generator, request) -> dict:
    """For the scheduler's ``batch_generator.insert`` calls: the request's sampling parameters where
    the generator draws from the distribution itself (MTP rejection sampling), else nothing."""
    if getattr(generator, "wants_sampling_params", False):
        return {"sampling_params": [request.sampling_params]}
    return {}


def batch_generator(scheduler, factory, **kwargs):
    """For the scheduler's _create_batch_generator: the strategy's generator, or ``factory``'s."""
    strategy = getattr(scheduler, "decode_strategy", None)
    if strategy is not None:
        try:
            interval = snapshot_interval(scheduler)
            extra = ({"snapshot_interval": interval} if interval and
                     "snapshot_interval" in inspect.signature(strategy.batch_generator).parameters else {})
            return strategy.batch_generator(factory, **kwargs, **extra)
        except Exception as exc:
            log.warning("omlx-mtp: %s failed to start (%s: %s); decoding plain", strategy.name,
                        type(exc).__name__, exc)
            counters = getattr(strategy, "stats", None)
            if hasattr(counters, "generator_failed"):
                counters.generator_failed(f"its generator failed to start: {type(exc).__name__}: {exc}")
    return factory(**kwargs)


def snapshot_interval(scheduler) -> int:
    """The tokens between the boundary snapshots oMLX takes of running requests' caches (its
    paged-cache block size, once aligned at scheduler start), or 0 when it takes none: no paged
    cache, or a model whose caches are all sliceable (then rounds need not stop at boundaries)."""
    config = getattr(scheduler, "config", None)
    if getattr(scheduler, "block_aware_cache", None) is None or config is None:
        return 0
    try:  # oMLX's own answer; where it can't give one, rounds stop at boundaries all the same
        needs_snapshots = scheduler._detect_boundary_snapshot_need()
    except Exception:
        needs_snapshots = True
    if not needs_snapshots:
        return 0
    return max(0, int(getattr(config, "paged_cache_block_size", 0) or 0))


def mtp_stats(source) -> dict | None:
    """The MTP counters for oMLX's stats: ``source`` is a Scheduler, an engine (whose scheduler is
    read) or a model id.  ``{"enabled": False, "reason": ...}`` for a model whose settings ask for
    MTP but that decodes plain; None where MTP was not asked for.  Never raises: a strategy's
    counters must not break the host's stats."""
    try:
        if isinstance(source, str):
            reason = _unavailable.get(source)
        else:
            scheduler = _scheduler_of(source)
            counters = getattr(getattr(scheduler, "decode_strategy", None), "stats", None)
            stats = counters.snapshot() if counters is not None else None
            if isinstance(stats, dict):
                return {"engine": ENGINE_PLUGIN, **stats}
            handed = getattr(scheduler, "mtp_host_engine", None)
            if isinstance(handed, str):  # oMLX's counters are its own (in its log)
                return {"enabled": True, "engine": ENGINE_HOST, "reason": handed}
            reason = getattr(scheduler, "mtp_unavailable", None)
        return {"enabled": False, "reason": reason} if isinstance(reason, str) else None
    except Exception as exc:
        if type(exc).__name__ not in _stats_failures:  # once: hosts poll their stats every few seconds
            _stats_failures.add(type(exc).__name__)
            log.warning("omlx-mtp: MTP stats unavailable: %s: %s", type(exc).__name__, exc)
        return None


def mtp_fields(source, model_id: str | None = None) -> dict:
    """``{"mtp": stats}`` to merge into one of oMLX's stats dicts, or {} (nothing to report, or
    ``source`` is None: a model not loaded).  ``model_id``: asked when ``source`` tells nothing."""
    if source is None:
        return {}
    stats = mtp_stats(source)
    if stats is None and model_id is not None:
        stats = mtp_stats(model_id)
    return {"mtp": stats} if stats is not None else {}


def _scheduler_of(source):
    """An oMLX engine's scheduler (BatchedEngine / VLMBatchedEngine: engine._engine.engine.scheduler),
    or ``source`` itself."""
    core = getattr(getattr(source, "_engine", None), "engine", None)
    return getattr(core, "scheduler", source)


@contextmanager
def _warnings_logged():
    """Warnings omlx-mtp logs on this thread meanwhile (where a plugin says why it gives no drafter)."""
    found: list[str] = []
    thread = threading.get_ident()

    class Collect(logging.Handler):
        def emit(self, record):
            if record.thread == thread:
                found.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("omlx_mtp")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def _base_path() -> str | None:
    """oMLX's base path (its --base-path) when oMLX's settings are initialised."""
    try:
        from omlx.settings import get_settings

        return str(get_settings().base_path)
    except Exception:  # not running inside oMLX, or settings not initialised yet
        return None
