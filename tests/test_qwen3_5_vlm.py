"""Qwen3.5 / Qwen3.6 as published (a vision tower beside the text model), loaded through mlx-vlm as
oMLX's VLM engine loads them: the built-in head drafts, float32 greedy output equals mlx-vlm's
plain decoding token for token, for text prompts and for image prompts (whose text tokens sit at
mRoPE positions shifted from their index), directly and behind the host API."""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_vlm")

from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.drafters.oracle import OracleDrafter  # noqa: E402
from omlx_mtp.drafters import load_merged_drafter  # noqa: E402
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator  # noqa: E402
from omlx_mtp.checkpoint.loading import load_target  # noqa: E402
from omlx_mtp.tools.session import run_plain  # noqa: E402
from omlx_mtp.targets import Qwen35MlxVlmTarget, wrap_target  # noqa: E402
from omlx_mtp.decode.target import prefill_on_host
from omlx_mtp.targets.qwen3_5_mlx_vlm import mlx_lm_text_over  # noqa: E402
from omlx_mtp.fixtures.tiny_qwen import TinyQwenSpec, image_request, write_qwen  # noqa: E402

from .conftest import prompts  # noqa: E402

MAX_TOKENS = 80
TEXT_VOCAB = 500  # below the vision marker ids


class VlmQwen:
    def __init__(self, directory, moe: bool):
        self.spec = TinyQwenSpec(moe=moe, vision=True)
        self.dir = write_qwen(directory, self.spec)
        self.model, self.tokenizer, _ = load_target(self.dir)
        self.target = wrap_target(self.model)
        self.head = load_merged_drafter(self.dir, self.target)

    def plain(self, request: Request) -> list[int]:
        return run_plain(self.target.plain_model(), request).row.generated

    def images(self, count: int, max_tokens: int = MAX_TOKENS) -> list[Request]:
        return [image_request(self.model, [5 + i, 17, 99], [20 + i, 30, 40, 7], seed=i, max_tokens=max_tokens)
                for i in range(count)]


@pytest.fixture(scope="module", params=["dense", "moe"])
def vlm(request, tmp_path_factory):
    return VlmQwen(tmp_path_factory.mktemp(f"qwen-vlm-{request.param}"), request.param == "moe")


def _check(vlm, requests, expected, K=3):
    continuations = {tuple(r.prompt): e for r, e in zip(requests, expected)}
    oracle = OracleDrafter(continuations, vlm.spec.vocab_size, error_rate=0.25, seed=K)
    for drafter in (vlm.head, oracle):
        rows = SpeculativeDecoder(vlm.target, drafter, draft_tokens=K).generate(requests)
        assert [row.generated for row in rows] == expected
        assert sum(r.stats.drafted for r in rows) > 0
    assert sum(r.stats.accepted for r in rows) > 0  # the oracle's drafts were accepted


def test_published_checkpoint_loads_through_mlx_vlm(vlm):
    assert type(vlm.model).__module__.startswith("mlx_vlm.models.qwen3_5")
    assert isinstance(vlm.target, Qwen35MlxVlmTarget)
    # mlx-lm's layers hold mlx-vlm's arrays: nothing is copied.
    assert vlm.target.body.embed_tokens.weight is vlm.model.language_model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def text_batch(vlm):
    """20 prompts, 150 tokens each, and mlx-vlm's plain greedy continuations."""
    requests = [Request(p, max_tokens=150) for p in prompts(20, TEXT_VOCAB, seed=4)]
    return requests, [vlm.plain(r) for r in requests]


@pytest.mark.parametrize("K", [1, 2, 4])
def test_text_prompts_greedy_lossless(vlm, text_batch, K):
    requests, expected = text_batch
    assert all(len(set(tokens)) >= 40 for tokens in expected)  # the paths wander (DESIGN §8)
    _check(vlm, requests, expected, K)


def test_image_prompts_greedy_lossless(vlm):
    requests = vlm.images(3)
    assert all(r.embeddings.rope_shift < 0 for r in requests)  # an image takes fewer positions than tokens
    expected = [vlm.plain(r) for r in requests]
    assert len({tuple(e) for e in expected}) == 3  # the image reaches the text model
    _check(vlm, requests, expected)


def test_ignoring_the_rope_shift_breaks_image_prompts(vlm, monkeypatch):
    """The mutation: decode an image prompt's text at its token index, not its mRoPE position."""
    requests = vlm.images(2)
    expected = [vlm.plain(r) for r in requests]
    original = SpeculativeDecoder.from_host
    monkeypatch.setattr(SpeculativeDecoder, "from_host", lambda self, host, slack, rope_shift=0: original(self, host, slack))
    rows = SpeculativeDecoder(vlm.target, vlm.head, draft_tokens=3).generate(requests)
    assert [row.generated for row in rows] != expected


