"""Constrained output for the standalone loop: an xgrammar grammar as a logits processor.

The processor has the shape oMLX's own grammar processor has (``__call__`` masks, ``accept_token``
follows the output, ``matcher`` is xgrammar's ``GrammarMatcher``), so the loop drafts under it
the same way in both places (``processors.RowProcessors``).  xgrammar is optional: install it
with ``pip install omlx-mtp[grammar]`` (it needs torch; install CPU torch first on Linux).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from .processors import apply_bitmask


class GrammarProcessor:
    """Masks logits [1, V] to the tokens the grammar allows next."""

    def __init__(self, compiled_grammar, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.vocab_size = vocab_size
        self._bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def __call__(self, tokens, logits: mx.array) -> mx.array:
        if self.matcher.is_terminated():  # past the grammar's end nothing is masked
            return logits
        self._bitmask.fill(-1)
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return apply_bitmask(self._bitmask, logits)

    def accept_token(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(int(token))


class GrammarCompiler:
    """Compiles grammars for one tokenizer (an HF tokenizer or mlx-lm's wrapper of one)."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))

    def json_schema(self, schema: dict | str, any_whitespace: bool = False) -> GrammarProcessor:
        """A fresh processor (one per request: it keeps the request's place in the grammar).
        Compact JSON by default: free whitespace lets a small model pad forever."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        compiled = self._compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        return GrammarProcessor(compiled, self.vocab_size)

    def ebnf(self, grammar: str) -> GrammarProcessor:
        return GrammarProcessor(self._compiler.compile_grammar(grammar), self.vocab_size)
