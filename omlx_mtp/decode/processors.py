"""A row's logits processors across the positions of one verify, and back to what was kept.

Plain decoding calls a row's processors once per token.  A verify scores K + 1 positions at
once, so position i must see the processors as plain decoding would after the bonus and drafts
1..i, and after acceptance keeps n drafts the processors must hold what plain decoding would after
exactly the n + 1 emitted tokens.  Processors come in four kinds:

* pure: a function of the token history and the logits (mlx-lm's penalties, ours); they read the
  drafts through the history and need nothing undone.
* matcher: a grammar processor (``accept_token`` and an xgrammar ``GrammarMatcher`` as
  ``matcher``, which can ``rollback``): the matcher takes each draft before the next position's
  bitmask and gives them all back afterwards; the emitted tokens are then accepted as usual.  A
  draft the grammar forbids has p = 0 where it was drafted, so acceptance rejects it like any
  other.  The same bitmasks can mask the drafter (``draft_mask``), so that it drafts only what
  the grammar allows.
* snapshot: an object whose state is plain data (oMLX's thinking budget): its state is copied
  before each position and the copy after the kept positions put back.
* opaque: anything else (state that can't be seen or undone): the row takes one token per round.
"""

from __future__ import annotations

import copy
import types
from functools import partial

import mlx.core as mx
import numpy as np

PURE, MATCHER, SNAPSHOT, OPAQUE = "pure", "matcher", "snapshot", "opaque"

# Modules whose processors are pure functions of (tokens, logits).
_PURE_MODULES = ("mlx_lm.sample_utils", "omlx_mtp.")
_PLAIN_DATA = (type(None), bool, int, float, str)


def kind_of(processor) -> str:
    if hasattr(processor, "accept_token"):
        matcher = getattr(processor, "matcher", None)
        return MATCHER if hasattr(matcher, "rollback") and hasattr(matcher, "is_terminated") else OPAQUE
    if isinstance(processor, (types.FunctionType, types.BuiltinFunctionType, partial)):
        module = getattr(processor, "__module__", "") or ""
        return PURE if module.startswith(_PURE_MODULES) else OPAQUE
    state = getattr(processor, "__dict__", None)
    if state is not None and _is_plain_data(state):
        return SNAPSHOT
    return OPAQUE


def _is_plain_data(value, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN_DATA):
        return True
    if depth > 4:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_plain_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_is_plain_data(k, depth + 1) and _is_plain_data(v, depth + 1) for k, v in value.items())
    return False


class _Grammar:
    """A matcher processor through one round: the bitmask at each position (after the drafts
    before it), computed once and shared by the draft steps and the verify."""

    def __init__(self, processor):
        self.matcher = processor.matcher
        self.taken = 0  # drafts the matcher accepted this round
        self.refused = False  # it refused a draft: positions after it are never kept
        self.masks: list = []  # per position: a bitmask, or None (nothing to mask)

    def mask(self, i: int, drafts: list[int], vocab: int):
        while len(self.masks) <= i:
            j = len(self.masks)
            if j and not self.refused and not self.matcher.is_terminated():
                if self.matcher.accept_token(drafts[j - 1]):
                    self.taken += 1
                else:
                    self.refused = True
            if self.refused or self.matcher.is_terminated():  # a terminated grammar masks nothing
                self.masks.append(None)
                continue
            bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
            self.matcher.fill_next_token_bitmask(bitmask)
            self.masks.append(bitmask)
        return self.masks[i]

    def rollback(self) -> None:
        if self.taken:
            self.matcher.rollback(self.taken)
        self.taken, self.refused, self.masks = 0, False, []


def apply_bitmask(bitmask, logits: mx.array) -> mx.array:
    """logits [1, V] with -inf where the bitmask (xgrammar's packed int32 words) forbids."""
    from xgrammar.kernels.apply_token_bitmask_mlx import apply_token_bitmask_mlx

    return apply_token_bitmask_mlx(mx.array(bitmask), logits, logits.shape[-1])


class RowProcessors:
    """The processors of one row, applied position by position and settled after acceptance."""

    def __init__(self, processors=()):
        self.processors = list(processors)
        kinds = [kind_of(p) for p in self.processors]
        self.stateful = any(k != PURE for k in kinds)  # needs the drafts on the host, one sync a round
        self.can_draft = OPAQUE not in kinds
        self.opaque = [p for p, k in zip(self.processors, kinds) if k == OPAQUE]
        self._grammars = {id(p): _Grammar(p) for p, k in zip(self.processors, kinds) if k == MATCHER}
        self._snapshots = [p for p, k in zip(self.processors, kinds) if k == SNAPSHOT]
        self._saved: list = []  # snapshot states before each position of the current verify

    def __bool__(self) -> bool:
        return bool(self.processors)

    @property
    def grammars(self) -> bool:
        return bool(self._grammars)

    def draft_mask(self, drafted: list[int], vocab: int) -> mx.array | None:
        """An additive mask [V] (0 or -inf) for the next draft after ``drafted`` (this round's
        drafts so far): what the grammars allow there; None when they allow everything."""
        mask = None
        for grammar in self._grammars.values():
            bitmask = grammar.mask(len(drafted), drafted, vocab)
            if bitmask is not None:
                mask = apply_bitmask(bitmask, mx.zeros((1, vocab)) if mask is None else mask[None])[0]
        return mask

    def verify(self, history: mx.array, drafts: mx.array, logits: mx.array) -> mx.array:
        """Processed logits [L, V] for positions 0..L-1, position i following ``history`` and the
        first i drafts (``drafts`` [>= L-1]).  The state stays advanced until ``settle``."""
        positions, vocab = logits.shape
        draft_list = drafts[: positions - 1].tolist() if self.stateful and positions > 1 else []
        self._saved, out = [], []
        for i in range(positions):
            if self._snapshots:
                self._saved.append([copy.deepcopy(vars(p)) for p in self._snapshots])
            value = logits[i][None]
            seen = history if i == 0 else mx.concatenate([history, drafts[:i].astype(history.dtype)])
            for processor in self.processors:
                grammar = self._grammars.get(id(processor))
                if grammar is None:
                    value = processor(seen, value)
                elif (bitmask := grammar.mask(i, draft_list, vocab)) is not None:
                    value = apply_bitmask(bitmask, value)
            out.append(value[0])
        return mx.stack(out)

    def settle(self, kept: int) -> None:
        """After acceptance: state as after the first ``kept`` positions' calls; the grammars hold
        only the tokens emitted before this round (``accept`` then adds what was kept)."""
        for grammar in self._grammars.values():
            grammar.rollback()
        if kept < len(self._saved):
            for processor, state in zip(self._snapshots, self._saved[kept]):
                vars(processor).clear()
                vars(processor).update(state)
        self._saved = []

    def accept(self, token: int) -> None:
        """An emitted token, for processors that follow the output (grammars)."""
        for processor in self.processors:
            if hasattr(processor, "accept_token"):
                processor.accept_token(token)
