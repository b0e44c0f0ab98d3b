"""A request, its row in a running batch, and the counts a row keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from .controller import DepthController
from .processors import RowProcessors
from .sampling import SamplingParams
from .target import PromptEmbeddings

_STATS_FIELDS = ("rounds", "drafted", "accepted", "emitted", "plain_steps", "probes")


@dataclass
class DecodeStats:
    """What a request's decoding did: ``rounds`` (drafting rounds and plain steps), drafts made
    and accepted, tokens emitted, plain steps, probes (drafting rounds run to find out whether
    drafting pays, where plain steps were winning) and drafting rounds per depth."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    plain_steps: int = 0
    probes: int = 0
    depths: dict = field(default_factory=dict)  # depth -> drafting rounds at it

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def drafting_rounds(self) -> int:
        return sum(self.depths.values())

    def count_round(self, depth: int, accepted: int, probe: bool = False) -> None:
        """A round in which this row drafted ``depth`` tokens (0: it took one plain step)."""
        self.rounds += 1
        self.drafted += depth
        self.accepted += accepted
        if depth:
            self.depths[depth] = self.depths.get(depth, 0) + 1
            self.probes += probe
        else:
            self.plain_steps += 1

    @classmethod
    def pooled(cls, many) -> "DecodeStats":
        """The stats of several requests (or runs) added together."""
        many = list(many)
        depths: dict = {}
        for s in many:
            for k, n in s.depths.items():
                depths[k] = depths.get(k, 0) + n
        return cls(*(sum(getattr(s, f) for s in many) for f in _STATS_FIELDS), depths=depths)

    def minus(self, earlier: "DecodeStats") -> "DecodeStats":
        """What was added since ``earlier``."""
        depths = {k: n - earlier.depths.get(k, 0) for k, n in self.depths.items() if n != earlier.depths.get(k, 0)}
        return DecodeStats(*(getattr(self, f) - getattr(earlier, f) for f in _STATS_FIELDS), depths=depths)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "drafting_rounds": self.drafting_rounds,
            "plain_steps": self.plain_steps,
            "probes": self.probes,
            "depths": {str(k): n for k, n in sorted(self.depths.items())},
        }


@dataclass
class Request:
    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_tokens: frozenset = frozenset()
    embeddings: PromptEmbeddings | None = None  # the prompt's input embeddings when it holds images or audio


@dataclass(eq=False)  # rows are compared by identity
class RowState:
    """One request in the batch.  ``sampler``: a host's own sampler whose distribution is not
    known here (the row then takes one token per round, drawn by that sampler); ``processors``:
    its logits processors, which grammars and other stateful ones among them follow through the
    positions of a verify and back (``RowProcessors``; one whose state can't be undone holds the
    row to one token per round); ``matcher``: token -> True when a stop sequence completed
    (default: the request's stop tokens)."""

    request: Request
    processors: RowProcessors
    history: mx.array  # prompt + emitted tokens (bonus included) for logits processors
    generated: list = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    controller: DepthController | None = None
    sampler: Callable | None = None
    matcher: Callable[[int], bool] | None = None
    stop_token: int | None = None  # the token that ended the row ("stop"); not in ``generated``
    prompt_length: int = 0  # tokens in the target cache before the first generated one
    pending_depth: int | None = None  # a depth the controller chose during a plain stretch
    snapshot_interval: int = 0  # the host snapshots caches at multiples of this many tokens (0: never)
    sparse: bool = False  # prompt prefilled sparsely (SpecPrefill): its cache holds fewer tokens than the request
    counted: bool = True  # its rounds go into a host's MTP counters (not when it fell back to one token a round)

    @property
    def num_tokens(self) -> int:
        """Prompt and emitted tokens: what a running row's cache holds once its bonus is fed."""
        return self.prompt_length + len(self.generated)

    @property
    def cache_length(self) -> int:
        """Tokens a finished row's cache holds: prompt and everything emitted (stop included)."""
        return self.num_tokens + (self.stop_token is not None)

    @property
    def all_tokens(self) -> list[int]:
        """Prompt and every emitted token, a stop token included: what the row's cache holds
        (a running row's once its bonus is fed)."""
        return list(self.request.prompt) + self.generated + ([self.stop_token] if self.stop_token is not None else [])

    @property
    def takes_snapshots(self) -> bool:
        """Whether the host may snapshot this row at boundaries: not when its cache holds fewer
        tokens than the request (a sparse prefill), where no boundary would be filed right."""
        return self.snapshot_interval > 0 and not self.sparse

    @property
    def until_snapshot(self) -> float:
        """Tokens this row may emit before its next snapshot boundary (inf: it takes none).  Rounds
        end there, so the host, reading the row after a step, finds it exactly on the boundary."""
        if not self.takes_snapshots:
            return math.inf
        return self.snapshot_interval - self.num_tokens % self.snapshot_interval

    @property
    def at_snapshot(self) -> bool:
        """A running row sitting exactly on a snapshot boundary."""
        return self.finish_reason is None and self.takes_snapshots and self.num_tokens % self.snapshot_interval == 0

    @property
    def one_token_per_round(self) -> bool:
        return self.sampler is not None or not self.processors.can_draft

    def _stops(self, token: int) -> bool:
        return self.matcher(token) if self.matcher is not None else token in self.request.stop_tokens

    def emit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or max_tokens; return what was appended."""
        out = []
        for token in tokens:
            self.processors.accept(token)
            if self._stops(token):
                self.finish_reason, self.stop_token = "stop", token
                break
            out.append(token)
            if len(self.generated) + len(out) >= self.request.max_tokens:
                self.finish_reason = "length"
                break
        self.generated.extend(out)
        return out
