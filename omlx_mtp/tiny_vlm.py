"""Tiny multimodal Gemma 4 checkpoints (``model_type: gemma4``) with random weights, in the HF layout.

``write_tiny_vlm`` lays a directory out the way google/gemma-4-*-it is published:

* ``config.json``: ``model_type: gemma4``, ``text_config`` (exactly ``tiny.target_text_config(spec)``),
  ``vision_config`` (a small but real ``gemma4_vision`` tower), ``audio_config`` (``null``, or a small
  ``gemma4_audio`` conformer for the E2B/E4B style), and the multimodal token ids of the tokenizer;
* ``model.safetensors``: ``model.language_model.*`` (bit for bit what ``tiny.write_target`` writes for
  ``replace(spec, model_type="gemma4")`` and the same seed; the e2b layout adds the release's unused K/V of
  the KV-shared layers, see ``shared_kv_weights``), ``model.vision_tower.*`` / ``model.embed_vision.*``
  and, with audio, ``model.audio_tower.*`` / ``model.embed_audio.*`` (convolutions in PyTorch layout);
* ``tokenizer.json`` / ``tokenizer_config.json``: tiny.py's byte-level vocabulary with Gemma 4's named
  tokens (``<|image>`` ``<image|>`` ``<|image|>`` ``<|audio>`` ``<audio|>`` ``<|audio|>`` ``<|video|>``
  ``<|turn>`` ``<turn|>``) on top ids, spelled as the release spells them (``image_token``, ``boi_token``,
  ... at the top of tokenizer_config.json, so ``tokenizer.image_token_id`` etc. exist);
* ``chat_template.jinja`` (also in tokenizer_config.json): Gemma 4 turns, ``<|image|>`` for image content,
  ``<|audio|>`` for audio content;
* ``processor_config.json``: ``image_processor`` and ``video_processor`` settings read by mlx-vlm's
  ``Gemma4Processor.from_pretrained`` (no ``feature_extractor``: like the release, the audio feature
  extractor takes its fixed USM defaults); ``generation_config.json``.

The towers' weights are drawn by tiny.py's ``randomize`` on mlx-vlm's own ``VisionModel`` /
``AudioEncoder`` / embedders and renamed to the HF names that mlx-vlm's ``Model.sanitize`` maps back;
transformers' ``Gemma4ForConditionalGeneration`` loads the same files and gives the same logits.

mlx-vlm's image processor turns every image into ``soft_tokens`` soft tokens (the processor resizes the
image to that budget), so a prompt with one image holds ``boi + soft_tokens x image_token + eoi``.
transformers' own ``Gemma4ImageProcessor`` accepts only 70/140/280/560/1120 soft tokens; the tiny default
(9) therefore loads through mlx-vlm's processor (the one ``mlx_vlm.utils.load`` uses), not through
transformers' ``AutoProcessor`` without mlx-vlm imported.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from . import tiny
from .gemma4_config import default_layer_types
from .tiny import TinySpec

IMAGE_SOFT_TOKENS = 9

# Gemma 4's named tokens (tokenizer_config.json attribute -> token), placed on the top ids of the vocabulary.
NAMED_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
}
VIDEO_TOKEN = "<|video|>"  # no named attribute in the release; the processors add it when it is missing

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}"
    "{{ (item['text'] if item['text'] is defined else item['content']) | trim }}"
    "{%- elif item['type'] == 'image' -%}"
    "{{ '\\n\\n<|image|>\\n\\n' }}"
    "{%- elif item['type'] == 'audio' -%}"
    "{{ '<|audio|>' }}"
    "{%- elif item['type'] == 'video' -%}"
    "{{ '\\n\\n<|video|>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|turn>model\\n' }}"
    "{%- endif -%}"
)


@dataclass
class TinyVisionSpec:
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    patch_size: int = 16
    pooling_kernel_size: int = 3
    soft_tokens: int = IMAGE_SOFT_TOKENS  # soft tokens per image (max_soft_tokens / default_output_length)
    position_embedding_size: int = 64  # > the longest side in patches (soft_tokens * pooling_kernel_size)
    audio_hidden_size: int = 32
    audio_layers: int = 1
    audio_heads: int = 2
    audio_output_dims: int = 48


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Token -> id: the named tokens and ``<|video|>`` take the top ids of the vocabulary."""
    tokens = list(NAMED_TOKENS.values()) + [VIDEO_TOKEN]
    first = vocab_size - len(tokens)
    if first < len(tiny.SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for {len(tokens)} multimodal tokens")
    return {token: first + i for i, token in enumerate(tokens)}


def vision_config(vision: TinyVisionSpec) -> dict:
    return {
        "model_type": "gemma4_vision",
        "hidden_size": vision.hidden_size,
        "intermediate_size": 2 * vision.hidden_size,
        "num_hidden_layers": vision.num_layers,
        "num_attention_heads": vision.num_heads,
        "num_key_value_heads": vision.num_heads,
        "head_dim": vision.head_dim,
        "global_head_dim": vision.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "patch_size": vision.patch_size,
        "pooling_kernel_size": vision.pooling_kernel_size,
        "position_embedding_size": vision.position_embedding_size,
        "default_output_length": vision.soft_tokens,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "use_clipped_linears": False,
        "standardize": False,
    }


def audio_config(vision: TinyVisionSpec) -> dict:
    return {
        "model_type": "gemma4_audio",
        "hidden_size": vision.audio_hidden_size,
        "num_hidden_layers": vision.audio_layers,
        "num_attention_heads": vision.audio_heads,
        "hidden_act": "silu",
        # The first must stay 128: transformers sizes input_proj_linear by channels[0] // 4, mlx-vlm by the
        # 128 mel bins // 4 -- the two agree only there.
        "subsampling_conv_channels": [128, 8],
        "conv_kernel_size": 5,
        "residual_weight": 0.5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "attention_logit_cap": 50.0,
        "attention_invalid_logits_value": -1e9,
        "use_clipped_linears": True,
        "rms_norm_eps": 1e-6,
        "gradient_clipping": 1e10,
        "output_proj_dims": vision.audio_output_dims,
    }


def vlm_config(spec: TinySpec, audio: bool = False, vision: TinyVisionSpec | None = None) -> dict:
    vision = vision or TinyVisionSpec()
    ids = special_token_ids(spec.vocab_size)
    text = tiny.target_text_config(spec)
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision_config(vision),
        "audio_config": audio_config(vision) if audio else None,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "image_token_id": ids[NAMED_TOKENS["image_token"]],
        "boi_token_id": ids[NAMED_TOKENS["boi_token"]],
        "eoi_token_id": ids[NAMED_TOKENS["eoi_token"]],
        "audio_token_id": ids[NAMED_TOKENS["audio_token"]],
        "boa_token_id": ids[NAMED_TOKENS["boa_token"]],
        "eoa_token_id": ids[NAMED_TOKENS["eoa_token"]],
        "eoa_token_index": ids[NAMED_TOKENS["eoa_token"]],
        "video_token_id": ids[VIDEO_TOKEN],
        "vision_soft_tokens_per_image": vision.soft_tokens,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 2,
        "pad_token_id": 0,
        "eos_token_id": [1, ids[NAMED_TOKENS["eot_token"]]],
        "torch_dtype": spec.dtype,
    }


