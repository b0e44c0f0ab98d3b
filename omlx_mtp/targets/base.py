"""The base of the target families: ``decode.target.TargetModel`` (the interface the decode loop
owns) implemented over a host's model object.

A family module (one per host model family: which library built the model, which architecture)
wraps the host's model object as it is — weights are never copied or loaded twice — and provides:

* ``hidden(tokens, cache)``: final-normed hidden states [B, L, H] of a forward that writes K/V into
  ``cache`` (this package's ``PositionalKVCache`` list or the traced stand-ins of the compiled forward);
* ``head(hidden)``: logits; ``input_embedding(tokens)``: what the first layer sees for tokens;
* ``make_cache(batch, slack)``, ``kv_source(cache, layer_type)``: caches, and the K/V a drafter reads;
* ``plain_model()``: a callable for mlx-lm's own decode loops (logits out), the reference MTP matches;
  it also takes a prompt's ``embeddings`` (images, audio), which only the host's own prefill sees
  (``prefill_on_host``), with the host's own masks, as oMLX prefills before it hands a request on;
* ``cache_classes``: the host's (full, sliding) cache types, for caches handed back to the host.
"""

from __future__ import annotations

import mlx.core as mx

from ..decode.compiled_forward import CompiledForward, compiled_forward_exact
from ..decode.target import PromptEmbeddings


class Target:
    family = "target"

    def __init__(self, model, compiled: bool | None = None):
        """compiled: run short forwards on this package's caches as one compiled graph (default:
        where this mlx's compiled graphs round exactly as its op-by-op ones)."""
        self.model = model
        self.sharding = sharding_of(model)
        if compiled is None:
            # A sharded forward sends, receives and sums across ranks: it runs op by op.
            compiled = compiled_forward_exact() and self.sharding is None
        self.compiled = CompiledForward(self) if compiled else None

    @classmethod
    def matches(cls, model) -> bool:
        raise NotImplementedError

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [B, L] -> (logits [B, L, V], final-normed hidden [B, L, H])."""
        if self.compiled is not None and self.compiled.accepts(tokens, cache):
            return self.compiled(tokens, cache)
        hidden = self.hidden(tokens, cache)
        return self.head(hidden), hidden

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        raise NotImplementedError

    def head(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def plain_model(self):
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.family} ({type(self.model).__module__}.{type(self.model).__name__})"


def sharding_of(model) -> str | None:
    """"pipeline" or "tensor" for a model sharded by ``checkpoint.loading.load_target``, else None."""
    return getattr(model, "omlx_mtp_sharding", None)


def whole_vocabulary(text, logits: mx.array) -> mx.array:
    """Logits over the whole vocabulary where tensor parallelism split the LM head across ranks
    (mlx-lm 0.32's Qwen3.5 ``shard()`` does; the model then gathers its output, as this does)."""
    group = getattr(text, "sharding_group", None)
    if group is None:
        return logits
    from mlx_lm.models.base import gather_last_axis  # present wherever mlx-lm shards a head

    return gather_last_axis(logits, group)


def stage_layers(body) -> list:
    """The decoder layers this rank runs: all of them, or its pipeline stage's (mlx-lm's
    ``PipelineMixin`` keeps the others' places as None)."""
    return list(getattr(body, "pipeline_layers", body.layers))


def pipelined(body, h: mx.array, run_layers) -> mx.array:
    """``run_layers(h)`` as one stage of mlx-lm's pipeline: the stage after this rank's (rank + 1:
    rank 0 holds the last layers) hands its output in, this rank's goes to rank - 1, and the last
    stage's output is gathered so every rank holds the final hidden state."""
    rank, size = getattr(body, "pipeline_rank", 0), getattr(body, "pipeline_size", 1)
    if size == 1:
        return run_layers(h)
    if rank < size - 1:
        h = mx.distributed.recv_like(h, rank + 1)
    h = run_layers(h)
    if rank != 0:
        h = mx.distributed.send(h, (rank - 1) % size)
    return mx.distributed.all_gather(h)[: h.shape[0]]


class LogitsOnly:
    """An mlx-vlm language model as mlx-lm's decode loops call a model: logits out, its own caches
    (what oMLX's VLM adapter presents to mlx-lm's BatchGenerator).  mlx-vlm's Qwen3.5 keeps the last
    image prompt's mRoPE positions on the model; as the adapter does, a text prompt starts with that
    state cleared, and after a prompt with multimodal positions every later forward is given its
    positions (the cache's offset plus the prompt's shift)."""

    def __init__(self, text):
        self.text = text
        self.rope_shift = None  # known after a prefill with multimodal positions

    def __call__(self, inputs: mx.array, cache=None, embeddings: PromptEmbeddings | None = None):
        if embeddings is not None:
            self.rope_shift = None if embeddings.position_ids is None else embeddings.rope_shift
            kwargs = embeddings.host_kwargs()
        elif self.rope_shift is not None and cache:
            positions = mx.arange(inputs.shape[1], dtype=mx.int32)[None] + _offset(cache) + self.rope_shift
            kwargs = {"position_ids": mx.broadcast_to(positions[None], (3, *inputs.shape))}
        else:
            if cache and _offset(cache) == 0:  # a fresh prompt
                for name in ("_position_ids", "_rope_deltas"):
                    if hasattr(self.text, name):
                        setattr(self.text, name, None)
            kwargs = {}
        return self.text(inputs, cache=cache, **kwargs).logits

    @property
    def layers(self):
        return self.text.model.layers

    def make_cache(self):
        return self.text.make_cache()


def _offset(cache: list):
    """The token count of a host cache list (its first attention cache's offset); None for a
    batch's caches, whose offsets are an array."""
    offset = next(c.offset for c in cache if hasattr(c, "keys"))
    return offset if isinstance(offset, int) else None
