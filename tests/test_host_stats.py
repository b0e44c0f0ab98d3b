"""The strategy's MTP counters (``omlx_mtp/host/stats.py``), fed by MTPBatchGenerator as oMLX's
scheduler drives it, and what the helpers behind oMLX's stats call sites report (no oMLX here)."""

from __future__ import annotations

import importlib
import sys
import threading
import types

import pytest
from mlx_lm.sample_utils import make_sampler

from omlx_mtp.decode.requests import DecodeStats
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.hosts.omlx import call_sites as host
from omlx_mtp.hosts.stats import FALLBACK_REASONS, MTPCounters
from omlx_mtp.hosts.settings import MTPSettings
from omlx_mtp.hosts.strategy import MTPStrategy

from .conftest import prompts
from .test_batch_generator import MAX_TOKENS, NoRepeat, plain_generator, prefilled, run, unreadable

mlx_generate = importlib.import_module("mlx_lm.generate")

COUNTED = ("rounds", "drafted", "accepted")


def strategy_for(pair, drafter=None) -> MTPStrategy:
    decoder = SpeculativeDecoder(pair.target, drafter or pair.drafter, draft_tokens=3, min_acceptance=0.0)
    return MTPStrategy("omlx-mtp", decoder, MTPSettings(mtp_enabled=True, mtp_draft_tokens=3))


def new_generator(strategy, pair):
    """What oMLX's scheduler does at its first request and after each reset."""
    return host.batch_generator(types.SimpleNamespace(decode_strategy=strategy), mlx_generate.BatchGenerator,
                                model=pair.model, max_tokens=MAX_TOKENS)


def insert(generator, pair, prompt, **per_request) -> int:
    """One request, prefilled outside as oMLX does; ``per_request``: insert's per-row lists' values."""
    per_request = {"caches": prefilled(pair.model, prompt), **per_request}
    (uid,) = generator.insert([prompt[-1:]], all_tokens=[prompt[:-1]],
                              **{key: [value] for key, value in per_request.items()})
    return uid


def step(generator, finished: set) -> None:
    for response in generator.next_generated():
        if response.finish_reason is not None:
            finished.add(response.uid)
            generator.remove([response.uid])


def counted(snapshot) -> tuple:
    return tuple(snapshot[k] for k in COUNTED)


def oracle(pair, requests) -> OracleDrafter:
    """Drafts from the target's own continuations, a quarter of them wrong: drafts accepted and rejected."""
    plain = run(plain_generator(pair.model), pair.model, [{"prompt": p} for p in requests])
    return OracleDrafter({tuple(p): tokens for p, (tokens, _, _) in zip(requests, plain)}, pair.spec.vocab_size,
                         error_rate=0.25, seed=3)


