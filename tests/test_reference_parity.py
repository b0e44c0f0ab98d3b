"""The drafter matches Hugging Face transformers' Gemma4AssistantForCausalLM on the same weights.

The checkpoint is written by transformers itself (save_pretrained), so this also proves that
the genuine layout and transformers' per_layer_config spelling load.  Tolerance: both run in
float32; after a handful of layers the two frameworks' different summation orders leave
differences around 1e-6 relative, so 1e-4 absolute on O(1) logits is tight yet safe."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0 for this test)")
transformers = pytest.importorskip("transformers")

import mlx.core as mx  # noqa: E402

from omlx_mtp.drafters.gemma4_assistant import load_gemma4_assistant  # noqa: E402

BACKBONE, HIDDEN, VOCAB, WINDOW, SEQ = 48, 32, 256, 8, 21
HEAD_DIM, GLOBAL_HEAD_DIM, KV_HEADS = 16, 32, 2


def make_hf(centroid: bool, tmp_path):
    text = transformers.Gemma4TextConfig(
        hidden_size=HIDDEN, num_hidden_layers=3, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, global_head_dim=GLOBAL_HEAD_DIM, vocab_size=VOCAB,
        sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=3,
        initializer_range=0.2,
    )
    config = transformers.Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=BACKBONE, use_ordered_embeddings=centroid,
        num_centroids=16, centroid_intermediate_top_k=4,
    )
    torch.manual_seed(0)
    model = transformers.Gemma4AssistantForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
        if centroid:
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("centroid", [False, True], ids=["tied-head", "centroid-head"])
@pytest.mark.parametrize("position", [SEQ - 1, SEQ])
def test_drafter_matches_transformers(tmp_path, centroid, position):
    hf = make_hf(centroid, tmp_path)
    ours = load_gemma4_assistant(tmp_path)
    rng = np.random.default_rng(1)
    embeds = rng.normal(0, 1, (1, 1, 2 * BACKBONE)).astype(np.float32)
    kv = {
        "sliding_attention": [rng.normal(0, 1, (1, KV_HEADS, SEQ, HEAD_DIM)).astype(np.float32) for _ in range(2)],
        "full_attention": [rng.normal(0, 1, (1, KV_HEADS, SEQ, GLOBAL_HEAD_DIM)).astype(np.float32) for _ in range(2)],
    }
    with torch.no_grad():
        out = hf(
            inputs_embeds=torch.from_numpy(embeds),
            position_ids=torch.tensor([[position]]),
            shared_kv_states={k: tuple(torch.from_numpy(a) for a in v) for k, v in kv.items()},
        )
    ref_logits, ref_state = out.logits.numpy()[0, 0], out.last_hidden_state.numpy()[0, 0]

    visible_sliding = mx.arange(SEQ) >= SEQ - ours.visible_span("sliding_attention", WINDOW)
    masks = {
        "sliding_attention": visible_sliding[None, None, None, :],
        "full_attention": mx.ones((1, 1, 1, SEQ), dtype=mx.bool_),
    }
    logits, state = ours(
        mx.array(embeds[..., :BACKBONE]), mx.array(embeds[..., BACKBONE:]),
        {k: tuple(mx.array(a) for a in v) for k, v in kv.items()}, masks, position,
    )
    logits, state = np.array(logits)[0, 0], np.array(state)[0, 0]
    assert int(visible_sliding.sum()) == WINDOW + 1  # transformers' bidirectional window
    np.testing.assert_allclose(state, ref_state, atol=1e-4, rtol=1e-4)
    if centroid:
        scored = np.isfinite(logits)
        assert scored.sum() == 4 * VOCAB // 16  # top-k centroids x tokens per centroid
        # HF fills unscored tokens with (min - 1); we use -inf so no probability leaks there.
        assert (ref_logits[~scored] == ref_logits.min()).all()
        np.testing.assert_allclose(logits[scored], ref_logits[scored], atol=1e-4, rtol=1e-4)
    else:
        np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert int(np.argmax(logits)) == int(np.argmax(ref_logits))
