"""The tiny multimodal Gemma 4 checkpoint loads and runs in mlx-vlm (0.5.0 and 0.7.x), offline."""

from __future__ import annotations

import json
import os
from dataclasses import replace

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

pytest.importorskip("mlx_vlm")

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from omlx_mtp.fixtures import tiny
from omlx_mtp.fixtures.tiny import TinySpec
from omlx_mtp.fixtures.tiny_vlm import NAMED_TOKENS, TinyVisionSpec, image_prompt_inputs, write_tiny_vlm

# Gemma 4's USM feature-extractor defaults (which mlx-vlm always builds) leave one mel filter empty.
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter:UserWarning")

SPEC = TinySpec()
# E2B/E4B style: KV-shared layers and per-layer inputs, with an audio tower (mlx-vlm reads the original spelling).
SPEC_E2B = TinySpec(layout="e2b", num_layers=6)
SOFT = TinyVisionSpec().soft_tokens


def _image(seed: int, size: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


class Loaded:
    def __init__(self, directory, audio: bool, spec: TinySpec = SPEC):
        from mlx_vlm.utils import load

        self.spec = spec
        self.dir = write_tiny_vlm(directory, spec, audio=audio)
        self.model, self.processor = load(str(self.dir))
        self.config = json.loads((self.dir / "config.json").read_text())


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return Loaded(tmp_path_factory.mktemp("tiny_vlm"), audio=False)


@pytest.fixture(scope="module")
def vlm_audio(tmp_path_factory):
    return Loaded(tmp_path_factory.mktemp("tiny_vlm_audio"), audio=True)


@pytest.fixture(scope="module")
def vlm_e2b(tmp_path_factory):
    return Loaded(tmp_path_factory.mktemp("tiny_vlm_e2b"), audio=True, spec=SPEC_E2B)


def _shared_kv_names(spec: TinySpec) -> set[str]:
    text = tiny.target_text_config(spec)
    first = text["num_hidden_layers"] - text["num_kv_shared_layers"]
    return {
        f"model.language_model.layers.{i}.self_attn.{part}.weight"
        for i in range(first, text["num_hidden_layers"])
        for part in ("k_proj", "v_proj", "k_norm")
    }


def _generate(loaded: Loaded, text: str, images=None, audio=None, max_tokens: int = 16) -> str:
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(
        loaded.processor, loaded.model.config, text, num_images=len(images or []), num_audios=len(audio or [])
    )
    kwargs = {}
    if images:
        kwargs["image"] = images
    if audio:
        kwargs["audio"] = audio
    result = generate(loaded.model, loaded.processor, prompt, max_tokens=max_tokens, temperature=0.0,
                      verbose=False, **kwargs)
    return result.text


def test_layout_follows_the_release(vlm):
    config = vlm.config
    assert config["model_type"] == "gemma4" and config["audio_config"] is None
    assert config["text_config"] == {**tiny.target_text_config(replace(SPEC, model_type="gemma4")),
                                     "use_bidirectional_attention": "vision"}
    assert config["vision_config"]["model_type"] == "gemma4_vision"
    weights = mx.load(str(vlm.dir / "model.safetensors"))
    prefixes = {".".join(k.split(".")[:2]) for k in weights}
    assert prefixes == {"model.language_model", "model.vision_tower", "model.embed_vision"}
    assert all(v.dtype == mx.float32 for v in weights.values())
    assert (vlm.dir / "model.safetensors").stat().st_size < 5_000_000
    for name in ("processor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (vlm.dir / name).exists()


def test_token_ids_match_the_tokenizer(vlm):
    tokenizer = vlm.processor.tokenizer
    config = vlm.config
    for attribute in ("image", "boi", "eoi", "audio", "boa", "eoa"):
        token = NAMED_TOKENS[f"{attribute}_token"]
        assert getattr(tokenizer, f"{attribute}_token") == token
        assert tokenizer.convert_tokens_to_ids(token) == config[f"{attribute}_token_id"] < SPEC.vocab_size
    assert tokenizer.convert_tokens_to_ids("<|video|>") == config["video_token_id"] < SPEC.vocab_size
    assert tokenizer.image_token_id == config["image_token_id"]
    assert len(tokenizer) == SPEC.vocab_size  # the processors found <|video|> and added nothing
    assert tokenizer.convert_tokens_to_ids(NAMED_TOKENS["eot_token"]) in config["eos_token_id"]
    assert type(vlm.processor).__module__.startswith("mlx_vlm.")  # mlx-vlm's Gemma4Processor, no fallback


@pytest.mark.parametrize("which", ["vlm", "vlm_e2b"])
def test_text_weights_are_write_targets(which, request, tmp_path):
    loaded = request.getfixturevalue(which)
    target = tiny.write_target(tmp_path / "target", replace(loaded.spec, model_type="gemma4"), seed=0)
    expected = mx.load(str(target / "model.safetensors"))
    ours = {k: v for k, v in mx.load(str(loaded.dir / "model.safetensors")).items() if ".language_model." in k}
    extra = _shared_kv_names(loaded.spec) if loaded.spec.layout == "e2b" else set()
    assert set(ours) - set(expected) == extra  # the e2b layout adds only the unused K/V of KV-shared layers
    assert set(expected) <= set(ours)
    assert all(mx.array_equal(ours[k], expected[k]).item() for k in expected)


def _sanitized(loaded: Loaded) -> tuple[dict, dict]:
    file_weights = mx.load(str(loaded.dir / "model.safetensors"))
    return file_weights, loaded.model.language_model.sanitize(loaded.model.sanitize(file_weights))


@pytest.mark.parametrize("which", ["vlm", "vlm_audio"])
def test_every_tensor_is_used(which, request):
    loaded = request.getfixturevalue(which)
    file_weights, sanitized = _sanitized(loaded)
    parameters = dict(tree_flatten(loaded.model.parameters()))
    assert len(sanitized) == len(file_weights)  # sanitize dropped nothing
    assert set(sanitized) == set(parameters)
    loaded.model.load_weights(list(sanitized.items()), strict=True)


def test_e2b_layout_loads_and_runs(vlm_e2b):
    """KV-shared layers carry the release's unused K/V: mlx-vlm 0.5.0 needs them, 0.7.x drops them."""
    file_weights, sanitized = _sanitized(vlm_e2b)
    parameters = dict(tree_flatten(vlm_e2b.model.parameters()))
    assert set(sanitized) == set(parameters)
    dropped = set(file_weights) - {"model." + k.replace("language_model.model.", "language_model.", 1)
                                   for k in sanitized}
    assert dropped in (set(), _shared_kv_names(SPEC_E2B))  # 0.5.0 loads them, 0.7.x drops them
    p = image_prompt_inputs(vlm_e2b.dir, "Describe this.", _image(1), processor=vlm_e2b.processor)
    features = vlm_e2b.model.get_input_embeddings(**p.embedding_kwargs())
    assert features.per_layer_inputs is not None
    first = _generate(vlm_e2b, "Describe this.", [_image(1)])
    second = _generate(vlm_e2b, "Describe this.", [_image(2)])
    assert first and second and first != second
    assert _generate(vlm_e2b, "Hello there")


def test_refuses_the_per_layer_spelling(tmp_path):
    with pytest.raises(ValueError, match="per_layer_config"):
        write_tiny_vlm(tmp_path / "m", replace(SPEC, spelling="per_layer"))


def test_assistant_fits(vlm, tmp_path):
    assistant = tiny.write_assistant(tmp_path / "assistant", SPEC)
    config = json.loads((assistant / "config.json").read_text())
    text = vlm.config["text_config"]
    assert config["backbone_hidden_size"] == text["hidden_size"]
    assert config["text_config"]["vocab_size"] == text["vocab_size"] == vlm.config["vocab_size"]


def test_image_tokens_in_input_ids(vlm):
    p = image_prompt_inputs(vlm.dir, "Describe this.", _image(0), processor=vlm.processor)
    ids = np.array(p.input_ids)[0].tolist()
    assert p.prompt.count(NAMED_TOKENS["image_token"]) == 1
    assert ids.count(vlm.config["image_token_id"]) == SOFT
    assert ids.count(vlm.config["boi_token_id"]) == 1 and ids.count(vlm.config["eoi_token_id"]) == 1
    start = ids.index(vlm.config["boi_token_id"])
    assert ids[start + SOFT + 1] == vlm.config["eoi_token_id"]
    assert p.pixel_values is not None and p.pixel_values.shape[:2] == (1, 3)
    text_only = image_prompt_inputs(vlm.dir, "Hello", processor=vlm.processor)
    assert text_only.pixel_values is None
    assert vlm.config["image_token_id"] not in np.array(text_only.input_ids)[0].tolist()


def test_helper_loads_the_processor_and_takes_several_images(vlm):
    wide = _image(6).resize((120, 50))
    p = image_prompt_inputs(vlm.dir, "Two images.", [wide, wide.convert("L")])  # processor from model_dir
    ids = np.array(p.input_ids)[0].tolist()
    assert p.prompt.count(NAMED_TOKENS["image_token"]) == 2
    assert p.pixel_values.shape[0] == 2
    assert ids.count(vlm.config["boi_token_id"]) == 2
    assert 0 < ids.count(vlm.config["image_token_id"]) <= 2 * SOFT  # the budget caps each image
    features = vlm.model.get_input_embeddings(**p.embedding_kwargs())
    assert features.inputs_embeds.shape == (1, len(ids), SPEC.hidden_size)


def test_image_prompt_generates_and_depends_on_the_image(vlm):
    first = _generate(vlm, "Describe this.", [_image(1)])
    second = _generate(vlm, "Describe this.", [_image(2)])
    assert first and second
    assert first != second


def test_text_prompt_generates(vlm):
    assert _generate(vlm, "Hello there")


def test_input_embeddings_helper(vlm):
    model = vlm.model
    a = image_prompt_inputs(vlm.dir, "Describe this.", _image(3), processor=vlm.processor)
    b = image_prompt_inputs(vlm.dir, "Describe this.", _image(4), processor=vlm.processor)
    ea = model.get_input_embeddings(**a.embedding_kwargs()).inputs_embeds
    eb = model.get_input_embeddings(**b.embedding_kwargs()).inputs_embeds
    soft = np.array(a.input_ids)[0] == vlm.config["image_token_id"]
    assert np.array_equal(np.array(a.input_ids), np.array(b.input_ids))
    assert np.array_equal(np.array(ea)[0, ~soft], np.array(eb)[0, ~soft])  # text rows: token embeddings
    assert not np.allclose(np.array(ea)[0, soft], np.array(eb)[0, soft])  # image rows: the tower's output
    features = model.get_input_embeddings(**a.embedding_kwargs())
    via_embeds = model.language_model(
        inputs_embeds=features.inputs_embeds, per_layer_inputs=features.per_layer_inputs
    ).logits
    direct = model(a.input_ids, pixel_values=a.pixel_values).logits
    assert mx.allclose(via_embeds, direct, atol=1e-5).item()


def test_audio_variant(vlm_audio):
    config = vlm_audio.config
    assert config["audio_config"]["model_type"] == "gemma4_audio"
    prefixes = {".".join(k.split(".")[:2]) for k in mx.load(str(vlm_audio.dir / "model.safetensors"))}
    assert {"model.audio_tower", "model.embed_audio"} <= prefixes
    clip = np.random.default_rng(0).normal(0.0, 0.1, 16000).astype(np.float32)  # one second at 16 kHz
    p = image_prompt_inputs(vlm_audio.dir, "Listen.", audio=clip, processor=vlm_audio.processor)
    ids = np.array(p.input_ids)[0].tolist()
    assert ids.count(config["audio_token_id"]) == 25  # 1000 ms / 40 ms per token
    assert ids.count(config["boa_token_id"]) == 1 and ids.count(config["eoa_token_id"]) == 1
    assert "input_features" in p.extra
    first = _generate(vlm_audio, "Listen.", audio=[clip])
    second = _generate(vlm_audio, "Listen.", audio=[clip[::-1].copy()])
    assert first and second and first != second
    # Image and text prompts run on the E2B/E4B-style checkpoint as well.
    assert _generate(vlm_audio, "Describe this.", [_image(1)])
    assert _generate(vlm_audio, "Hello there")


@pytest.mark.parametrize(
    "spec,audio", [(SPEC, False), (SPEC, True), (SPEC_E2B, True)], ids=["31b", "31b-audio", "e2b-audio"]
)
def test_transformers_reads_the_same_layout(spec, audio, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("transformers without Gemma 4")
    directory = write_tiny_vlm(tmp_path / "m", spec, audio=audio)
    config = transformers.Gemma4Config.from_pretrained(str(directory))
    with torch.device("meta"):
        reference = transformers.Gemma4ForConditionalGeneration(config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items() if k != "lm_head.weight"}  # tied
    ours = {k: tuple(v.shape) for k, v in mx.load(str(directory / "model.safetensors")).items()}
    extra = _shared_kv_names(spec) if spec.layout == "e2b" else set()  # transformers 5 leaves them unused
    assert set(ours) - set(expected) == extra
    assert {k: v for k, v in ours.items() if k not in extra} == expected


def test_transformers_gives_the_same_logits(vlm):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForConditionalGeneration"):
        pytest.skip("transformers without Gemma 4")
    reference = transformers.Gemma4ForConditionalGeneration.from_pretrained(str(vlm.dir), dtype=torch.float32)
    p = image_prompt_inputs(vlm.dir, "Describe this.", _image(5), processor=vlm.processor)
    pixels = np.array(p.pixel_values)
    n, c, h, w = pixels.shape
    size = vlm.config["vision_config"]["patch_size"]
    # transformers' processor hands the tower patches in (row, column, y, x, channel) order with (x, y) ids.
    patches = pixels.reshape(n, c, h // size, size, w // size, size).transpose(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(n, (h // size) * (w // size), size * size * c)
    gx, gy = np.meshgrid(np.arange(w // size), np.arange(h // size), indexing="xy")
    positions = np.stack([gx.ravel(), gy.ravel()], -1)[None].repeat(n, 0)
    with torch.no_grad():
        logits = reference(
            input_ids=torch.tensor(np.array(p.input_ids)),
            pixel_values=torch.tensor(patches),
            image_position_ids=torch.tensor(positions),
        ).logits.numpy()
    ours = np.array(vlm.model(p.input_ids, pixel_values=p.pixel_values).logits)
    assert np.abs(logits - ours).max() < 1e-4
