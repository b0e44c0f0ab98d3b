"""A served prompt in segments (``omlx-mtp serve``): prefilled a chunk per generator step, each
segment's end reported with the cache there, as mlx-lm's own generator does, so that mlx-lm's
server files the same prompt caches (a shared system prompt, the prompt before its last token)
and streams the same prefill progress.  The shipped demo Qwen3.5 (float32, trained head), whose
linear-attention caches can't be trimmed: those boundary caches are the only prefixes a later
request can reuse."""

from __future__ import annotations

import copy
import importlib

import mlx.core as mx
import pytest

from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.decode import cache as caches
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.fixtures.demo import demo_qwen
from omlx_mtp.hosts.mlx_lm_server import ServerMTPBatchGenerator
from omlx_mtp.hosts.prompt_segments import split_segments
from omlx_mtp.targets import wrap_target

from .conftest import prompts

mlx_generate = importlib.import_module("mlx_lm.generate")
STEP = 7  # the server's prefill_step_size: segments take several chunks
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    directory = demo_qwen(tmp_path_factory.mktemp("qwen"))
    model, _, _ = load_target(directory)
    target = wrap_target(model)
    return model, target, load_merged_drafter(directory, target)


def segmented(qwen, seed: int) -> list[list[int]]:
    """A system prompt, a user turn and a short tail, as mlx-lm's server splits a chat prompt."""
    return [prompts(1, qwen[1].vocab_size, seed=seed + i, lengths=(n,))[0] for i, n in enumerate((19, 23, 5))]


def serve(generator, requests: list[list[list[int]]], remove_after: dict | None = None, cached=None) -> dict:
    """Drive a generator as mlx-lm's server does: insert each request's segments, step, file the
    cache at every segment end it reports, remove a request where asked (after that many of its
    progress reports).  ``cached``: per request, (tokens, cache) its prompt cache held (the server
    then inserts only the segments after them).  Returns per request: tokens, filed (tokens,
    cache), progress reports."""
    uids = []
    for i, segments in enumerate(requests):
        done, cache = cached[i] if cached else ([], None)
        uids += generator.insert_segments([segments], max_tokens=[MAX_TOKENS], all_tokens=[list(done)],
                                          caches=[copy.deepcopy(cache)] if cache else None)
    out = {uid: dict(tokens=[], filed=[], progress=[], done=False) for uid in uids}
    remove_after = {uids[i]: n for i, n in (remove_after or {}).items()}
    while not all(r["done"] for r in out.values()):
        progress, responses = generator.next()
        for r in progress:
            out[r.uid]["progress"].append((r.progress, r.end_of_segment, r.end_of_prompt))
        ends = [r.uid for r in progress if r.end_of_segment and not r.end_of_prompt]
        for uid, (cache, key) in generator.extract_cache(ends).items():
            out[uid]["filed"].append((list(key), cache))
        for r in responses:
            assert not out[r.uid]["done"], "a response after the request finished or was removed"
            out[r.uid]["tokens"].append(r.token)
            out[r.uid]["done"] = r.finish_reason is not None
        for uid in [uid for uid, n in remove_after.items() if len(out[uid]["progress"]) >= n]:
            generator.remove([uid])
            out[uid]["done"] = True
            del remove_after[uid]
    return [out[uid] for uid in uids]


def mtp_generator(qwen, K=3):
    model, target, head = qwen
    decoder = SpeculativeDecoder(target, head, draft_tokens=K)
    return ServerMTPBatchGenerator(decoder, mlx_generate.BatchGenerator, model=model, max_tokens=MAX_TOKENS,
                                   prefill_step_size=STEP)


def host_generator(qwen):
    return mlx_generate.BatchGenerator(qwen[0], max_tokens=MAX_TOKENS, prefill_step_size=STEP)


def assert_same_cache(mine: list, theirs: list):
    assert [type(c).__name__ for c in mine] == [type(c).__name__ for c in theirs]
    for a, b in zip(mine, theirs):
        if type(a).__name__ == "ArraysCache":
            assert all(mx.allclose(x, y, atol=1e-5).item() for x, y in zip(a.cache, b.cache))
        else:
            assert a.offset == b.offset
            assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-5).item()
            assert mx.allclose(a.values[..., : a.offset, :], b.values[..., : b.offset, :], atol=1e-5).item()