def test_counters_move_during_requests_and_pool_across_generators(pair_31b):
    pair = pair_31b
    requests = prompts(4, pair.spec.vocab_size, seed=21)
    strategy = strategy_for(pair, oracle(pair, requests))
    assert strategy.stats.snapshot() == {"enabled": True, "requests": 0, "running": 0, "rounds": 0, "drafted": 0,
                                         "accepted": 0, "acceptance_rate": 0.0, "tokens_per_round": 0.0,
                                         "drafting_rounds": 0, "plain_steps": 0, "probes": 0, "depths": {},
                                         "fallbacks": dict.fromkeys(FALLBACK_REASONS, 0)}
    first = new_generator(strategy, pair)
    uids = [insert(first, pair, p) for p in requests[:2]]
    finished, seen = set(), []
    while not finished >= set(uids):
        step(first, finished)
        seen.append(strategy.stats.snapshot())
    while_running = [s for s in seen if s["running"] == 2]
    assert seen[0]["requests"] == 2 and len(while_running) >= 3
    assert while_running[1]["drafted"] > 0
    # Every step with both requests running moved the counters: they don't wait for a request's end.
    rounds = [s["rounds"] for s in while_running]
    assert rounds == sorted(set(rounds)) and rounds[-1] > rounds[0]
    done = seen[-1]
    assert done["running"] == 0 and done["requests"] == 2
    assert counted(done) == (first.totals.rounds, first.totals.drafted, first.totals.accepted)
    assert done["tokens_per_round"] == round(first.totals.tokens_per_round, 4) > 1.0
    # what auto did: every round a drafting round (at some depth) or a plain step
    assert done["drafting_rounds"] + done["plain_steps"] == done["rounds"]
    assert sum(done["depths"].values()) == done["drafting_rounds"] > 0 and done["probes"] <= done["drafting_rounds"]
    assert sum(int(k) * n for k, n in done["depths"].items()) == done["drafted"]
    assert done["acceptance_rate"] == round(first.totals.acceptance_rate, 4) < 1.0

    # oMLX resets: the generator is thrown away mid-request and the strategy makes another.
    abandoned = insert(first, pair, requests[2])
    for _ in range(3):
        step(first, finished)
    assert abandoned not in finished and strategy.stats.snapshot()["running"] == 1
    second = new_generator(strategy, pair)
    at_reset = strategy.stats.snapshot()
    assert at_reset["running"] == 0 and at_reset["requests"] == 3 and at_reset["rounds"] > done["rounds"]
    again, finished = insert(second, pair, requests[3]), set()  # uids start again from 0
    while again not in finished:
        step(second, finished)
    end = strategy.stats.snapshot()
    assert end["requests"] == 4 and end["running"] == 0
    assert counted(end) == tuple(a + getattr(second.totals, k) for a, k in zip(counted(at_reset), COUNTED))


def test_each_fallback_counted_by_reason(pair_31b):
    pair = pair_31b
    strategy = strategy_for(pair)
    generator = new_generator(strategy, pair)
    p = prompts(4, pair.spec.vocab_size, seed=5)
    mtp = insert(generator, pair, p[0])
    insert(generator, pair, p[1], caches=unreadable(prefilled(pair.model, p[1])))
    xtc = types.SimpleNamespace(temperature=0.0, top_p=0.0, top_k=0, min_p=0.0, xtc_probability=0.5)
    insert(generator, pair, p[2], samplers=make_sampler(0.0), sampling_params=xtc)
    insert(generator, pair, p[3], logits_processors=[NoRepeat(p[3][-1:])])
    finished: set = set()
    step(generator, finished)
    admitted = strategy.stats.snapshot()
    assert admitted["fallbacks"] == {"cache": 1, "sampler": 1, "logits_processor": 1}
    assert admitted["requests"] == 1 and admitted["running"] == 1
    row = generator._rows[mtp]
    while len(finished) < 4:
        step(generator, finished)
    end = strategy.stats.snapshot()
    # Only the MTP request's rounds count; the requests decoding plain inside the loop don't.
    assert counted(end) == (row.stats.rounds, row.stats.drafted, row.stats.accepted)
    assert end["rounds"] < generator.totals.rounds and end["running"] == 0


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_BASE_PATH", str(tmp_path / "omlx"))
    (tmp_path / "omlx" / "model_settings").mkdir(parents=True)
    return tmp_path / "omlx" / "model_settings"


def test_models_asking_for_mtp_without_it_report_why(pair_31b, base, tmp_path):
    (base / "demo-bad.yaml").write_text(f"mtp_enabled: true\nmtp_drafter: {tmp_path / 'missing'}\n")
    (base / "demo-off.yaml").write_text("mtp_enabled: false\n")
    scheduler = types.SimpleNamespace()
    assert host.attach_decode_strategy(scheduler, pair_31b.model, str(tmp_path / "demo-bad")) is None
    stats = host.mtp_stats(scheduler)
    assert stats["enabled"] is False and str(tmp_path / "missing") in stats["reason"]
    assert host.mtp_fields(scheduler) == {"mtp": stats}
    off = types.SimpleNamespace()
    host.attach_decode_strategy(off, pair_31b.model, str(tmp_path / "demo-off"))
    assert host.mtp_stats(off) is None and host.mtp_fields(off) == {}  # not asked for: no key

    # An engine without MTP call sites, by model id (the pool's view), until the model loads again.
    (base / "demo-emb.yaml").write_text("mtp_enabled: true\n")
    embedding = type("EmbeddingEngine", (), {})()
    host.engine_built(embedding, "demo-emb")
    assert host.mtp_fields(embedding, "demo-emb") == {"mtp": {
        "enabled": False, "reason": "oMLX serves it with EmbeddingEngine, which has no MTP support"}}
    assert host.mtp_fields(None, "demo-emb") == {}  # not loaded
    host.engine_built(type("BatchedEngine", (), {})(), "demo-emb")
    assert host.mtp_stats("demo-emb") is None


