"""A target split over the ranks of ``mx.distributed`` by mlx-lm's own sharding: pipeline stages
(the body's ``pipeline()``: rank 0 holds the last layers, each rank its own layers' weights and
caches) or tensor parallelism (the model's ``shard()``: every layer's matrices split across
ranks).  The model is built lazily, sharded, and only then evaluated, so each rank reads no more
than its share of the weights into memory, as mlx-lm's ``sharded_load`` does."""

from __future__ import annotations

import mlx.core as mx

from ..errors import CheckpointError

SHARDINGS = ("pipeline", "tensor")


def supported(model) -> tuple[str, ...]:
    """The shardings mlx-lm gives this model (tensor parallel first, mlx-lm's own preference)."""
    ways = []
    if hasattr(model, "shard"):
        ways.append("tensor")
    if hasattr(getattr(model, "model", None), "pipeline"):
        ways.append("pipeline")
    return tuple(ways)


def shard_model(model, sharding: str, where: str, group=None):
    """Shard a lazily loaded mlx-lm ``model`` in place ("pipeline", "tensor", or "auto": the
    model's choice) over ``group``; returns the sharding applied.  Refused, saying why, where
    mlx-lm has no such sharding for the family (Gemma 4 has neither)."""
    group = group if group is not None else mx.distributed.init()
    ways = supported(model)
    if sharding == "auto":
        if not ways:
            raise CheckpointError(f"{where}: mlx-lm has no pipeline or tensor sharding for {type(model).__module__} "
                                  "(Gemma 4 targets run on one machine)")
        sharding = ways[0]
    if sharding not in SHARDINGS:
        raise CheckpointError(f"--sharding {sharding!r}: expected one of {', '.join(SHARDINGS)} or auto")
    if sharding not in ways:
        raise CheckpointError(f"{where}: mlx-lm has no {sharding} sharding for {type(model).__module__}"
                              + (f" (it has: {', '.join(ways)})" if ways else " (Gemma 4 targets run on one machine)"))
    if sharding == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    model.omlx_mtp_sharding = sharding
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank loaded
    return sharding