def test_host_api_takes_each_requests_rope_delta(vlm):
    """oMLX's VLM engine prefills an image request itself, inserts it with its caches and then
    registers the request's mRoPE delta by uid on its model adapter; image and text requests
    join at different steps."""
    image_requests = vlm.images(2, max_tokens=40)
    text_requests = [Request(p, max_tokens=40) for p in prompts(2, TEXT_VOCAB, seed=9)]
    requests = [image_requests[0], text_requests[0], image_requests[1], text_requests[1]]
    expected = [vlm.plain(r) for r in requests]
    adapter = types.SimpleNamespace(_uid_rope_deltas={})
    decoder = SpeculativeDecoder(vlm.target, vlm.head, draft_tokens=3)
    generator = MTPBatchGenerator(decoder, None, model=adapter, max_tokens=40)
    out: dict[int, list[int]] = {}
    uids: dict[int, int] = {}
    for step in range(400):
        if step in (0, 2, 5, 9):
            request = requests[len(uids)]
            host = prefill_on_host(vlm.target.plain_model(), list(request.prompt), request.embeddings) \
                if request.embeddings is not None else None
            prompt = list(request.prompt[-1:]) if host is not None else list(request.prompt)
            (uid,) = generator.insert([prompt], max_tokens=[40], caches=[host] if host is not None else None,
                                      all_tokens=[list(request.prompt[:-1])] if host is not None else None)
            uids[uid] = len(uids)
            adapter._uid_rope_deltas[uid] = float(request.embeddings.rope_shift) if request.embeddings else 0.0
        for response in generator.next_generated():
            out.setdefault(response.uid, []).append(response.token)
        if len(uids) == len(requests) and not generator.batch.rows and not generator._pending:
            break
    assert [out[uid] for uid in sorted(uids)] == expected


def test_quantized_model_shares_its_quantized_layers(vlm):
    """A quantized mlx-vlm model (as oQ or mlx-vlm's convert leave it) is wrapped layer for layer,
    and still decodes losslessly in float32 activations."""
    model, _, _ = load_target(vlm.dir, with_tokenizer=False)
    nn.quantize(model.language_model, group_size=32, bits=8,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    target = wrap_target(model)
    layer = target.layers[0].linear_attn.in_proj_qkv
    assert isinstance(layer, nn.QuantizedLinear) and layer.bits == 8
    assert layer.weight is model.language_model.model.layers[0].linear_attn.in_proj_qkv.weight
    head = load_merged_drafter(vlm.dir, target)
    requests = [Request(p, max_tokens=40) for p in prompts(4, TEXT_VOCAB, seed=6)]
    expected = [run_plain(target.plain_model(), r).row.generated for r in requests]
    rows = SpeculativeDecoder(target, head, draft_tokens=3).generate(requests)
    assert [row.generated for row in rows] == expected


def test_a_language_model_of_another_shape_is_refused(vlm):
    other = load_target(vlm.dir, with_tokenizer=False)[0].language_model
    other.model.layers[0].mlp.extra = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="does not match"):
        mlx_lm_text_over(other)


def _mlx_layout(vlm, directory, drop: str | None = None):
    """The checkpoint as an MLX-format writer leaves it (sanitized names), the head in the same shard."""
    import json
    import shutil

    from mlx.utils import tree_flatten

    shutil.copytree(vlm.dir, directory)
    tensors = dict(tree_flatten(vlm.model.parameters()))
    tensors.update({k: v for k, v in mx.load(str(vlm.dir / "model.safetensors")).items() if k.startswith("mtp.")})
    tensors.pop(drop, None)
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "mlx"})
    json.loads((directory / "config.json").read_text())  # unchanged
    return directory


def test_head_inside_the_model_shard_loads_or_is_refused_clearly(vlm, tmp_path):
    """Where mlx-vlm honours strict=False (0.7) such a checkpoint loads as oMLX loads it; where it
    does not (0.5), the refusal says where the head should be.  A missing weight fails either way."""
    from omlx_mtp.errors import CheckpointError

    try:
        model, _, _ = load_target(_mlx_layout(vlm, tmp_path / "mlx"), with_tokenizer=False)
    except CheckpointError as exc:
        assert "sit in the model's shards" in str(exc) and "mtp/mtp.safetensors" in str(exc)
    else:
        assert load_merged_drafter(tmp_path / "mlx", wrap_target(model)) is not None
    with pytest.raises(CheckpointError, match="Missing 1 parameters|sit in the model's shards"):
        load_target(_mlx_layout(vlm, tmp_path / "broken", drop="language_model.model.norm.weight"), with_tokenizer=False)


def test_omlx_mtp_quantize_keeps_tower_and_head(vlm, tmp_path):
    """``omlx-mtp quantize`` on a published checkpoint: the tower stays, the head goes where mlx-vlm's
    strict load does not see it, and the quantized model decodes losslessly with its head."""
    from omlx_mtp.tools.cli import main

    out = tmp_path / "q8"
    assert main(["quantize", str(vlm.dir), str(out), "--bits", "8", "--group-size", "32", "--dtype", "float32"]) == 0
    assert (out / "mtp" / "mtp.safetensors").is_file()
    model, _, _ = load_target(out, with_tokenizer=False)
    target = wrap_target(model)
    assert isinstance(target, Qwen35MlxVlmTarget) and isinstance(target.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    head = load_merged_drafter(out, target)
    requests = [Request(p, max_tokens=40) for p in prompts(4, TEXT_VOCAB, seed=8)]
    requests.append(image_request(model, [5, 17, 99], [20, 30, 40, 7], seed=0, max_tokens=40))
    expected = [run_plain(target.plain_model(), r).row.generated for r in requests]
    rows = SpeculativeDecoder(target, head, draft_tokens=3).generate(requests)
    assert [row.generated for row in rows] == expected