def test_turboquant_kv_is_said_and_reported(pair_31b, base, tmp_path, caplog):
    """oMLX records TurboQuant's bits on the scheduler before the plugin attaches: the model's log
    says what it means for MTP once, and its stats carry the setting."""
    (base / "demo-tq.yaml").write_text(f"mtp_enabled: true\nmtp_drafter: {pair_31b.drafter_dir}\n")
    reports = []
    for bits in (4.0, None):
        scheduler = types.SimpleNamespace(_turboquant_kv_bits=bits)
        with caplog.at_level("INFO", logger="omlx_mtp"):
            assert host.attach_decode_strategy(scheduler, pair_31b.model, str(tmp_path / "demo-tq")) is not None
        reports.append(host.mtp_stats(scheduler))
    assert reports[0]["turboquant_kv"] == {"bits": 4.0} and "turboquant_kv" not in reports[1]
    said = [r.getMessage() for r in caplog.records if "TurboQuant" in r.getMessage()]
    assert len(said) == 1 and "demo-tq has TurboQuant KV (4 bits) on" in said[0]


def test_a_generator_that_fails_to_start_reports_it(pair_31b):
    strategy = strategy_for(pair_31b)
    scheduler = types.SimpleNamespace(decode_strategy=strategy)
    working = strategy.batch_generator

    def broken(*args, **kwargs):
        raise RuntimeError("no room")

    strategy.batch_generator = broken
    plain = host.batch_generator(scheduler, mlx_generate.BatchGenerator, model=pair_31b.model, max_tokens=4)
    assert type(plain) is mlx_generate.BatchGenerator
    stats = host.mtp_stats(scheduler)
    assert stats["enabled"] is False and "RuntimeError: no room" in stats["reason"]
    strategy.batch_generator = working
    host.batch_generator(scheduler, mlx_generate.BatchGenerator, model=pair_31b.model, max_tokens=4)
    assert host.mtp_stats(scheduler)["enabled"] is True and "reason" not in host.mtp_stats(scheduler)


def test_stats_that_raise_never_break_the_hosts_stats():
    class Raising:
        def snapshot(self):
            raise ValueError("counters gone")

    scheduler = types.SimpleNamespace(decode_strategy=types.SimpleNamespace(stats=Raising()))
    assert {"num_running": 0, **host.mtp_fields(scheduler)} == {"num_running": 0}
    # oMLX's own tests hand mocks around: nothing that isn't our counters' dict is reported.
    from unittest.mock import MagicMock

    assert host.mtp_fields(MagicMock(), "no-such-model") == {}


def test_counters_are_exact_under_threads():
    counters = MTPCounters()
    serial = counters.generator_started()

    def work():
        for _ in range(500):
            counters.admitted(serial)
            counters.add(DecodeStats(rounds=1, drafted=3, accepted=2, emitted=3))
            counters.fell_back("sampler")
            counters.finished(serial)
            counters.snapshot()

    threads = [threading.Thread(target=work) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between a read and its write, where the lock matters
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    snap = counters.snapshot()
    assert (snap["requests"], snap["running"], *counted(snap)) == (2000, 0, 2000, 6000, 4000)
    assert snap["acceptance_rate"] == round(4000 / 6000, 4) and snap["tokens_per_round"] == 3.0
    assert snap["fallbacks"]["sampler"] == 2000
