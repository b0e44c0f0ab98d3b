"""Adaptive draft depth: the choice follows acceptance and cost, and output stays lossless."""

from __future__ import annotations

import pytest

from omlx_mtp.decode.adaptive import DepthController
from omlx_mtp.decode.loop import Request, SpeculativeDecoder
from omlx_mtp.decode.oracle import OracleDrafter
from omlx_mtp.runner import run_plain

from .conftest import prompts


def feed(controller, acceptance: float, base: float = 1.0, per_draft: float = 0.3, rounds: int = 60):
    """Simulate rounds whose drafts are accepted at a fixed rate and whose cost is linear in k."""
    chosen = []
    for i in range(rounds):
        k = controller.choose()
        chosen.append(k)
        accepted = [min(k, int(acceptance * (k + 1)))] if k else []
        controller.observe(k, accepted, base + per_draft * k)
    return chosen


def test_high_acceptance_and_cheap_drafts_go_deep():
    chosen = feed(DepthController(max_depth=6), acceptance=0.95, per_draft=0.1)
    assert min(chosen[-20:]) >= 4


def test_useless_drafts_fall_back_to_plain_and_reprobe():
    controller = DepthController(max_depth=6, probe_every=8)
    chosen = feed(controller, acceptance=0.0, per_draft=0.4, rounds=80)
    tail = chosen[-40:]
    assert tail.count(0) >= 30  # plain decoding most of the time
    assert any(k > 0 for k in tail)  # but it keeps probing


def test_one_rejected_first_round_does_not_send_a_good_drafter_away():
    controller = DepthController(max_depth=4, probe_every=16)
    k = controller.choose()
    controller.observe(k, [0], 1.0 + 0.3 * k)  # unlucky start
    chosen = feed(controller, acceptance=0.9, per_draft=0.3, rounds=30)
    assert chosen[:16].count(0) <= 2 and min(chosen[-10:]) >= 2


def test_rejected_probes_back_off_and_an_accepted_one_opens_a_trial():
    controller = DepthController(max_depth=1, probe_every=4, max_probe_every=64, trial_rounds=3)
    controller.times = {0: 1.0, 1: 2.0}  # a draft round costs two plain ones
    for _ in range(10):  # and drafts have been rejected: plain wins
        controller.observe(1, [0], None)
    waits = []
    for _ in range(2):  # rejected probes: each doubles the wait before the next
        plain = 0
        while (k := controller.choose()) == 0:
            plain += 1
        controller.observe(k, [0], None)
        waits.append(plain)
    assert waits == [3, 7]  # a probe ends each wait (4, then 8 rounds)
    while (k := controller.choose()) == 0:
        pass
    controller.observe(k, [1], None)  # an accepted probe: three drafting rounds follow
    trial = [controller.choose() for _ in range(3)]
    assert trial == [1, 1, 1]
    for _ in range(3):
        controller.observe(1, [0], None)  # the trial's drafts are rejected
    assert controller.choose() == 0  # and plain decoding wins again


def test_min_acceptance_forces_plain():
    controller = DepthController(max_depth=4, min_acceptance=0.9, probe_every=1000)
    chosen = feed(controller, acceptance=0.5, per_draft=0.01, rounds=40)
    assert chosen[-10:] == [0] * 10


@pytest.fixture
def memory_bound_costs(monkeypatch):
    """Round times from a cost model instead of this machine's clock, so the depth choices below do
    not depend on its speed: a plain step costs 1, a round of k drafts 1 + 0.1 k (a verify reads the
    weights once, as on a memory-bound GPU; drafts are cheap).  Untimed rounds stay untimed."""
    from omlx_mtp.decode.loop import LiveBatch

    observe = LiveBatch._observe

    def modelled(self, caps, accepted, seconds):
        return observe(self, caps, accepted, None if seconds is None else 1.0 + 0.1 * max(caps, default=0))

    monkeypatch.setattr(LiveBatch, "_observe", modelled)


@pytest.mark.parametrize("error_rate", [0.0, 0.5, 1.0])
def test_auto_depth_is_lossless(pair_31b, error_rate, memory_bound_costs):
    batch = prompts(6, pair_31b.spec.vocab_size, seed=9)
    references = {tuple(p): run_plain(pair_31b.model, Request(p, max_tokens=48)).row.generated for p in batch}
    oracle = OracleDrafter(references, pair_31b.spec.vocab_size, error_rate=error_rate, seed=3)
    decoder = SpeculativeDecoder(pair_31b.target, oracle, draft_tokens="auto", max_draft_tokens=6)
    rows = decoder.generate([Request(p, max_tokens=48) for p in batch])
    for prompt, row in zip(batch, rows):
        assert row.generated == references[tuple(prompt)]
    drafted, rounds = sum(r.stats.drafted for r in rows), sum(r.stats.rounds for r in rows)
    if error_rate == 1.0:  # drafts never right: most rounds are plain ones
        assert drafted < rounds
    if error_rate == 0.0:  # always right: the batch drafts deep
        assert drafted > 2 * rounds
    assert decoder.batch_controllers  # six rows decode together: one depth per batch size


def test_fixed_depth_falls_back_below_min_acceptance_and_reprobes():
    controller = DepthController(max_depth=3, min_acceptance=0.3, probe_every=4, fixed=True)
    assert controller.choose() == 3
    for _ in range(6):  # every draft rejected
        controller.observe(3, [0], 0.01)
    chosen = [controller.choose() for _ in range(8)]
    assert chosen[:3] == [0, 0, 0] and chosen[3] == 3  # plain rounds, then a probe at the fixed depth
    for _ in range(20):  # the text became predictable
        controller.observe(3, [3], 0.01)
    assert controller.choose() == 3


def test_rounds_that_compiled_a_graph_are_not_timed(pair_31b):
    decoder = SpeculativeDecoder(pair_31b.target, pair_31b.drafter, draft_tokens="auto")
    batch = decoder.batch()
    rows = [batch.new_row(Request(prompts(1, pair_31b.spec.vocab_size)[0], max_tokens=40))]
    cache, hidden, logits = decoder._prefill([rows[0].request], slack=batch.max_depth + 1)
    batch.start(rows, cache, hidden, logits)
    controller = rows[0].controller
    rows[0].pending_depth = 2
    before = decoder.traces_made
    batch.round()  # a fresh decoder: this round traces its graphs
    assert decoder.traces_made > before and 2 not in controller.times
    rows[0].pending_depth = 2
    before = decoder.traces_made
    batch.round()  # same shapes: nothing traced, so the round is timed
    assert decoder.traces_made == before and 2 in controller.times
