"""MTP through the mlx-vlm target path (multimodal Gemma 4, as oMLX's VLM engine loads it):
float32 greedy output equals plain decoding token for token, for text prompts past the sliding
window and for image prompts, directly and behind the BatchGenerator API with host-prefilled
caches (mixed image and text requests joining at different steps)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from mlx_lm.generate import BatchGenerator  # noqa: E402

from omlx_mtp.decode.compiled_forward import compiled_forward_exact  # noqa: E402
from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter  # noqa: E402
from omlx_mtp.drafters import load_drafter  # noqa: E402
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator  # noqa: E402
from omlx_mtp.checkpoint.loading import load_target  # noqa: E402
from omlx_mtp.tools.session import run_plain  # noqa: E402
from omlx_mtp.targets import Gemma4MlxVlmTarget, wrap_target  # noqa: E402
from omlx_mtp.decode.target import prefill_on_host
from omlx_mtp.fixtures.tiny import TinySpec, write_assistant  # noqa: E402
from omlx_mtp.tools.multimodal import embedded_request  # noqa: E402
from omlx_mtp.fixtures.tiny_vlm import write_tiny_vlm  # noqa: E402

from .conftest import prompts  # noqa: E402

MAX_TOKENS = 40  # > 2x the sliding window of 16
SPECS = {
    "31b": TinySpec(layout="31b", model_type="gemma4", k_eq_v=True),
    "e2b": TinySpec(layout="e2b", model_type="gemma4", num_layers=6, centroid_head=True),
}


class VlmPair:
    def __init__(self, directory, spec, audio):
        self.spec, self.audio = spec, audio
        self.dir = write_tiny_vlm(directory / "target", spec, audio=audio)
        self.model, self.tokenizer, self.config = load_target(self.dir)
        self.target = wrap_target(self.model)
        self.drafter = load_drafter(write_assistant(directory / "assistant", spec), self.target)
        from mlx_vlm.utils import load_processor

        self.processor = load_processor(self.dir, True)

    def image_request(self, text: str, seed: int) -> Request:
        from PIL import Image

        pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        return self.embedded_request(text, image=Image.fromarray(pixels))

    def embedded_request(self, text: str, image=None, audio=None) -> Request:
        return embedded_request(self.model, self.processor, text, [image] if image is not None else [],
                                audio=[audio] if audio is not None else None, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=sorted(SPECS))
def vlm(request, tmp_path_factory):
    return VlmPair(tmp_path_factory.mktemp(f"vlm{request.param}"), SPECS[request.param], audio=request.param == "e2b")


def test_mlx_vlm_model_gets_the_vlm_target(vlm):
    assert isinstance(vlm.target, Gemma4MlxVlmTarget)
    assert type(vlm.model).__module__.startswith("mlx_vlm.models.gemma4")


def _plain(vlm, request):
    return run_plain(vlm.target.plain_model(), request).row.generated


def test_text_prompts_greedy_lossless(vlm):
    batch = [Request(p, max_tokens=MAX_TOKENS) for p in prompts(6, vlm.spec.vocab_size - 16, seed=3)]
    expected = [_plain(vlm, r) for r in batch]
    assert all(len(set(tokens)) >= 12 for tokens in expected)  # the paths wander (DESIGN §8)
    continuations = {tuple(r.prompt): e for r, e in zip(batch, expected)}
    for drafter in (vlm.drafter, OracleDrafter(continuations, vlm.spec.vocab_size, error_rate=0.25, seed=1)):
        rows = SpeculativeDecoder(vlm.target, drafter, draft_tokens=3).generate(batch)
        assert [row.generated for row in rows] == expected
        assert sum(r.stats.drafted for r in rows) > 0
    assert sum(r.stats.accepted for r in rows) > 0  # the oracle's drafts were accepted


def test_image_prompts_greedy_lossless(vlm):
    requests = [vlm.image_request("Describe the picture.", seed) for seed in (0, 1)]
    expected = [_plain(vlm, r) for r in requests]
    assert expected[0] != expected[1]  # the image reaches the text model
    continuations = {tuple(r.prompt): e for r, e in zip(requests, expected)}
    oracle = OracleDrafter(continuations, vlm.spec.vocab_size, error_rate=0.25, seed=2)
    for drafter in (vlm.drafter, oracle):
        rows = SpeculativeDecoder(vlm.target, drafter, draft_tokens=3).generate(requests)
        assert [row.generated for row in rows] == expected


def test_image_prompts_first_tokens_are_mlx_vlms_own(vlm):
    """Image prompts are prefilled by mlx-vlm's own forward (its masks: with mlx-vlm 0.7 an image's soft
    tokens attend to each other), so the first token is the one mlx-vlm's full model picks."""
    from PIL import Image

    from omlx_mtp.tools.multimodal import processed_inputs

    for seed in range(4):
        image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))
        inputs = processed_inputs(vlm.processor, "Look.", [image])
        ids, pixels = inputs.pop("input_ids"), inputs.pop("pixel_values")
        inputs.pop("attention_mask", None)
        logits = vlm.model(ids, pixel_values=pixels, **{k: v for k, v in inputs.items() if v is not None})
        own = int(mx.argmax(getattr(logits, "logits", logits)[0, -1]).item())
        request = embedded_request(vlm.model, vlm.processor, "Look.", [image], max_tokens=4)
        assert _plain(vlm, request)[0] == own
        assert SpeculativeDecoder(vlm.target, vlm.drafter, draft_tokens=3).generate([request])[0].generated[0] == own


