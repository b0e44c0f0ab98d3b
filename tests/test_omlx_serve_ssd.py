"""oMLX's paged SSD cache keeps what an MTP generation wrote past a block boundary, and a new
server process resumes from it.

oMLX snapshots a running request's cache whenever its prompt + output tokens reach a multiple of
the block size (512 here: oMLX aligns its block size to the demo model's 128-token sliding
window); a finished request's cache is stored up to the last such snapshot, since a sliding
layer's cache cannot be cut back to a block boundary afterwards.  MTP rounds end on those
boundaries so that the snapshot can be taken.  A prompt shorter than a block generates past 512
tokens with MTP; oMLX's log must show the cache stored from the boundary snapshot.  A new server
on the same base path (so the same SSD cache) then gets the prompt plus the continuation's tokens
up to 20 past the boundary: its first block must come from the SSD (512 cached tokens) and what it
generates must equal the same request served without a cache — by the plain model, which never
saw these tokens.  (Without the snapshot oMLX files the request's end-of-generation sliding state
under the block, and the resumed request then generates something else.)

The requests go through /v1/completions (raw text, no chat template): the second prompt begins
with the same token ids as the first request's prompt and output where the generated text
re-tokenizes as generated, which the test checks with the model's own tokenizer (saying so if it
does not), so oMLX's HTTP API is enough and no in-process driving is needed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .test_omlx_serve import SERVES, demo_models, omlx_server

httpx = pytest.importorskip("httpx")
pytestmark = SERVES

BLOCK = 512  # oMLX's block size for the demo model (4 × its 128-token sliding window)
# Ends inside a call, so the continuation's first token neither merges with the prompt's last nor
# starts with a space (oMLX's detokenizer drops a completion's leading space).
PROMPT = "".join(f"def handler_{i}(request):\n    return request.get({i})\n\n" for i in range(20)) + "def handler_20("


def complete(url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """One raw-text completion at temperature 0: (text, usage)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
    return reply["choices"][0]["text"], reply["usage"]


def stored_blocks(base: Path) -> list[Path]:
    return sorted((base / "cache").glob("*/*.safetensors"))


def wait_for_stored_blocks(base: Path, timeout: float = 60) -> list[Path]:
    """oMLX writes blocks to the SSD in the background: wait until some are there and no more come."""
    deadline, seen = time.time() + timeout, None
    while time.time() < deadline:
        blocks = stored_blocks(base)
        if blocks and blocks == seen:
            return blocks
        seen = blocks
        time.sleep(1.0)
    return stored_blocks(base)


def test_mtp_boundary_snapshot_resumes_from_ssd_in_a_new_server(tmp_path):
    from transformers import AutoTokenizer

    tree, models, base = demo_models(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(models / "demo-mtp")
    prompt_ids = tokenizer.encode(PROMPT)
    assert len(prompt_ids) < BLOCK  # the boundary falls in what MTP generates, not in the prefill

    first_log = tmp_path / "first.log"
    with omlx_server(tree, models, base, first_log) as (url, _):
        continuation, usage = complete(url, "demo-mtp", PROMPT, max_tokens=80)
        blocks = wait_for_stored_blocks(base)
    log = first_log.read_text()
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == len(prompt_ids) and BLOCK + 20 < total, usage
    assert "omlx-mtp: request uid" in log and " 0 of " not in log  # it ran MTP rounds and drafts were kept
    assert "Using boundary cache snapshot" in log and f"storing {BLOCK}/{total} tokens" in log, log[-4000:]
    assert blocks, "oMLX stored no block on the SSD"

    # The second prompt: the first request's tokens up to 20 past the boundary (not all of them:
    # a cache stored from the request's end would then happen to fit it too).
    sequence = tokenizer.encode(PROMPT + continuation)
    assert sequence[: len(prompt_ids)] == prompt_ids and len(sequence) == total, (
        "the continuation re-tokenizes differently: the SSD blocks cannot match by token ids")
    resumed_prompt = tokenizer.decode(sequence[: BLOCK + 20])
    assert tokenizer.encode(resumed_prompt) == sequence[: BLOCK + 20]

    second_log = tmp_path / "second.log"
    with omlx_server(tree, models, base, second_log) as (url, _):
        from_ssd, ssd_usage = complete(url, "demo-mtp", resumed_prompt, max_tokens=40)
        uncached, plain_usage = complete(url, "demo-plain", resumed_prompt, max_tokens=40)
    log = second_log.read_text()
    assert f"existing_files={len(blocks)}" in log  # the new process found the first one's blocks on the SSD
    assert ssd_usage["prompt_tokens_details"]["cached_tokens"] == BLOCK, (ssd_usage, log[-4000:])
    assert plain_usage["prompt_tokens_details"]["cached_tokens"] == 0  # another model: never saw these tokens
    assert from_ssd == uncached and ssd_usage["completion_tokens"] == 40
