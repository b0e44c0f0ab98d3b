"""The mlx-vlm peer runs on the same weights as ours: at T=0 it must emit exactly our plain decoding."""

from __future__ import annotations

import pytest

from omlx_mtp.decode.requests import Request
from omlx_mtp.fixtures.demo import PAIR_DIR
from omlx_mtp.tools.peer import peer_available, peer_generate, prepare_peer
from omlx_mtp.tools.session import Session, run_plain

REASON = peer_available()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.skipif(not (PAIR_DIR / "assistant" / "config.json").is_file(),
                       reason="the trained demo pair is not in this checkout"),
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    target, assistant = PAIR_DIR / "target", PAIR_DIR / "assistant"
    session = Session.load(target, assistant)
    peer = prepare_peer(target, assistant, tmp_path_factory.mktemp("peer"))
    return session, peer


@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_greedy_peer_equals_plain_decoding(demo, draft_tokens):
    session, peer = demo
    prompt = session.encode("def parse_args(argv):\n")
    plain = run_plain(session.model, Request(prompt, max_tokens=32)).row.generated
    out = peer_generate(peer, prompt, max_tokens=32, temperature=0.0, draft_tokens=draft_tokens, seed=0)
    assert out["tokens"] == plain
    assert out["seconds"] > 0
    assert 0.0 <= out["acceptance_rate"] <= 1.0
    assert 1.0 <= out["tokens_per_round"] <= draft_tokens + 1


def test_peer_stops_at_stop_token_like_our_decoder(demo):
    session, peer = demo
    prompt = session.encode("def parse_args(argv):\n")
    plain = run_plain(session.model, Request(prompt, max_tokens=16)).row.generated
    stop = plain[5]
    out = peer_generate(peer, prompt, 16, 0.0, 3, 0, stop_tokens={stop})
    assert out["tokens"] == plain[: plain.index(stop)]
