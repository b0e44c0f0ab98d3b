"""Boundary snapshots of running MTP requests, as oMLX's paged SSD cache takes them.

oMLX's scheduler (``_maybe_capture_boundary_snapshot``) asks ``extract_cache([uid])`` after every
response that leaves a request at a multiple of the cache block size (prompt + output tokens) and
files what comes back under that count.  mlx-lm's own BatchGenerator is the reference: the same
requests, prefilled outside and inserted as oMLX does, must give a snapshot at the same counts, of
the same layer types and lengths, from which decoding continues exactly as from mlx-lm's."""

from __future__ import annotations

import copy
import importlib
import math
import types

import pytest

from omlx_mtp.decode.requests import RowState
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.hosts.omlx import call_sites as host
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.targets import wrap_target
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.fixtures.tiny_qwen import TinyQwenSpec, write_qwen

from .conftest import prompts
from .test_batch_generator import continue_greedy, prefilled

mlx_generate = importlib.import_module("mlx_lm.generate")

INTERVAL = 8  # tokens per "block": small, so every request crosses several boundaries
MAX_TOKENS = 30
RESUMED = 4  # tokens decoded from each snapshot


def drive(generator, model, prompts_, insert_at=None, interval=INTERVAL, on_step=None):
    """Drive ``generator`` as oMLX's scheduler does and capture boundary snapshots as it does:
    after each response that does not finish its request, when prompt + output tokens are a
    multiple of ``interval``.  Returns (tokens per request, {(request, count): (cache, tokens)})."""
    insert_at = insert_at or {}
    uid_of, tokens, finished, snapshots, step = {}, {}, set(), {}, 0
    while len(finished) < len(prompts_):
        for i, prompt in enumerate(prompts_):
            if i not in uid_of and insert_at.get(i, 0) <= step:
                (uid_of[i],) = generator.insert([prompt[-1:]], caches=[prefilled(model, prompt)],
                                                all_tokens=[prompt[:-1]], max_tokens=[MAX_TOKENS])
                tokens[i] = []
        request_of = {uid: i for i, uid in uid_of.items()}
        for response in generator.next_generated():
            i = request_of[response.uid]
            tokens[i].append(response.token)
            count = len(prompts_[i]) + len(tokens[i])  # oMLX's request.num_tokens
            if response.finish_reason is not None:
                finished.add(i)
                generator.remove([response.uid])
            elif count % interval == 0:
                found = generator.extract_cache([response.uid])
                if response.uid in found:
                    snapshots[i, count] = copy.deepcopy(found[response.uid])
        if on_step is not None:
            on_step(step, uid_of)
        step += 1
        assert step < 200
    return [tokens[i] for i in range(len(prompts_))], snapshots


def mtp_generator(model, target, drafter, K=4, interval=INTERVAL):
    decoder = SpeculativeDecoder(target, drafter, draft_tokens=K)
    return MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=model, max_tokens=MAX_TOKENS,
                             snapshot_interval=interval)


def check_like_mlx_lm(model, prompts_, reference, ours) -> None:
    """Same tokens; a snapshot wherever mlx-lm gave one, of the same layer types and lengths,
    from which decoding goes on as from mlx-lm's (and as the request itself went on)."""
    (ref_tokens, ref_snapshots), (tokens, snapshots) = reference, ours
    assert tokens == ref_tokens
    assert ref_snapshots, "the reference took no snapshot: the test would prove nothing"
    assert sorted(snapshots) == sorted(ref_snapshots)
    for (i, count), (ref_cache, ref_all) in ref_snapshots.items():
        cache, all_tokens = snapshots[i, count]
        assert all_tokens == ref_all == (prompts_[i] + tokens[i])[:count]
        assert [type(c).__name__ for c in cache] == [type(c).__name__ for c in ref_cache]
        assert layer_lengths(cache) == layer_lengths(ref_cache)
        following = tokens[i][count - len(prompts_[i]):]
        resumed = continue_greedy(model, cache, following[0], RESUMED)
        assert resumed == continue_greedy(model, ref_cache, following[0], RESUMED)
        assert resumed[: len(following) - 1] == following[1 : RESUMED + 1]


