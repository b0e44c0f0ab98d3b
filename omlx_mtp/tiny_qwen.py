"""Tiny Qwen3.5-shaped checkpoints (dense or MoE) with a built-in MTP head and random weights,
laid out as Qwen publishes them: ``model.language_model.*`` trunk, ``lm_head``, top-level ``mtp.*``,
RMSNorm weights stored as offsets from 1, the conv1d weight as [C, 1, k], MoE trunk experts fused
(``experts.gate_up_proj``) and the head's experts per expert (Qwen3.5) or fused (Qwen3.6).  With
``vision=True`` the checkpoint also has a small vision tower (``vision_config``, ``model.visual.*``,
made by mlx-vlm's own tower), as every published Qwen3.5 / 3.6 checkpoint does: oMLX then serves
it through its VLM engine.

The weights are made by mlx-lm's own model (and this package's head) and written back in the
published convention, so loading them exercises mlx-lm's sanitizer and ours."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import qwen3_5

from .drafters.qwen3_5_mtp import NORMS as HEAD_NORMS, Qwen35MTPHead
from .tiny import TinySpec, randomize, rename_tokens, write_tokenizer

_TRUNK_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")



@dataclass
class TinyQwenSpec:
    moe: bool = False
    head_experts: str = "per_expert"  # or "fused" (the MTP layer's MoE experts, MoE only)
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    full_attention_interval: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    embed_std: float = 0.02
    layer_std: float = 0.3
    dtype: str = "float32"
    vision: bool = False


# Qwen's vision markers, on the top ids of the vocabulary (the byte-level tokens come first).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(vocab_size: int) -> dict[str, int]:
    return {token: vocab_size - len(VISION_TOKENS) + i for i, token in enumerate(VISION_TOKENS)}


def text_config(spec: TinyQwenSpec) -> dict:
    config = {
        "model_type": "qwen3_5_moe_text" if spec.moe else "qwen3_5_text",
        "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": spec.full_attention_interval,
        "layer_types": ["full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
                        for i in range(spec.num_layers)],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attn_output_gate": True,
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    }
    if spec.moe:
        config.update(num_experts=spec.num_experts, num_experts_per_tok=2, moe_intermediate_size=spec.hidden_size // 2,
                      shared_expert_intermediate_size=spec.hidden_size // 2, decoder_sparse_step=1, norm_topk_prob=True)
    return config


def vision_config(text_hidden_size: int = 64) -> dict:
    """A one-block tower whose merger feeds the text model's width."""
    return {"model_type": "qwen3_5", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
            "out_hidden_size": text_hidden_size,
            "num_heads": 2, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 16, "in_channels": 3, "deepstack_visual_indexes": []}


def published_config(spec: TinyQwenSpec) -> dict:
    moe = spec.moe
    config = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text_config(spec),
        "tie_word_embeddings": False,
    }
    if spec.vision:
        ids = vision_token_ids(spec.vocab_size)
        config.update(vision_config=vision_config(spec.hidden_size), image_token_id=ids["<|image_pad|>"],
                      video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                      vision_end_token_id=ids["<|vision_end|>"])
    return config


def tower_tensors(spec: TinyQwenSpec, seed: int) -> dict:
    """A random vision tower under its published names (the patch embedding in PyTorch's layout)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models.qwen3_5 import VisionModel
    from mlx_vlm.models.qwen3_5.config import VisionConfig

    tower = VisionModel(VisionConfig.from_dict(vision_config(spec.hidden_size)))
    rng = np.random.default_rng(seed)
    weights = randomize(tower, TinySpec(layer_std=0.05, dtype=spec.dtype), rng)
    for name, value in weights.items():  # small weights, biases near zero: features as large as a token embedding, one per image
        if name.endswith(".bias"):
            weights[name] = mx.array(rng.normal(0, 0.02, value.shape).astype(np.float32)).astype(value.dtype)
    tower.load_weights(list(weights.items()))
    out = {}
    for name, value in tree_flatten(tower.parameters()):
        if name.endswith("patch_embed.proj.weight"):
            value = value.moveaxis(-1, 1)  # [out, kt, kh, kw, in] -> [out, in, kt, kh, kw]
        out["model.visual." + name] = value.astype(getattr(mx, spec.dtype))
    return out


def build(spec: TinyQwenSpec, seed: int = 0) -> tuple[qwen3_5.Model, Qwen35MTPHead]:
    """mlx-lm's model and the head, with random weights in mlx-lm's convention."""
    rng = np.random.default_rng(seed)
    like = TinySpec(embed_std=spec.embed_std, layer_std=spec.layer_std, dtype=spec.dtype)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(published_config(spec)))
    model.load_weights(list(randomize(model, like, rng).items()))
    head = Qwen35MTPHead(model.language_model.args)
    head.load_weights(list(randomize(head, like, rng).items()))
    mx.eval(model.parameters(), head.parameters())
    return model, head


def published_tensors(model: qwen3_5.Model, head: Qwen35MTPHead, spec: TinyQwenSpec) -> dict:
    """mlx-lm's weights written back as Qwen publishes them."""
    from mlx.utils import tree_flatten

    out = {}
    for name, value in tree_flatten(model.parameters()):
        name = name.replace("language_model.model.", "model.language_model.").replace("language_model.lm_head.", "lm_head.")
        if name.endswith("conv1d.weight"):
            value = value.moveaxis(1, 2)
        if value.ndim == 1 and name.endswith(_TRUNK_NORMS):
            value = value - 1.0
        out[name] = value
    _fuse_experts(out, "model.language_model.layers.")
    for name, value in tree_flatten(head.parameters()):
        if value.ndim == 1 and name.endswith(HEAD_NORMS):
            value = value - 1.0
        out["mtp." + name] = value
    if spec.head_experts == "fused":
        _fuse_experts(out, "mtp.layers.")
    else:
        for name in [n for n in out if n.startswith("mtp.") and ".switch_mlp." in n]:
            stacked = out.pop(name)
            base, rest = name.split(".switch_mlp.")
            for e in range(stacked.shape[0]):
                out[f"{base}.experts.{e}.{rest}"] = stacked[e]
    return out