def test_audio_prompts_greedy_lossless(vlm):
    if not vlm.audio:
        pytest.skip("this fixture has no audio tower")
    clips = [np.random.default_rng(seed).normal(0, 0.1, 16000).astype(np.float32) for seed in (0, 1)]
    requests = [vlm.embedded_request("What do you hear?", audio=clip) for clip in clips]
    expected = [_plain(vlm, r) for r in requests]
    assert expected[0] != expected[1]  # the audio reaches the text model
    rows = SpeculativeDecoder(vlm.target, vlm.drafter, draft_tokens=3).generate(requests)
    assert [row.generated for row in rows] == expected


def _drain(generator, makers, insert_at) -> dict[int, list[int]]:
    """Insert request i (``makers[i]()`` -> prompt, cache) at step ``insert_at[i]``; step until every
    request has finished; the tokens of each."""
    out: dict[int, list[int]] = {}
    running: dict[int, int] = {}  # uid -> request index
    step = 0
    while len(out) < len(makers) or running:
        for i, at in enumerate(insert_at):
            if at == step:
                prompt, cache = makers[i]()
                (uid,) = generator.insert([prompt], max_tokens=[MAX_TOKENS], caches=[cache] if cache else None)
                running[uid], out[i] = i, []
        for response in generator.next_generated():
            out[running[response.uid]].append(response.token)
            if response.finish_reason is not None:
                running.pop(response.uid)
        step += 1
    return out


def test_batch_generator_mixed_image_and_text_requests(vlm):
    """oMLX's flow: the host prefills all but the last token (image embeddings included) into its own
    caches, then inserts the last token with the cache; text and image requests join at different steps."""
    plain_model = vlm.target.plain_model()
    requests = [vlm.image_request("What is it?", 5), Request(prompts(1, vlm.spec.vocab_size - 16, seed=9)[0] * 3),
                vlm.image_request("Colours?", 6), Request(prompts(1, vlm.spec.vocab_size - 16, seed=4)[0])]

    def host_prefilled(request):
        def make():
            if request.embeddings is not None:
                return request.prompt[-1:], prefill_on_host(plain_model, list(request.prompt), request.embeddings)
            return list(request.prompt), None
        return make

    makers = [host_prefilled(r) for r in requests]
    insert_at = [0, 0, 3, 5]
    plain = _drain(BatchGenerator(plain_model, completion_batch_size=8), makers, insert_at)
    for drafter in (vlm.drafter, None):
        if drafter is None:  # an oracle of the plain continuations: drafts get accepted
            drafter = OracleDrafter({tuple(r.prompt[-1:] if r.embeddings is not None else r.prompt): plain[i]
                                     for i, r in enumerate(requests)}, vlm.spec.vocab_size, error_rate=0.2, seed=3)
        decoder = SpeculativeDecoder(vlm.target, drafter, draft_tokens=3)
        generator = MTPBatchGenerator(decoder, BatchGenerator, model=plain_model, completion_batch_size=8)
        mtp = _drain(generator, makers, insert_at)
        assert mtp == plain
        assert generator._plain is None  # every request ran MTP rounds (none fell back)
    assert generator.totals.accepted > 0


@pytest.mark.skipif(not compiled_forward_exact(), reason="this mlx compiles the target with other rounding")
def test_compiled_forward_equals_op_by_op(vlm):
    plain, compiled = wrap_target(vlm.model, compiled=False), wrap_target(vlm.model, compiled=True)
    prompt = mx.array([prompts(1, vlm.spec.vocab_size - 16, seed=11)[0] * 2])
    results = []
    for target in (plain, compiled):
        cache = target.make_cache(1, slack=8)
        target.hidden(prompt, cache)
        from omlx_mtp.decode import cache as caches

        caches.advance(cache, prompt.shape[1])
        logits, hidden = target.forward(mx.array([[5, 6, 7, 8]]), cache)
        results.append((logits, hidden))
    assert compiled.compiled.traces.made == 1
    assert mx.array_equal(results[0][0], results[1][0]) and mx.array_equal(results[0][1], results[1][1])


def test_after_a_sparse_prefill(vlm):
    """oMLX's SpecPrefill on the VLM engine: its RoPE wrappers sit on mlx-vlm's layers."""
    from .test_sparse_prefill import _standin_sparse_prefill, decode, long_prompt

    plain_model = vlm.target.plain_model()
    prompt = long_prompt(vlm.spec.vocab_size - 16, seed=21)
    expected = decode(lambda: BatchGenerator(plain_model), plain_model, prompt, _standin_sparse_prefill)[-1]
    assert len(set(expected)) > 10
    decoder = SpeculativeDecoder(vlm.target, vlm.drafter, draft_tokens=3)
    got = decode(lambda: MTPBatchGenerator(decoder, BatchGenerator, model=plain_model), plain_model, prompt,
                 _standin_sparse_prefill)
    assert got[-1] == expected