def test_segment_ends_file_the_caches_mlx_lm_files_and_decoding_is_unchanged(qwen):
    requests = [segmented(qwen, seed) for seed in (1, 20)]
    theirs = serve(host_generator(qwen), requests)
    generator = mtp_generator(qwen)
    ours = serve(generator, requests)
    for segments, mine, ref in zip(requests, ours, theirs):
        prompt = [t for s in segments for t in s]
        # The caches filed: after the system prompt, after the user turn, before the last token.
        assert [key for key, _ in mine["filed"]] == [key for key, _ in ref["filed"]] == [
            prompt[:19], prompt[:42], prompt[:-1]]
        for (_, cache), (_, ref_cache) in zip(mine["filed"], ref["filed"]):
            assert_same_cache(cache, ref_cache)
        assert mine["tokens"] == ref["tokens"] and len(mine["tokens"]) == MAX_TOKENS
        done = [p[0] for p, _, _ in mine["progress"]]
        assert done == sorted(done) and mine["progress"][-1] == ((len(prompt), len(prompt)), True, True)
        assert sum(end and not last for _, end, last in mine["progress"]) == 3
        assert len(mine["progress"]) >= len(prompt) // STEP  # a chunk per step, as the server's prefill step
    assert generator.totals.drafted > 0 and generator.totals.accepted > 0
    # A later request with the first one's system prompt starts from the cache filed for it.
    later = [requests[0][0], *segmented(qwen, 60)[1:]]
    ref_later = serve(host_generator(qwen), [later[1:]], cached=[(later[0], theirs[0]["filed"][0][1])])[0]
    our_later = serve(generator, [later[1:]], cached=[(later[0], ours[0]["filed"][0][1])])[0]
    prompt = [t for s in later for t in s]
    assert [key for key, _ in our_later["filed"]] == [key for key, _ in ref_later["filed"]] == [prompt[:42],
                                                                                             prompt[:-1]]
    assert our_later["tokens"] == ref_later["tokens"]


def test_a_request_removed_while_its_segments_prefill_leaves_the_others_unchanged(qwen):
    """A client that hangs up during the prefill: its request is removed mid-segment; it reports
    nothing more, and the request behind it decodes as it would alone."""
    requests = [segmented(qwen, seed) for seed in (30, 40)]
    alone = serve(host_generator(qwen), requests[1:])[0]
    ours = serve(mtp_generator(qwen), requests, remove_after={0: 2})
    assert len(ours[0]["progress"]) == 2 and not ours[0]["tokens"]
    assert ours[1]["tokens"] == alone["tokens"]


def test_a_prompt_prefilled_in_parts_leaves_the_caches_one_prefill_leaves(qwen):
    """Target and head caches after a prompt fed in three parts (each handing the next the hidden
    state at its end) equal those after one prefill: the head's pair at each part's first
    position is kept, not hidden for want of the hidden state before it."""
    _, target, head = qwen
    decoder = SpeculativeDecoder(target, head, draft_tokens=3, prefill_step=5)
    prompt = [t for s in segmented(qwen, 50) for t in s]
    whole, hidden, logits = decoder.prefill_one(prompt, 4)
    cache = decoder.make_cache(1, slack=decoder.prefill_slack(4))
    previous = decoder.prefill_part(prompt[:19], cache)
    previous = decoder.prefill_part(prompt[19:42], cache, previous, settle=True)
    parts, part_hidden, part_logits = decoder.prefill_one(prompt[42:], 4, cache=cache, previous=previous)
    assert mx.allclose(hidden, part_hidden, atol=1e-5).item() and mx.allclose(logits, part_logits, atol=1e-4).item()
    assert caches.lengths_of(parts) == caches.lengths_of(whole)
    for a, b in zip(caches.tables_of(parts), caches.tables_of(whole)):
        assert mx.array_equal(a.positions, b.positions).item()
    for a, b in zip(parts, whole):
        assert all(mx.allclose(x, y, atol=1e-5).item() for x, y in zip(a.state, b.state))


def test_the_split_is_mlx_lm_s():
    assert split_segments([[1, 2], [], [3, 4, 5]]) == [[1, 2], [3, 4], [5]]
    assert split_segments([[1, 2], [3]]) == [[1, 2], [3]]
    assert split_segments([[7]]) == [[7]]
