"""Plain decoding with mlx-lm's own generate loop and caches: the reference MTP must match."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

from .loop import Request, RowState


def plain_generate(model, request: Request, seed: int | None = None, prefill_step: int = 512) -> RowState:
    if seed is not None:
        mx.random.seed(seed)
    params = request.params
    row = RowState(request, params.processors(), mx.array(list(request.prompt), dtype=mx.int32))
    steps = generate_step(
        mx.array(list(request.prompt), dtype=mx.int32),
        model,
        max_tokens=request.max_tokens,
        sampler=params.mlx_sampler(),
        logits_processors=row.processors or None,
        prefill_step_size=prefill_step,
    )
    for token, _ in steps:
        row.emit([int(token)])
        if row.finish_reason is not None:
            break
    return row