def _hf_name(name: str, value: mx.array) -> tuple[str, mx.array]:
    """mlx-vlm parameter name -> HF tensor name, undoing sanitize's conv-layout changes."""
    if "subsample_conv_projection" in name and name.endswith("conv.weight") and value.ndim == 4:
        value = value.transpose(0, 3, 1, 2)  # MLX [out, kH, kW, in] -> PyTorch [out, in, kH, kW]
    if name.endswith("depthwise_conv1d.weight") and value.ndim == 3:
        value = value.transpose(0, 2, 1)  # MLX [out, kW, in] -> PyTorch [out, in, kW]
    return "model." + name, value


def tower_weights(spec: TinySpec, audio: bool, vision: TinyVisionSpec, seed: int) -> dict[str, mx.array]:
    """Random weights of the vision (and audio) towers and their embedders, under their HF names."""
    from mlx_vlm.models import gemma4 as vlm

    config = vlm_config(spec, audio, vision)
    model_config = vlm.ModelConfig.from_dict(config)
    model_config.text_config = vlm.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = vlm.VisionConfig.from_dict(config["vision_config"])
    if audio:
        model_config.audio_config = vlm.AudioConfig.from_dict(config["audio_config"])
    model = vlm.Model(model_config)
    rng = np.random.default_rng([seed, 1])
    weights = {}
    for part in ("vision_tower", "embed_vision", "audio_tower", "embed_audio"):
        module = getattr(model, part, None)
        if module is None:
            continue
        drawn = tiny.randomize(module, spec, rng)
        for name, value in drawn.items():
            if name.endswith(("input_min", "output_min")):
                value = mx.array(-1e4, dtype=value.dtype)  # clip bounds: finite, as in the release, and loose
            elif name.endswith(("input_max", "output_max")):
                value = mx.array(1e4, dtype=value.dtype)
            weights.update([_hf_name(f"{part}.{name}", value)])
    return weights


