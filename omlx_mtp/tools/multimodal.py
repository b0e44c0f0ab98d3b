"""Prompts with images for multimodal targets: mlx-vlm's processor turns text and images into token
ids (each image expanded to its soft tokens), and the model's own ``get_input_embeddings`` merges
the vision tower's features into the text embeddings — the same inputs oMLX's VLM engine prefills."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..decode.requests import Request
from ..errors import MTPError
from ..checkpoint.loading import load_processor
from ..decode.target import PromptEmbeddings


def open_images(paths: list[str]) -> list:
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as exc:
            raise MTPError(f"--image {path}: not a readable image ({exc})") from None
    return images


def processed_inputs(processor, text: str, images: list, chat: bool = True, audio: list | None = None,
                     model_type: str = "gemma4") -> dict:
    """mlx-vlm's processor output (``input_ids``, ``pixel_values``, per-model extras) for one prompt
    with images (PIL) and audio clips (16 kHz waveforms); ``chat=False`` takes ``text`` as already
    templated, one placeholder per image and clip; ``model_type`` picks mlx-vlm's prompt format."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    audio = audio or []
    if chat:
        text = apply_chat_template(processor, {"model_type": model_type}, text, num_images=len(images),
                                   num_audios=len(audio))
    return dict(prepare_inputs(processor, images=images or None, audio=audio or None, prompts=text))


def embedded_request(model, processor, text: str, images: list, chat: bool = True, audio: list | None = None,
                     **request) -> Request:
    """A ``Request`` whose prompt carries the merged text + image (+ audio) embeddings of ``model`` (mlx-vlm's)."""
    inputs = processed_inputs(processor, text, images, chat, audio, getattr(model.config, "model_type", "gemma4"))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    features = model.get_input_embeddings(ids, inputs.pop("pixel_values", None),
                                          **{k: v for k, v in inputs.items() if v is not None})
    extra = {} if getattr(features, "per_layer_inputs", None) is None else {"per_layer_inputs": features.per_layer_inputs}
    if inputs.get("mm_token_type_ids") is not None:  # mlx-vlm 0.7: image tokens attend to each other in prefill
        extra["mm_token_type_ids"] = inputs["mm_token_type_ids"]
    positions = multimodal_positions(model, ids, inputs)
    return Request(ids[0].tolist(), embeddings=PromptEmbeddings(features.inputs_embeds, extra, positions), **request)


def multimodal_positions(model, ids: mx.array, inputs: dict) -> mx.array | None:
    """A prompt's mRoPE positions [3, 1, L] from the model's own ``get_rope_index`` (Qwen3.5), kept
    with the prompt: mlx-vlm keeps only the last prompt's on the model, and some releases none."""
    grids = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    rope_index = getattr(model.language_model, "get_rope_index", None)
    if rope_index is None or all(g is None for g in grids):
        return None
    return rope_index(ids, *grids)[0]


def image_request(model_dir: str | Path, model, text: str, image_paths: list[str], chat: bool, **request) -> Request:
    return embedded_request(model, load_processor(model_dir), text, open_images(image_paths), chat, **request)