def layer_lengths(cache) -> list:
    """Per layer: tokens seen (K/V caches), or the state's shapes (linear-attention layers)."""
    return [c.offset if hasattr(c, "offset") else [tuple(a.shape) for a in c.cache] for c in cache]


def oracle_for(reference, prompts_, vocab: int, seed: int = 1) -> OracleDrafter:
    """A drafter that knows plain decoding's continuations, wrong a fifth of the time: rounds
    keep several tokens, a different number each time."""
    continuations = {tuple(p): t for p, t in zip(prompts_, reference[0])}
    return OracleDrafter(continuations, vocab, error_rate=0.2, seed=seed)


# -- Gemma 4: sliding layers (rotating caches) -------------------------------------------------
@pytest.fixture(scope="module")
def gemma(pair_31b):
    batch = prompts(4, pair_31b.spec.vocab_size, seed=21, lengths=(5, 13, 22, 37))
    reference = drive(mlx_generate.BatchGenerator(pair_31b.model, max_tokens=MAX_TOKENS), pair_31b.model, batch,
                      insert_at={2: 3, 3: 5})
    return types.SimpleNamespace(pair=pair_31b, prompts=batch, reference=reference,
                                 oracle=oracle_for(reference, batch, pair_31b.spec.vocab_size))


def run_gemma(gemma, drafter=None, **kwargs):
    pair = gemma.pair
    generator = mtp_generator(pair.model, pair.target, drafter or gemma.oracle)
    return drive(generator, pair.model, gemma.prompts, insert_at={2: 3, 3: 5}, **kwargs), generator


def test_gemma_snapshots_match_mlx_lm(gemma):
    ours, generator = run_gemma(gemma)
    check_like_mlx_lm(gemma.pair.model, gemma.prompts, gemma.reference, ours)
    # Past the 16-token window: the rotating caches had wrapped when snapshots were taken.
    assert max(count for _, count in ours[1]) > 2 * gemma.pair.spec.sliding_window
    assert generator.totals.accepted > generator.totals.rounds  # several tokens per round


def test_gemma_snapshots_with_its_assistant(gemma):
    ours, _ = run_gemma(gemma, drafter=gemma.pair.drafter)
    check_like_mlx_lm(gemma.pair.model, gemma.prompts, gemma.reference, ours)


def test_without_the_cap_boundaries_are_missed(gemma, monkeypatch):
    """The mutant the cap exists for: rounds that run past a boundary leave it without a snapshot."""
    monkeypatch.setattr(RowState, "until_snapshot", property(lambda self: math.inf))
    ours, _ = run_gemma(gemma)
    with pytest.raises(AssertionError):
        check_like_mlx_lm(gemma.pair.model, gemma.prompts, gemma.reference, ours)
    assert ours[0] == gemma.reference[0]  # still lossless: only snapshots went missing
    assert 0 < len(ours[1]) < len(gemma.reference[1])


def test_plain_stretches_end_on_boundaries(gemma):
    """A drafter-less depth (every round a plain stretch) still stops at each row's boundary."""
    pair = gemma.pair
    generator = mtp_generator(pair.model, pair.target, gemma.oracle, K=0)
    ours = drive(generator, pair.model, gemma.prompts, insert_at={2: 3, 3: 5})
    check_like_mlx_lm(pair.model, gemma.prompts, gemma.reference, ours)


