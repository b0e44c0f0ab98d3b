"""One request, plain or speculative, timed the same way; shared by the CLI, demo and bench."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..decode.requests import DecodeStats, Request, RowState
from ..decode.loop import SpeculativeDecoder
from ..decode.processors import RowProcessors
from ..decode.ranks import RankGroup
from ..targets import Target, wrap_target
from ..decode.target import prefill_on_host
from ..drafters import load_drafter, load_merged_drafter
from ..errors import MTPError
from ..checkpoint.loading import load_target


NO_DRAFT = "no-draft"  # the engine that runs this loop without drafts (MTP off)


def rotated(items: list, turn: int) -> list:
    """``items`` starting at ``turn``: each engine runs first in some passes, so a place in the
    order that runs faster (caches, the allocator, clocks) favours none of them."""
    turn %= len(items)
    return items[turn:] + items[:turn]


def regime() -> str:
    """Where decoding runs, for the record next to any speed: device and, on a Linux CPU, the BLAS."""
    blas = "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "").lower() else "bundled BLAS"
    return f"{mx.default_device()}, {blas}"


def placed(sharding: str | None) -> tuple[str | None, RankGroup | None]:
    """(the sharding to apply, the ranks) for this process: under ``mlx.launch`` with several ranks
    the target is split (``sharding``, by default the model's choice); alone, nothing is."""
    group = mx.distributed.init()
    if group.size() > 1:
        return sharding or "auto", RankGroup(group)
    return None, None


@dataclass
class Outcome:
    row: RowState
    mtp: bool
    prefill_seconds: float
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        # The first token comes out of prefill; decode speed counts the ones after it.
        after_first = max(len(self.row.generated) - 1, 0)
        return after_first / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self, tokenizer=None) -> dict:
        stats = self.row.stats if self.mtp else DecodeStats()
        out = {
            "text": tokenizer.decode(self.row.generated) if tokenizer is not None else None,
            "tokens": list(self.row.generated),
            "generated_tokens": len(self.row.generated),
            "prompt_tokens": len(self.row.request.prompt),
            "finish_reason": self.row.finish_reason,
            "mtp": self.mtp,
            "tokens_per_second": self.tokens_per_second,
            "prefill_seconds": self.prefill_seconds,
        }
        out.update(stats.as_dict())
        return out


class Session:
    """A loaded target (and optional drafter) that can run requests either way."""

    def __init__(self, target: Target, tokenizer=None, drafter=None, draft_tokens: int | str = 3,
                 query_offset: int = 0, max_draft_tokens: int = 8, ranks: RankGroup | None = None):
        """ranks: the ranks a sharded target is split over (None: one process)."""
        self.target = target
        self.ranks = ranks
        self.model = target.plain_model()  # what mlx-lm's own decode loops call
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.decoder = SpeculativeDecoder(target, drafter, draft_tokens=draft_tokens, query_offset=query_offset,
                                          max_draft_tokens=max_draft_tokens, ranks=ranks)

    @classmethod
    def load(cls, model_dir: str | Path, drafter_dir: str | Path | None = None, merged: bool = True,
             sharding: str | None = None, **kwargs) -> "Session":
        """``merged``: without a drafter directory, use an assistant merged into the checkpoint.
        ``sharding``: "pipeline", "tensor" or "auto" (the default under ``mlx.launch`` with several
        ranks): the target split over the ranks by mlx-lm's sharding, the drafter whole on each."""
        sharding, ranks = placed(sharding)
        model, tokenizer, _ = load_target(model_dir, sharding=sharding)
        target = wrap_target(model)
        kwargs["ranks"] = ranks
        drafter = None
        if drafter_dir is not None:
            drafter = load_drafter(drafter_dir, target)
        elif merged:
            drafter = load_merged_drafter(model_dir, target)  # None when the checkpoint has no assistant
        return cls(target, tokenizer, drafter, **kwargs)

    def placement(self) -> dict:
        """Where this process sits: its rank, the group's size and the target's sharding."""
        return {"rank": self.ranks.rank if self.ranks else 0, "ranks": self.ranks.size if self.ranks else 1,
                "sharding": self.target.sharding}

    def stop_tokens(self) -> frozenset:
        if self.tokenizer is None:
            return frozenset()
        return frozenset(self.tokenizer.eos_token_ids)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise MTPError("this model has no tokenizer; pass token ids")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise MTPError("--chat: the tokenizer has no chat template")
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            ids = self.tokenizer.encode(text)
        if not ids:
            raise MTPError("the prompt encodes to no tokens")
        return list(ids)

    def run(self, request: Request, mtp: bool = True, seed: int | None = None, draft_tokens: int | None = None) -> Outcome:
        if mtp and self.drafter is None:
            raise MTPError("MTP needs a drafter: pass --drafter DIR, use a checkpoint with a merged assistant "
                           "(omlx-mtp quantize --assistant), or --no-mtp for plain decoding")
        return run_mtp(self.decoder, request, seed, draft_tokens) if mtp else run_plain(self.model, request, seed)


def run_mtp(decoder: SpeculativeDecoder, request: Request, seed=None, draft_tokens=None) -> Outcome:
    start = time.perf_counter()
    first = None
    rows = None
    for rows, _ in decoder.stream([request], seed=seed, draft_tokens=draft_tokens):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return Outcome(rows[0], True, first - start, end - first)


def run_plain(model, request: Request, seed=None, prefill_step: int = 512) -> Outcome:
    """Plain decoding through mlx-lm's own loop and caches (the reference MTP must match)."""
    if seed is not None:
        mx.random.seed(seed)
    params = request.params
    prompt = mx.array(list(request.prompt), dtype=mx.int32)
    processors = [_following_history(p) for p in params.processors()]
    row = RowState(request, RowProcessors(), prompt)
    start = time.perf_counter()
    first = None
    extra = {}
    if request.embeddings is not None:  # images or audio: the host's prefill, as oMLX runs it
        extra["prompt_cache"] = prefill_on_host(model, list(request.prompt), request.embeddings)
        prompt = prompt[-1:]
    steps = generate_step(
        prompt,
        model,
        max_tokens=request.max_tokens,
        sampler=params.mlx_sampler(),
        logits_processors=processors or None,
        prefill_step_size=prefill_step,
        **extra,
    )
    for token, _ in steps:
        if first is None:
            first = time.perf_counter()
        row.emit([int(token)])
        if row.finish_reason is not None:
            break
    end = time.perf_counter()
    return Outcome(row, False, first - start, end - first)


def _following_history(processor):
    """``processor`` for mlx-lm's ``generate_step``, which computes a token's successor before it
    yields the token: a processor that follows the output (``accept_token``: grammars) takes the
    new tokens of the history it is handed instead, as oMLX's patched step does."""
    if not hasattr(processor, "accept_token"):
        return processor
    seen = []

    def follow(tokens, logits):
        if not seen:
            seen.append(len(tokens))  # the first call sees the prompt
        for token in tokens[seen[0]:].tolist():
            processor.accept_token(token)
        seen[0] = len(tokens)
        return processor(tokens, logits)

    return follow