def shared_kv_weights(text: dict, text_weights: dict[str, mx.array], spec: TinySpec, seed: int) -> dict[str, mx.array]:
    """K/V projections and k_norm for the KV-shared layers (e2b layout), which never run.

    The release carries them (mlx-lm and mlx-vlm 0.7 drop them in ``sanitize``; mlx-vlm 0.5.0 builds the
    modules and loads strictly, so without them it refuses the checkpoint). tiny.write_target leaves them
    out, so they are drawn here, from their own generator, shaped like the owning layer of the same type.
    ``text``: the text config; ``spec``: the weight scale.
    """
    layers, shared = text["num_hidden_layers"], text.get("num_kv_shared_layers", 0)
    first = layers - shared
    if shared <= 0 or first <= 0:
        return {}
    types = text.get("layer_types") or default_layer_types(text)
    owner = {t: i for i, t in enumerate(types[:first])}
    rng = np.random.default_rng([seed, 2])
    out = {}
    for layer in range(first, layers):
        for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            source = text_weights.get(f"model.language_model.layers.{owner[types[layer]]}.self_attn.{part}")
            if source is None:  # v_proj of a K-eq-V full layer
                continue
            if "norm" in part:
                array = 1.0 + rng.normal(0.0, 0.1, source.shape)
            else:
                array = rng.normal(0.0, spec.layer_std, source.shape)
            name = f"model.language_model.layers.{layer}.self_attn.{part}"
            out[name] = mx.array(array.astype(np.float32)).astype(source.dtype)
    return out


def _write_tokenizer(directory: Path, spec: TinySpec) -> dict[str, int]:
    """tiny.py's byte-level tokenizer with Gemma 4's multimodal and turn tokens on top ids."""
    ids = special_token_ids(spec.vocab_size)
    tiny.rename_tokens(directory / "tokenizer.json", ids)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": "Gemma4Processor",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "padding_side": "left",
        **NAMED_TOKENS,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def _processor_config(vision: TinyVisionSpec) -> dict:
    image = {
        "image_processor_type": "Gemma4ImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "resample": 3,
        "patch_size": vision.patch_size,
        "pooling_kernel_size": vision.pooling_kernel_size,
        "max_soft_tokens": vision.soft_tokens,
    }
    video = {
        "video_processor_type": "Gemma4VideoProcessor",
        "patch_size": vision.patch_size,
        "pooling_kernel_size": vision.pooling_kernel_size,
        "max_soft_tokens": 70,  # the smallest budget both processors accept
        "num_frames": 4,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
    }
    return {
        "processor_class": "Gemma4Processor",
        "image_seq_length": vision.soft_tokens,
        "audio_seq_length": 750,
        "audio_ms_per_token": 40,
        "image_processor": image,
        "video_processor": video,
    }


def write_tiny_vlm(
    directory: Path,
    spec: TinySpec | None = None,
    audio: bool = False,
    seed: int = 0,
    vision: TinyVisionSpec | None = None,
) -> Path:
    """Write a tiny multimodal Gemma 4 checkpoint; ``tiny.write_assistant(dir, spec)`` gives its drafter."""
    spec = replace(spec or TinySpec(), model_type="gemma4")
    if spec.spelling != "original":
        raise ValueError("mlx-vlm reads only the original Gemma 4 spelling (global_head_dim), not per_layer_config")
    vision = vision or TinyVisionSpec()
    if vision.position_embedding_size < vision.soft_tokens * vision.pooling_kernel_size:
        raise ValueError("position_embedding_size must cover the longest side in patches (soft_tokens x pooling)")
    with tempfile.TemporaryDirectory() as scratch:  # never read and overwrite the same safetensors file
        text = tiny.write_target(Path(scratch), spec, seed)  # text weights, byte-level tokenizer
        return add_towers(text, directory, spec, audio, seed, vision)


