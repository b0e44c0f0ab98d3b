"""The MTP decode strategy a host receives from ``omlx_decode_strategy``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decode.loop import QUERY_AT_BONUS, QUERY_AT_LAST, SpeculativeDecoder
from .stats import MTPCounters
from ..targets import wrap_target
from .settings import MTPSettings


@dataclass
class MTPStrategy:
    name: str
    decoder: SpeculativeDecoder
    settings: MTPSettings
    stats: MTPCounters = field(default_factory=MTPCounters)  # outlives the host's generators

    @classmethod
    def build(cls, model, drafter, settings: MTPSettings, target=None, ranks=None) -> "MTPStrategy":
        """``target``: ``model`` already wrapped (else wrapped here); ``ranks``: a ``RankGroup`` for a
        target sharded over ``mx.distributed`` (None: one process)."""
        offset = QUERY_AT_BONUS if settings.mtp_query_position == "bonus" else QUERY_AT_LAST
        decoder = SpeculativeDecoder(target if target is not None else wrap_target(model), drafter,
                                     draft_tokens=settings.mtp_draft_tokens, query_offset=offset,
                                     max_draft_tokens=settings.mtp_max_draft_tokens,
                                     min_acceptance=settings.mtp_min_acceptance, ranks=ranks)
        return cls("omlx-mtp", decoder, settings)

    def describe(self) -> str:
        s = self.settings
        depth = f"auto up to {s.mtp_max_draft_tokens}" if s.mtp_draft_tokens == "auto" else s.mtp_draft_tokens
        return f"draft tokens {depth}, query at {s.mtp_query_position}"

    def batch_generator(self, plain_factory, snapshot_interval: int = 0, **kwargs):
        """A BatchGenerator for the host's scheduler that runs MTP rounds (``plain_factory`` and
        ``kwargs``: the host's own BatchGenerator and its arguments, for requests MTP can't run;
        ``snapshot_interval``: the host's paged-cache block size, where it snapshots caches)."""
        from .batch_generator import MTPBatchGenerator

        return MTPBatchGenerator(self.decoder, plain_factory, counters=self.stats, snapshot_interval=snapshot_interval,
                                 **kwargs)

    def stream(self, requests, seed=None):
        """Yield (rows, new tokens per row) for a batch of ``decode.requests.Request``s."""
        return self.decoder.stream(requests, seed=seed)
