"""Structured output from oMLX 0.3.8 with MTP on: its own xgrammar processor, drafting.

The demo pair is served twice (``demo-mtp`` with MTP, ``demo-plain`` without); a JSON-schema
``response_format``, a vLLM-style ``structured_outputs`` grammar and a tool-call request must
answer the same text at temperature 0 on both, parse against their schema, and the MTP
requests' rounds must keep drafts (the log's tokens per round above one)."""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest


from omlx_mtp.tools import soak

from .test_omlx_serve import SERVES, demo_models, mtp_lines, omlx_server

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytestmark = SERVES

FILE = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "count": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "kind": {"enum": ["file", "dir", "link"]}}}
TOOL_CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"enum": ["read_file", "list_dir"]},
                            "arguments": {"type": "object", "additionalProperties": False, "required": ["path"],
                                          "properties": {"path": {"type": "string", "maxLength": 24}}}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} at a path",
                                           "parameters": TOOL_CALL["properties"]["arguments"]}}
         for name in ("read_file", "list_dir")]
COMPACT_FILE = soak.GRAMMAR  # compact JSON for FILE's fields
PROMPTS = ["Describe one file as JSON.", "import os\nimport sys\n", "def parse_args(argv):"]
ROUNDS = re.compile(r"(\d+) tokens in (\d+) rounds, (\d+) of (\d+) drafts accepted")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-grammar")
    tree, models, base = demo_models(root)
    with omlx_server(tree, models, base, root / "server.log") as (url, _):
        yield url, root / "server.log"


def complete(url, model, content, stream=False, max_tokens=120, **extra):
    """(text, finish_reason, tool_calls) of one chat completion at temperature 0."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], choice["message"].get("tool_calls")
    text, finish = "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line[6:] != "[DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish, None


@functools.lru_cache(maxsize=1)
def _compiler():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from omlx_mtp.fixtures.demo import PAIR_DIR

    tokenizer = AutoTokenizer.from_pretrained(PAIR_DIR / "target")
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)), tokenizer.all_special_tokens


def grammar_allows(request: dict, text: str) -> bool:
    """``text`` is a prefix of what the request's ``structured_outputs`` or ``response_format``
    allows (compiled as oMLX compiles it), a closing stop token aside (oMLX's VLM engine leaves
    its text in)."""
    import xgrammar as xgr

    compiler, specials = _compiler()
    for special in specials:
        if special and text.endswith(special):
            text = text[: -len(special)]
    if "structured_outputs" in request:
        options = request["structured_outputs"]
        compiled = (compiler.compile_grammar(options["grammar"]) if "grammar" in options
                    else compiler.compile_json_schema(json.dumps(options["json"])))
    else:
        compiled = compiler.compile_json_schema(json.dumps(request["response_format"]["json_schema"]["schema"]))
    return xgr.GrammarMatcher(compiled).accept_string(text)


def rounds_since(log_path, before: int) -> list[tuple[int, int, int, int]]:
    return [tuple(map(int, ROUNDS.search(line).groups())) for line in mtp_lines(log_path)[before:]]


def tokens_per_round(stats) -> float:
    return sum(s[0] for s in stats) / sum(s[1] for s in stats)


REQUESTS = {
    "response_format": dict(response_format={"type": "json_schema",
                                             "json_schema": {"name": "file", "schema": FILE, "strict": True}}),
    "structured_outputs": dict(structured_outputs={"grammar": COMPACT_FILE}),
    "tool_call": dict(tools=TOOLS, structured_outputs={"json": TOOL_CALL}),
}


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_constrained_mtp_equals_plain_and_drafts(server, kind):
    url, log_path = server
    extra = REQUESTS[kind]
    before, finished = len(mtp_lines(log_path)), 0
    for stream in (False, True):
        for prompt in PROMPTS:
            ours = complete(url, "demo-mtp", prompt, stream, **extra)
            assert ours[:2] == complete(url, "demo-plain", prompt, stream, **extra)[:2], (kind, prompt, stream)
            text, finish, _ = ours
            assert grammar_allows(extra, text), text  # never a character the grammar forbids
            if finish == "stop":
                finished += 1
                jsonschema.validate(json.loads(text), TOOL_CALL if kind == "tool_call" else FILE)
    if kind == "structured_outputs":  # compact JSON: this small model closes it (free whitespace it pads)
        assert finished == 2 * len(PROMPTS)
    stats = rounds_since(log_path, before)
    assert len(stats) == 2 * len(PROMPTS)
    assert tokens_per_round(stats) > 1.3, stats  # constrained rounds keep drafts
    print(f"{kind}: {tokens_per_round(stats):.2f} tokens per round, "
          f"{sum(s[2] for s in stats)} of {sum(s[3] for s in stats)} drafts accepted")


def test_constrained_and_free_requests_at_once(server):
    """Grammar rows and free rows share batches; each answer equals the plain model's."""
    url, log_path = server
    jobs = [(p, REQUESTS[k]) for p in PROMPTS for k in ("structured_outputs", "tool_call")] + [(p, {}) for p in PROMPTS]
    expected = [complete(url, "demo-plain", p, **extra)[:2] for p, extra in jobs]
    before = len(mtp_lines(log_path))
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: complete(url, "demo-mtp", job[0], **job[1])[:2], jobs))
    assert got == expected
    free = rounds_since(log_path, before)
    assert len(free) == len(jobs)
    before = len(mtp_lines(log_path))
    for prompt in PROMPTS:
        complete(url, "demo-mtp", prompt)
    print(f"free text alone: {tokens_per_round(rounds_since(log_path, before)):.2f} tokens per round")