def _fuse_experts(tensors: dict, prefix: str) -> None:
    for gate in [n for n in tensors if n.startswith(prefix) and n.endswith("switch_mlp.gate_proj.weight")]:
        base = gate[: -len("switch_mlp.gate_proj.weight")]
        up = tensors.pop(base + "switch_mlp.up_proj.weight")
        tensors[base + "experts.gate_up_proj"] = mx.concatenate([tensors.pop(gate), up], axis=-2)
        tensors[base + "experts.down_proj"] = tensors.pop(base + "switch_mlp.down_proj.weight")


def write_qwen(directory: str | Path, spec: TinyQwenSpec | None = None, seed: int = 0, with_head: bool = True) -> Path:
    """A checkpoint directory (config, safetensors, tokenizer) in the published layout."""
    spec = spec or TinyQwenSpec()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model, head = build(spec, seed)
    tensors = published_tensors(model, head, spec)
    if not with_head:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    if spec.vision:
        tensors.update(tower_tensors(spec, seed))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(published_config(spec), indent=2))
    write_tokenizer(directory, spec.vocab_size)
    if spec.vision:
        add_processor(directory, spec.vocab_size)
    return directory


def add_vision(source: str | Path, directory: str | Path, seed: int = 0) -> Path:
    """A copy of a text-only checkpoint of this layout with a random vision tower and the files a
    host's processor reads: as a published Qwen3.5 it then loads through mlx-vlm (oMLX's VLM engine).
    The tokenizer's top ids become the vision markers."""
    import shutil

    source, directory = Path(source), Path(directory)
    shutil.copytree(source, directory)
    config = json.loads((source / "config.json").read_text())
    text = config["text_config"]
    vocab_size = text["vocab_size"]
    spec = TinyQwenSpec(vocab_size=vocab_size, hidden_size=text["hidden_size"], vision=True)
    vision = {k: v for k, v in published_config(spec).items() if k not in ("text_config", "model_type", "architectures")}
    (directory / "config.json").write_text(json.dumps({**config, **vision}, indent=2))
    tensors = dict(mx.load(str(source / "model.safetensors")))
    tensors.update(tower_tensors(replace(spec, dtype=str(tensors["lm_head.weight"].dtype).split(".")[-1]), seed))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    add_processor(directory, vocab_size)
    return directory


# The demo turns, with Qwen's image placeholder for image content.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def add_processor(directory: Path, vocab_size: int) -> None:
    """Vision markers in the tokenizer, a chat template that places images, and mlx-vlm's Qwen3-VL
    image processor settings (small images: a few soft tokens each)."""
    ids = vision_token_ids(vocab_size)
    rename_tokens(directory / "tokenizer.json", ids)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.update(processor_class="Qwen3VLProcessor", image_token="<|image_pad|>",
                            video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                            vision_end_token="<|vision_end|>", chat_template=VISION_CHAT_TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "chat_template.jinja").write_text(VISION_CHAT_TEMPLATE)
    config = vision_config()
    image = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
             "patch_size": config["patch_size"], "temporal_patch_size": config["temporal_patch_size"],
             "merge_size": config["spatial_merge_size"], "min_pixels": 16 * 16, "max_pixels": 32 * 32,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2))


def image_request(model, before: list[int], after: list[int], seed: int, grid: int = 4, **request):
    """A ``Request`` whose prompt holds one random image (``grid`` x ``grid`` patches) between the
    text tokens ``before`` and ``after``, embedded by mlx-vlm's Qwen3.5 model ``model`` as oMLX's
    VLM engine embeds it (the tower's features merged in, mRoPE positions for the whole prompt)."""
    from .decode.loop import Request
    from .multimodal import multimodal_positions
    from .targets.base import PromptEmbeddings

    config = vision_config()
    merged = grid * grid // config["spatial_merge_size"] ** 2
    markers = model.config
    ids = (before + [markers.vision_start_token_id] + [markers.image_token_id] * merged
           + [markers.vision_end_token_id] + after)
    patch = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    pixels = mx.array(np.random.default_rng(seed).normal(0, 1, (grid * grid, patch)).astype(np.float32))
    inputs = {"image_grid_thw": mx.array([[1, grid, grid]])}
    features = model.get_input_embeddings(mx.array([ids]), pixels, **inputs)
    positions = multimodal_positions(model, mx.array([ids]), inputs)
    return Request(ids, embeddings=PromptEmbeddings(features.inputs_embeds, {}, positions), **request)
