"""The main job: ``omlx-mtp demo`` on the embedded default pair, and the shipped drafter's quality."""

from __future__ import annotations

import json

import pytest

from omlx_mtp.tools.cli import main
from omlx_mtp.decode.loop import QUERY_AT_BONUS, SpeculativeDecoder
from omlx_mtp.decode.requests import Request
from omlx_mtp.fixtures.demo import PAIR_DIR, PROMPTS
from omlx_mtp.tools.session import Session

shipped = pytest.mark.skipif(not (PAIR_DIR / "assistant" / "config.json").is_file(),
                             reason="the trained demo pair is not in this checkout")


def test_demo_outputs_identical(capsys):
    assert main(["demo", "--json", "--max-tokens", "24"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["identical_at_T0"] is True
    assert len(summary["prompts"]) == len(PROMPTS)


@shipped
def test_shipped_assistant_has_learned_its_target():
    """A drafter fed the wrong hidden state, position or K/V accepts next to nothing."""
    session = Session.load(PAIR_DIR / "target", PAIR_DIR / "assistant")
    decoder = SpeculativeDecoder(session.target, session.drafter, draft_tokens=3, query_offset=QUERY_AT_BONUS)
    rows = decoder.generate([Request(session.encode(p), max_tokens=64) for p in PROMPTS])
    drafted = sum(r.stats.drafted for r in rows)
    accepted = sum(r.stats.accepted for r in rows)
    assert accepted / drafted > 0.3
