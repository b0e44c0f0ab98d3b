"""A served prompt prefilled segment by segment, as mlx-lm's own generator does it.

mlx-lm's server splits a chat prompt into segments (the system prompt, the rest of the prompt, a
short tail) and its generator reports each segment's end; the server then asks for the request's
cache at that point and files it in its prompt cache.  A later request that shares the system
prompt, or a next turn that extends this prompt, starts from those caches, and on models whose
caches can't be trimmed (linear-attention layers) they are the only prefixes it can reuse.  The
same reports carry the prefill's progress, which streaming clients receive as keepalives.

Here a prompt in segments is prefilled by this loop's decoder (so that a drafter with its own
K/V sees every position, as in a prefill in one piece), a chunk of at most the server's
``prefill_step_size`` tokens per generator step, between the decoding rounds of the running
requests.  Its last token is left for the admission that starts its decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptProgress:
    """What mlx-lm's generator reports while it prefills (its ``PromptProcessingBatch.Response``):
    tokens done of the prompt's total, whether a segment ended, whether the prompt did."""

    uid: int
    progress: tuple
    end_of_segment: bool
    end_of_prompt: bool


def split_segments(segments: list) -> list[list[int]]:
    """The segments as mlx-lm's generator processes them: empty ones dropped, the prompt's last
    token a segment of its own (its end is the prompt's, not a segment's to file)."""
    parts = [list(part) for part in segments if len(part)]
    if parts and len(parts[-1]) > 1:
        parts.append(parts[-1][-1:])
        parts[-2] = parts[-2][:-1]
    return parts


@dataclass
class StagedPrompt:
    """A request whose segments are being prefilled: ``pending`` is its queue entry (its whole
    prompt still in ``pending.prompt``, for a fall back to the host's loop), ``parts`` the
    segments still to feed, the last token's excluded."""

    pending: Any
    parts: list
    last: list  # the prompt's last token
    cache: list | None = None  # this loop's cache, made at the first chunk
    previous: Any = None  # hidden state at the last position fed
    fed: list = field(default_factory=list)  # prompt tokens fed here so far

    @property
    def total(self) -> int:
        """Tokens this prefill feeds (those a prompt-cache hit held are not counted, as in mlx-lm)."""
        return len(self.fed) + sum(len(part) for part in self.parts) + len(self.last)
    @property
    def tokens(self) -> list[int]:
        """Every token the cache holds now."""
        return self.pending.all_tokens + self.fed

    def take(self, limit: int) -> tuple[list[int], bool]:
        """The next chunk of at most ``limit`` tokens, and whether it ends its segment."""
        part = self.parts[0]
        chunk, self.parts[0] = part[:limit], part[limit:]
        ended = not self.parts[0]
        if ended:
            self.parts.pop(0)
        self.fed += chunk
        return chunk, ended

    def handed_over(self):
        """The queue entry that starts decoding: the last token to prefill, on this cache."""
        p = self.pending
        p.all_tokens, p.prompt, p.ours, p.previous = self.tokens, self.last, self.cache, self.previous
        return p