def add_towers(text_dir: Path, directory: Path, spec: TinySpec, audio: bool = False, seed: int = 0,
               vision: TinyVisionSpec | None = None) -> Path:
    """A multimodal checkpoint in ``directory`` from the Gemma 4 text checkpoint in ``text_dir`` (its
    weights under ``model.language_model.*``, its text config, its tokenizer with the top ids of the
    vocabulary renamed to the multimodal tokens) plus random towers.  ``spec`` gives the widths the
    towers project to and the weight scales; the text part is taken as it is."""
    text_dir, directory = Path(text_dir), Path(directory)
    vision = vision or TinyVisionSpec()
    text_config = json.loads((text_dir / "config.json").read_text())
    text_config = text_config.get("text_config", text_config)
    weights = dict(mx.load(str(text_dir / "model.safetensors")))
    mx.eval(weights)
    if not any(k.startswith("model.language_model.") for k in weights):
        weights = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(text_dir / "tokenizer.json", directory / "tokenizer.json")
    weights.update(shared_kv_weights(text_config, weights, spec, seed))
    weights.update(tower_weights(spec, audio, vision, seed))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    config = vlm_config(spec, audio, vision)
    # As the multimodal releases say it: an image's soft tokens attend to each other (mlx-vlm 0.7 reads it).
    config["text_config"] = {**text_config, "model_type": "gemma4_text", "use_bidirectional_attention": "vision"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(directory, spec)
    (directory / "processor_config.json").write_text(json.dumps(_processor_config(vision), indent=2))
    generation = {"bos_token_id": 2, "pad_token_id": 0, "eos_token_id": config["eos_token_id"], "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def demo_vlm(directory: Path, audio: bool = False) -> tuple[Path, Path]:
    """The embedded demo pair's trained target as a multimodal checkpoint (random towers; text prompts
    decode as the demo target does, up to the few BPE merges given up to the multimodal tokens), and
    its assistant: drafts that get accepted, through the mlx-vlm path."""
    from .demo import demo_pair

    text, assistant, _ = demo_pair(Path(directory) / "text")
    config = json.loads((text / "config.json").read_text())
    spec = TinySpec(model_type="gemma4", hidden_size=config["hidden_size"], vocab_size=config["vocab_size"])
    return add_towers(text, Path(directory) / "target", spec, audio), assistant


@dataclass
class VlmPrompt:
    """A chat prompt run through mlx-vlm's processor: what ``Model.get_input_embeddings`` and ``Model`` take."""

    prompt: str  # the chat-templated text, one ``<|image|>`` per image before expansion
    input_ids: mx.array  # [1, L]; each image expanded to boi + soft_tokens x image_token + eoi
    attention_mask: mx.array | None
    pixel_values: mx.array | None  # [n_images, 3, H, W] in [0, 1], or None
    extra: dict[str, Any] = field(default_factory=dict)  # the processor's other outputs, see image_prompt_inputs

    def embedding_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.get_input_embeddings(**...)`` (and for ``model(**...)``)."""
        return {"input_ids": self.input_ids, "pixel_values": self.pixel_values, **self.extra}


def image_prompt_inputs(
    model_dir: Path | str | None,
    prompt: str,
    image: Any = None,
    *,
    processor: Any = None,
    audio: Any = None,
    chat: bool = True,
) -> VlmPrompt:
    """Process a user prompt with zero or more images (and audio clips) the way ``mlx_vlm.generate`` does.

    ``image``: a PIL image, a list of them, or None (a text-only prompt). ``audio``: a float32 waveform at
    16 kHz (numpy), a list of them, or None. ``processor``: the processor from ``mlx_vlm.utils.load`` (loaded
    from ``model_dir`` when omitted). ``chat=False`` takes ``prompt`` as already templated text, in which
    each image must appear as one ``<|image|>`` (each clip as one ``<|audio|>``).

    Typical use::

        model, processor = mlx_vlm.utils.load(str(path))
        p = image_prompt_inputs(path, "Describe this.", image, processor=processor)
        features = model.get_input_embeddings(**p.embedding_kwargs())
        embeds = features.inputs_embeds  # [1, L, hidden]; features.per_layer_inputs for e2b-layout specs
        logits = model.language_model(inputs_embeds=embeds, cache=cache,
                                      per_layer_inputs=features.per_layer_inputs).logits
        # == model(p.input_ids, pixel_values=p.pixel_values, cache=cache).logits

    The same call works with mlx-vlm 0.5.0 and 0.7.10; the two differ only in ``extra``: 0.7.x adds
    ``mm_token_type_ids`` (1 on image soft tokens, 3 on audio soft tokens), 0.5.0 returns none for images;
    with audio both add ``input_features`` and ``input_features_mask``. ``get_input_embeddings`` of both
    versions takes these as keywords (0.7.x also ``image_position_ids``, which this processor never emits:
    its images come as [n, 3, H, W] and the tower patchifies them itself). For a tiny checkpoint the two
    versions produce identical logits for an image prompt.
    """
    from mlx_vlm.utils import load_processor

    from .multimodal import processed_inputs

    images = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
    clips = [] if audio is None else list(audio) if isinstance(audio, (list, tuple)) else [audio]
    if processor is None:
        if model_dir is None:
            raise ValueError("give model_dir or processor")
        import mlx_vlm.models.gemma4  # noqa: F401  (installs mlx-vlm's Gemma4Processor into AutoProcessor)

        processor = load_processor(Path(model_dir), True)
    if chat:
        from mlx_vlm.prompt_utils import apply_chat_template

        prompt = apply_chat_template(
            processor, {"model_type": "gemma4"}, prompt, num_images=len(images), num_audios=len(clips)
        )
    inputs = processed_inputs(processor, prompt, images, chat=False, audio=clips)
    return VlmPrompt(
        prompt=prompt,
        input_ids=inputs.pop("input_ids"),
        attention_mask=inputs.pop("attention_mask", None),
        pixel_values=inputs.pop("pixel_values", None),
        extra={k: v for k, v in inputs.items() if v is not None},
    )
