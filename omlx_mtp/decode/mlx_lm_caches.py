"""Moving a request's K/V between mlx-lm's caches (a host's prefill, its prefix cache) and ours.

mlx-vlm's caches speak the same protocol (mlx-vlm up to 0.5 re-exports mlx-lm's classes, later
releases have copies of them), so both are read here; caches go back as the target's own host
classes (``target.cache_classes``), the ones the host would have made.

In: an mlx-lm ``KVCache`` holds positions 0..offset-1 in order; a ``RotatingKVCache`` (keep=0)
holds the latest ones in a ring, put back in time order by its own ``_temporal_order``.  Each kept
position p lands in our slot p (full layers) or p mod capacity (sliding ring).

Out: the committed positions of one row, as the caches mlx-lm's ``BatchGenerator`` would hold
for the same tokens — so a host can store or reuse them as if plain decoding had made them.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import MTPError
from .cache import PositionalKVCache, tables_of
from .linear_state import LinearStateCache


def from_mlx_lm(target, layer_caches: list, slack: int) -> list[PositionalKVCache]:
    """One request's mlx-lm caches -> a one-row cache list of ours with ``slack``."""
    ours = target.make_cache(1, slack=slack)
    layer_caches = _flat(target, layer_caches)
    if len(layer_caches) != len(ours):
        raise MTPError(f"expected {len(ours)} layer caches, got {len(layer_caches)}")
    ordered = []
    for mine, theirs in zip(ours, layer_caches):
        if isinstance(mine, LinearStateCache):
            mine.cache = _linear_state(theirs)
            ordered.append(None)
        else:
            ordered.append(_time_ordered(theirs))
    for table in tables_of(ours):
        members = [i for i, c in enumerate(ours) if getattr(c, "table", None) is table]
        lengths = {ordered[i][2] for i in members}
        if len(lengths) != 1:
            raise MTPError(f"layer caches of one attention type disagree on length: {sorted(lengths)}")
        length = lengths.pop()
        keys = ordered[members[0]][0]
        held = 0 if keys is None else keys.shape[2]  # <= length: _time_ordered keeps no more
        if table.capacity is not None:
            held = min(held, table.capacity)
        positions = mx.arange(length - held, length, dtype=mx.int32)
        size = length if table.capacity is None else table.capacity
        slots = positions if table.capacity is None else mx.remainder(positions, table.capacity)
        table.lengths = [length]
        table.positions = mx.put_along_axis(mx.full((1, size), -1, dtype=mx.int32), slots[None], positions[None], axis=1)
        for i in members:
            keys, values, _ = ordered[i]
            if held == 0:
                continue
            ours[i].keys = _placed(keys[..., keys.shape[2] - held :, :], slots, size)
            ours[i].values = _placed(values[..., values.shape[2] - held :, :], slots, size)
    return ours


def to_mlx_lm(target, caches: list, row: int = 0) -> list:
    """Row ``row``'s committed positions -> the host's KVCache / RotatingKVCache (and, for
    linear-attention layers, ArraysCache) objects."""
    KVCache, RotatingKVCache = target.cache_classes
    out = []
    for cache in caches:
        if isinstance(cache, LinearStateCache):
            layer = target.state_cache_class(size=2)
            layer.cache = [c[row : row + 1] for c in cache.cache]
            out.append(layer)
            continue
        table = cache.table
        length = table.lengths[row]
        if table.capacity is None:
            layer = KVCache()
            if length:  # attributes, not ``state``: its layout differs between mlx-lm releases
                layer.keys, layer.values = cache.keys[row : row + 1, :, :length], cache.values[row : row + 1, :, :length]
                layer.offset = length
            out.append(layer)
            continue
        held = min(length, table.window)
        slots = mx.remainder(mx.arange(length - held, length, dtype=mx.int32), table.capacity)
        layer = RotatingKVCache(max_size=table.window, keep=0)
        if held:  # in time order, oldest first: the next write (at _idx = held) rotates to slot 0
            layer.keys, layer.values = cache.keys[row : row + 1, :, slots], cache.values[row : row + 1, :, slots]
            layer.offset, layer._idx = length, held
        out.append(layer)
    regroup = getattr(target, "host_cache_layers", None)  # a host layer that keeps several caches
    return regroup(out) if regroup is not None else out


def _flat(target, layer_caches: list) -> list:
    """The host's per-layer caches as one list of K/V or state caches, as ``make_cache`` lays them
    out (mlx-lm's ``CacheList`` holds several caches of one layer: DeepSeek-V3.2's latents and
    indexer keys)."""
    flatten = getattr(target, "host_cache_groups", None)
    return flatten(layer_caches) if flatten is not None else layer_caches


def _linear_state(layer) -> list:
    """[conv state, recurrent state] of an mlx-lm (or mlx-vlm) ``ArraysCache`` of one row."""
    if not any(cls.__name__ == "ArraysCache" and cls.__module__.startswith(("mlx_lm.", "mlx_vlm."))
               for cls in type(layer).__mro__):
        raise MTPError(f"cannot read a linear-attention state from a {type(layer).__module__}.{type(layer).__name__}")
    state = list(layer.cache)
    if len(state) != 2 or any(s is None for s in state):
        raise MTPError("a linear-attention cache that has seen no token")
    if getattr(layer, "left_padding", None) is not None or getattr(layer, "lengths", None) is not None:
        raise MTPError("a linear-attention cache still inside a padded batch prefill")
    return state


def _kind(layer) -> str | None:
    """"full" or "sliding" for mlx-lm's (and mlx-vlm's) KVCache and RotatingKVCache, and for a
    host's subclasses of them that keep their storage (oMLX's PrefillReadyRotatingKVCache); the
    library's own other caches (chunked, quantized, batched, TurboQuant) store K/V differently."""
    for cls in type(layer).__mro__:
        if cls.__module__.startswith(("mlx_lm.models.cache", "mlx_vlm.models.cache")):
            return {"KVCache": "full", "RotatingKVCache": "sliding"}.get(cls.__name__)
    return None


def _time_ordered(layer):
    """(keys, values, offset) with keys/values in time order, ending at position offset-1."""
    kind = _kind(layer)
    if kind is None:
        raise MTPError(f"cannot read K/V from a {type(layer).__module__}.{type(layer).__name__}")
    if layer.keys is None or layer.offset == 0:
        return None, None, 0
    if kind == "full":
        return layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :], layer.offset
    if layer.keep:
        raise MTPError("a RotatingKVCache with keep > 0 is not supported")
    keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
    held = min(keys.shape[2], layer.offset)
    return keys[..., keys.shape[2] - held :, :], values[..., values.shape[2] - held :, :], layer.offset


def _placed(x: mx.array, slots: mx.array, size: int) -> mx.array:
    """x [1, H, n, D] written into a zero buffer of ``size`` slots at ``slots``."""
    buffer = mx.zeros((*x.shape[:2], size, x.shape[3]), dtype=x.dtype)
    buffer[:, :, slots] = x
    return buffer