def test_sparse_rows_and_rows_off_boundaries_hand_back_nothing(gemma):
    """A sparse-prefilled row (its cache holds fewer tokens than the request) takes no snapshot;
    the others still do.  Between boundaries a running row hands back nothing."""
    pair = gemma.pair
    generator = mtp_generator(pair.model, pair.target, gemma.oracle)
    off_boundary = []

    def mark(step, uid_of):
        if 0 in uid_of and uid_of[0] in generator._rows:
            generator._rows[uid_of[0]].sparse = True
        for uid, row in generator._rows.items():
            if row.num_tokens % INTERVAL:
                off_boundary.append(generator.extract_cache([uid]))

    tokens, snapshots = drive(generator, pair.model, gemma.prompts, insert_at={2: 3, 3: 5}, on_step=mark)
    assert tokens == gemma.reference[0]
    assert not any(i == 0 for i, _ in snapshots)
    assert sorted(snapshots) == sorted(key for key in gemma.reference[1] if key[0] != 0)
    assert off_boundary and not any(off_boundary)


def test_no_interval_no_snapshot(gemma):
    pair = gemma.pair
    generator = mtp_generator(pair.model, pair.target, gemma.oracle, interval=0)
    tokens, snapshots = drive(generator, pair.model, gemma.prompts, insert_at={2: 3, 3: 5})
    assert tokens == gemma.reference[0] and not snapshots


# -- Qwen3.5: linear-attention states, a head with its own K/V ---------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    spec = TinyQwenSpec()
    directory = write_qwen(tmp_path_factory.mktemp("qwen-snapshots"), spec)
    model, _, _ = load_target(directory, with_tokenizer=False)
    target = wrap_target(model)
    batch = prompts(3, spec.vocab_size, seed=23, lengths=(6, 19, 30))
    reference = drive(mlx_generate.BatchGenerator(model, max_tokens=MAX_TOKENS), model, batch, insert_at={2: 4})
    return types.SimpleNamespace(model=model, target=target, head=load_merged_drafter(directory, target),
                                 prompts=batch, reference=reference,
                                 oracle=oracle_for(reference, batch, spec.vocab_size))


@pytest.mark.parametrize("drafter", ["oracle", "head"])
def test_qwen_snapshots_match_mlx_lm(qwen, drafter):
    generator = mtp_generator(qwen.model, qwen.target, getattr(qwen, drafter), K=3)
    ours = drive(generator, qwen.model, qwen.prompts, insert_at={2: 4})
    check_like_mlx_lm(qwen.model, qwen.prompts, qwen.reference, ours)
    assert any(type(c).__name__ == "ArraysCache" for c in next(iter(ours[1].values()))[0])


# -- the interval reaches the generator -------------------------------------------------------
class _Strategy:
    name = "fake"

    def __init__(self, takes_interval: bool):
        self.got = None
        if takes_interval:
            self.batch_generator = lambda factory, snapshot_interval=0, **kwargs: self._made(snapshot_interval)
        else:
            self.batch_generator = lambda factory, **kwargs: self._made(kwargs.get("snapshot_interval"))

    def _made(self, interval):
        self.got = interval
        return self


def _scheduler(strategy, paged: bool, needs_snapshots: bool = True, block_size: int = 64):
    return types.SimpleNamespace(decode_strategy=strategy, block_aware_cache=object() if paged else None,
                                 config=types.SimpleNamespace(paged_cache_block_size=block_size),
                                 _detect_boundary_snapshot_need=lambda: needs_snapshots)


@pytest.mark.parametrize("paged, needs, takes, expected", [
    (True, True, True, 64),     # paged cache, a model with rotating / linear layers
    (False, True, True, 0),     # no paged cache: no snapshots
    (True, False, True, 0),     # only sliceable caches: oMLX takes no boundary snapshots
    (True, True, False, None),  # a strategy that does not name the parameter never gets it
])
def test_block_size_reaches_the_strategy(paged, needs, takes, expected):
    strategy = _Strategy(takes)
    assert host.batch_generator(_scheduler(strategy, paged, needs), factory=None) is strategy
    assert strategy.got == expected
