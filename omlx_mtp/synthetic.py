"""In-memory target + drafter pairs at real widths, random weights, for benchmarks.

``gemma4-31b-shaped``: Gemma 4 31B's widths (hidden 5376, 32 query heads, head_dim 256 / global 512,
16 K/V heads / 4 on K-eq-V full layers, MLP 21504, vocab 262144) with only a few layers, and a
31B-shaped assistant (hidden 1024, 4 layers, tied 262144 x 1024 head).  A decode step then reads
gigabytes of weights — the memory-bound regime of a large model — on a machine that fits it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma4_text

from .targets import wrap_target
from .drafters.gemma4_assistant import Gemma4AssistantDrafter, normalize_assistant_config
from .errors import MTPError
from .gemma4_config import FULL, GEMMA4_ROPE, SLIDING

SHAPES = {
    # Qwen3.5-27B: hidden 5120, 24 query / 4 K/V heads of 256, MLP 17408, Gated DeltaNet with 16 key /
    # 48 value heads of 128, full attention every 4th layer, vocab 248320, one built-in MTP layer.
    "qwen3.5-27b-shaped": {
        "target": {"hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4,
                   "head_dim": 256, "vocab_size": 248320, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                   "full_attention_interval": 4, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}},
    },
    "gemma4-31b-shaped": {
        "target": {"hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
                   "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
                   "vocab_size": 262144, "sliding_window": 1024},
        "assistant": {"hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 4096,
                      "num_attention_heads": 32},
    },
}


def synthetic_pair(name: str, layers: int = 2, dtype: str = "bfloat16"):
    """(target model, assistant drafter) with random weights, evaluated in ``dtype``."""
    if name not in SHAPES:
        raise MTPError(f"--synthetic {name!r}: known shapes are {', '.join(SHAPES)}")
    shape = SHAPES[name]
    if name.startswith("qwen"):
        return _qwen_pair(shape, layers, dtype)
    types = ([SLIDING] * (layers - 1) + [FULL])[:layers]
    target_config = {
        "model_type": "gemma4_text", "num_hidden_layers": layers, "layer_types": types, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False,
        "enable_moe_block": False, "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
        "rope_parameters": GEMMA4_ROPE, **shape["target"],
    }
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(target_config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    text = {
        "model_type": "gemma4_text", "layer_types": [SLIDING] * (shape["assistant"]["num_hidden_layers"] - 1) + [FULL],
        "num_key_value_heads": shape["target"]["num_key_value_heads"], "head_dim": shape["target"]["head_dim"],
        "global_head_dim": shape["target"]["global_head_dim"], "vocab_size": shape["target"]["vocab_size"],
        "sliding_window": shape["target"]["sliding_window"], "final_logit_softcapping": None,
        "tie_word_embeddings": True, "rope_parameters": GEMMA4_ROPE, **shape["assistant"],
    }
    assistant = {"model_type": "gemma4_assistant", "backbone_hidden_size": shape["target"]["hidden_size"],
                 "use_ordered_embeddings": False, "text_config": text}
    drafter = Gemma4AssistantDrafter(normalize_assistant_config(assistant, name))
    drafter.set_dtype(getattr(mx, dtype))
    mx.eval(drafter.parameters())
    return wrap_target(model), drafter


def _qwen_pair(shape: dict, layers: int, dtype: str):
    """A Qwen3.5-shaped hybrid target (``layers`` layers, the last of each 4 full attention, at least
    one) and its built-in MTP head."""
    from mlx_lm.models import qwen3_5

    from .drafters.qwen3_5_mtp import Qwen35MTPHead

    text = {"model_type": "qwen3_5_text", "num_hidden_layers": layers, **shape["target"]}
    text["full_attention_interval"] = min(text["full_attention_interval"], layers)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    model.set_dtype(getattr(mx, dtype))
    head = Qwen35MTPHead(model.language_model.args)
    head.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters(), head.parameters())
    return wrap_target(model), head
