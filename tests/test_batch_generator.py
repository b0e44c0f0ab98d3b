"""MTP behind mlx-lm's BatchGenerator API (what oMLX's scheduler drives) against mlx-lm's own
BatchGenerator: same requests, prefilled outside as oMLX does, inserted while others run."""

from __future__ import annotations

import copy
import types

import mlx.core as mx
import numpy as np
import pytest
import importlib
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator

from .conftest import prompts
from .stats import chi_square_p_value
from .test_sampling_lossless import PROMPT, STEPS, VOCAB, MixtureDrafter, exact_joint, small  # noqa: F401

mlx_generate = importlib.import_module("mlx_lm.generate")  # the module, not the function

MAX_TOKENS = 40


def stops(sequences):
    """Per-request stop sequences in the form this mlx-lm's BatchGenerator takes."""
    if hasattr(mlx_generate, "StopSequences"):  # mlx-lm >= 0.32
        return "stop_sequences", mlx_generate.StopSequences(sequences)
    return "state_machines", mlx_generate.SequenceStateMachine({"normal": [(list(s), None) for s in sequences]})


def prefilled(model, prompt):
    """oMLX's external prefill: everything but the last token goes into the cache first."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def run(generator, model, requests, insert_at=None, remove_at=None):
    """Drive a generator like oMLX's scheduler: insert (some later), step, remove finished.
    requests: dicts with prompt and optional per-request extras.  Returns per-request
    (tokens, finish_reason, final cache)."""
    insert_at = insert_at or {}
    uid_of, results, step = {}, {}, 0
    waiting = list(range(len(requests)))
    while waiting or any(i not in results for i in uid_of):
        for i in [i for i in waiting if insert_at.get(i, 0) <= step]:
            waiting.remove(i)
            r = requests[i]
            kwargs = dict(all_tokens=[r["prompt"][:-1]], caches=[prefilled(model, r["prompt"])],
                          max_tokens=[r.get("max_tokens", MAX_TOKENS)])
            for key in ("samplers", "logits_processors", "sampling_params"):
                if key in r and (key != "sampling_params" or isinstance(generator, MTPBatchGenerator)):
                    kwargs[key] = [r[key]]
            if "stops" in r:
                key, value = stops(r["stops"])
                kwargs[key] = [value]
            if "cache" in r:  # a cache, or a function that makes it at insert time
                kwargs["caches"] = [r["cache"]() if callable(r["cache"]) else r["cache"]]
            (uid_of[i],) = generator.insert([r["prompt"][-1:]], **kwargs)
        by_uid = {u: i for i, u in uid_of.items()}
        for response in generator.next_generated():
            i = by_uid[response.uid]
            assert i not in results, "a response after the request finished"
            tokens = requests[i].setdefault("_tokens", [])
            tokens.append(response.token)
            if response.finish_reason is not None:
                requests[i]["_match"] = getattr(response, "match_sequence", None)  # the stop sequence met
                results[i] = (tokens, response.finish_reason, response.prompt_cache)
                generator.remove([response.uid])
        for i, at in (remove_at or {}).items():
            if at == step and i in uid_of and i not in results:
                generator.remove([uid_of[i]])
                results[i] = (requests[i].get("_tokens", []), "aborted", None)
        step += 1
        assert step < 500
    return [results[i] for i in range(len(requests))]


def fresh(requests):
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in copy.deepcopy(requests, memo={})]


def plain_generator(model):
    return mlx_generate.BatchGenerator(model, max_tokens=MAX_TOKENS)


def mtp_generator(pair, drafter, K=3, **kwargs):
    decoder = SpeculativeDecoder(pair.target, drafter, draft_tokens=K)
    return MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=pair.model, max_tokens=MAX_TOKENS, **kwargs)


def continue_greedy(model, cache, token, n=12):
    """Greedy tokens after feeding ``token`` to a copy of ``cache``."""
    cache = copy.deepcopy(cache)
    out = []
    for _ in range(n):
        logits = model(mx.array([[token]]), cache=cache)
        token = mx.argmax(logits[0, -1]).item()
        out.append(token)
    return out


@pytest.fixture(scope="module")
def plain_runs(pair_31b, pair_e2b):
    out = {}
    for name, pair in (("31b", pair_31b), ("e2b", pair_e2b)):
        requests = [{"prompt": p} for p in prompts(6, pair.spec.vocab_size, seed=7)]
        out[name] = (requests, run(plain_generator(pair.model), pair.model, fresh(requests)))
    return out


@pytest.mark.parametrize("drafter_kind", ["oracle", "assistant"])
def test_greedy_continuous_batching_matches_plain(pair, plain_runs, drafter_kind):
    requests, plain = plain_runs[pair.spec.layout]
    if drafter_kind == "oracle":
        continuations = {tuple(r["prompt"]): tokens for r, (tokens, _, _) in zip(requests, plain)}
        drafter = OracleDrafter(continuations, pair.spec.vocab_size, error_rate=0.25, seed=3)
    else:
        drafter = pair.drafter
    generator = mtp_generator(pair, drafter)
    ours = run(generator, pair.model, fresh(requests), insert_at={3: 2, 4: 2, 5: 5})
    for (tokens, reason, cache), (ref_tokens, ref_reason, ref_cache) in zip(ours, plain):
        assert tokens == ref_tokens
        assert reason == ref_reason == "length"
        # The finished cache holds what plain decoding's holds: the same continuation follows.
        assert [c.offset for c in cache] == [c.offset for c in ref_cache]
        assert continue_greedy(pair.model, cache, 5) == continue_greedy(pair.model, ref_cache, 5)
    if drafter_kind == "oracle":
        # Several tokens per step: fewer steps than tokens.
        assert any(len(tokens) > 0 for tokens, _, _ in ours)


def test_stop_sequences_abort_and_max_tokens(pair_31b, plain_runs):
    pair = pair_31b
    requests, plain = plain_runs["31b"]
    requests = fresh(requests)
    stop = plain[0][0][9]
    requests[0]["stops"] = [[stop]]  # stops at its 10th token (or earlier, if it came before)
    requests[1]["stops"] = [list(plain[1][0][4:6])]  # a two-token stop sequence
    requests[2]["max_tokens"] = 7
    plain_requests, mtp_requests = fresh(requests), fresh(requests)
    reference = run(plain_generator(pair.model), pair.model, plain_requests)
    continuations = {tuple(r["prompt"]): tokens for r, (tokens, _, _) in zip(requests, plain)}
    drafter = OracleDrafter(continuations, pair.spec.vocab_size, error_rate=0.1, seed=1)
    ours = run(mtp_generator(pair, drafter, K=4), pair.model, mtp_requests, remove_at={3: 2})
    # Where mlx-lm reports the stop sequence met (0.31's state machines; hosts strip its text), so do we.
    if stops([[0]])[0] == "state_machines":
        assert tuple(plain_requests[1]["_match"]) == tuple(plain[1][0][4:6])
        assert [r.get("_match") for r in mtp_requests] == [r.get("_match") for r in plain_requests]
    assert reference[0][1] == "stop" and reference[0][0][-1] == stop
    assert reference[1][1] == "stop" and reference[2][1] == "length" and len(reference[2][0]) == 7
    for i in (0, 1, 2, 4, 5):
        assert ours[i][:2] == reference[i][:2]
        assert [c.offset for c in ours[i][2]] == [c.offset for c in reference[i][2]]
        assert continue_greedy(pair.model, ours[i][2], 3) == continue_greedy(pair.model, reference[i][2], 3)
    aborted = ours[3][0]
    assert ours[3][1] == "aborted" and aborted == plain[3][0][: len(aborted)]


class NoRepeat:
    """A stateful processor (like a grammar): it learns emitted tokens through accept_token
    and forbids the one it saw last."""

    def __init__(self, seen):
        self.accepted = list(seen)

    def accept_token(self, token):
        self.accepted.append(token)

    def __call__(self, tokens, logits):
        if not self.accepted:
            return logits
        return mx.put_along_axis(logits, mx.array([[self.accepted[-1]]]), mx.array(-mx.inf, logits.dtype), axis=-1)


def no_repeat_pure(tokens, logits):
    return mx.put_along_axis(logits, tokens[-1:][None], mx.array(-mx.inf, logits.dtype), axis=-1)


def test_logits_processors_pure_and_stateful(pair_e2b, plain_runs):
    pair = pair_e2b
    requests, _ = plain_runs["e2b"]
    requests = fresh(requests)[:3]
    requests[0]["logits_processors"] = make_logits_processors(repetition_penalty=1.8, repetition_context_size=8)
    reference_requests = fresh(requests)
    requests[1]["logits_processors"] = [stateful := NoRepeat(requests[1]["prompt"][-1:])]
    reference_requests[1]["logits_processors"] = [no_repeat_pure]  # plain decoding's equivalent
    reference = run(plain_generator(pair.model), pair.model, reference_requests)
    ours = run(mtp_generator(pair, pair.drafter, K=3), pair.model, requests)
    for i in range(3):
        assert ours[i][:2] == reference[i][:2]
    # The stateful row was told exactly the emitted tokens, never a draft.
    assert stateful.accepted[1:] == ours[1][0]
    assert all(a != b for a, b in zip(ours[1][0], ours[1][0][1:]))


class _Opaque(list):
    pass  # a cache list whose layers the MTP loop cannot read


class _Layer:
    def __init__(self, inner):
        self.__dict__["inner"] = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def unreadable(cache) -> list:
    """The same cache behind layers of a type the MTP loop does not know (the host's loop runs it)."""
    return _Opaque(_Layer(c) for c in cache)


def test_unreadable_cache_decodes_plain_inside(pair_31b, plain_runs):
    pair = pair_31b
    requests, plain = plain_runs["31b"]
    requests = fresh(requests)[:3]
    requests[1]["cache"] = unreadable(prefilled(pair.model, requests[1]["prompt"]))
    generator = mtp_generator(pair, pair.drafter, K=2)
    ours = run(generator, pair.model, requests)
    for i in range(3):
        assert ours[i][:2] == plain[i][:2]
    # the host's loop ran it under this loop's uid (oMLX 0.6.2 looks samplers up by model and uid)
    assert generator._plain is not None and generator._from_plain == {} and generator._to_plain == {}
    assert generator._plain._uid_count == 2  # uid 1 was the host loop's one request


@pytest.mark.slow
def test_sampled_rows_have_the_target_distribution(small):  # noqa: F811
    """Sampling parameters given as oMLX gives them: rejection sampling through this API must
    reproduce plain sampling's joint distribution of the first tokens."""
    model, target, _ = small
    host_params = types.SimpleNamespace(temperature=0.8, top_p=0.9, top_k=0, min_p=0.0, xtc_probability=0.0)
    from omlx_mtp.decode.sampling import SamplingParams

    joint = exact_joint(model, SamplingParams(temperature=0.8, top_p=0.9))
    rows = 1000
    decoder = SpeculativeDecoder(target, MixtureDrafter(joint), draft_tokens=2)
    generator = MTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=model, max_tokens=STEPS,
                                  completion_batch_size=rows)
    uids = generator.insert([PROMPT[-1:]] * rows, all_tokens=[PROMPT[:-1]] * rows,
                            caches=[prefilled(model, PROMPT) for _ in range(rows)],
                            samplers=[make_sampler(0.8, 0.9)] * rows, sampling_params=[host_params] * rows)
    out = {uid: [] for uid in uids}
    while any(len(v) < STEPS for v in out.values()):
        for response in generator.next_generated():
            out[response.uid].append(response.token)
    samples = np.array([out[u] for u in uids])
    assert 0.2 < generator.totals.acceptance_rate < 0.98  # rejections and acceptances both sampled
    for position in range(STEPS):
        axes = tuple(a for a in range(STEPS) if a != position)
        counts = np.bincount(samples[:, position], minlength=VOCAB)
        assert chi_square_p_value(counts, joint.sum(axis=axes)) > 1e-3, position
