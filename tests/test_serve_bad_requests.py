"""``omlx-mtp serve`` survives bad requests.  mlx-lm's own server lets some take it down: an empty
prompt or ``"stop": 5`` kills its generation thread (every later request: 404 "generation thread
died"), a logit-bias token id past the logits kills the process (an out-of-bounds index),
``"stream_options": {}`` ends a stream without ``[DONE]``, ``/v1/models`` without a Hugging Face
cache sends 200 and no body, a client that hangs up logs a traceback, and a model that can't load
leaves a server listening.

One server per path, each on the shipped demo Qwen3.5 (its own MTP head), on a free 127.0.0.1 port,
with ``HF_HOME`` an empty directory: with MTP, and with ``mtp_enabled: false`` from ``--settings``
(mlx-lm's own generator).  Each runs the CLI through a wrapper that plants one fault: a request
with ``max_tokens`` 13 fails inside the generation loop (the other requests never meet it).  Every
bad request is answered 400 with one line of JSON, and the next good request gets the same answer
as before them all; no log holds a traceback."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from omlx_mtp.fixtures.demo import demo_qwen
from omlx_mtp.hosts.server_guards import BadRequest, bounded_logit_bias, check_request

from .test_serve import ENV, PY, ROOT, SCRIPT, _free_port, disconnect_mid_stream, served
from .test_input_mistakes import gather_mm_takes_bf16

TEXT, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {TEXT: {"prompt": "def parse_args(argv):", "max_tokens": 8, "temperature": 0},
        CHAT: {"messages": [{"role": "user", "content": "class Queue:"}], "max_tokens": 8, "temperature": 0}}
FAULT_TOKENS = 13
WRAPPER = f'''
"""omlx-mtp's CLI with a fault planted: a request with max_tokens={FAULT_TOKENS} fails inside the
generation loop at its first token, in the MTP generator and in mlx-lm's."""
import importlib
import sys

from omlx_mtp.hosts.mlx_lm_server import ServerMTPBatchGenerator
from omlx_mtp.tools.cli import main

marked = set()


def plant(cls):
    insert, step = cls.insert_segments, cls.next

    def insert_segments(self, segments, max_tokens=None, **kwargs):
        uids = insert(self, segments, max_tokens=max_tokens, **kwargs)
        if max_tokens and max_tokens[0] == {FAULT_TOKENS}:
            marked.update((id(self), uid) for uid in uids)
        return uids

    def next(self):
        progress, responses = step(self)
        if any((id(self), r.uid) in marked for r in responses):
            marked.clear()
            raise RuntimeError("planted fault")
        return progress, responses

    cls.insert_segments, cls.next = insert_segments, next


for cls in (ServerMTPBatchGenerator, importlib.import_module("mlx_lm.generate").BatchGenerator):
    plant(cls)
sys.exit(main(sys.argv[1:]))
'''

NAN, INF = float("nan"), float("inf")
BAD = [  # (path, fields over the good request's)
    (TEXT, {"prompt": ""}), (TEXT, {"prompt": None}), (TEXT, {"prompt": 5}),
    (TEXT, {"stop": 5}), (TEXT, {"stop": ["\n", 5]}), (TEXT, {"stop": [""]}), (CHAT, {"stop": {"a": 1}}),
    (TEXT, {"logit_bias": {"1000000": 1.0}}), (TEXT, {"logit_bias": {"-1": 1.0}}),
    (TEXT, {"logit_bias": {"one": 1.0}}), (TEXT, {"logit_bias": {"5": "high"}}), (TEXT, {"logit_bias": {"5": None}}),
    (TEXT, {"logit_bias": {"5": NAN}}), (TEXT, {"logit_bias": [5]}),
    (TEXT, {"stream": True, "stream_options": 5}), (TEXT, {"stream": True, "stream_options": {"include_usage": "yes"}}),
    (TEXT, {"stream": "yes"}),
    (TEXT, {"max_tokens": -1}), (TEXT, {"max_tokens": 0}), (TEXT, {"max_tokens": 2.5}), (TEXT, {"max_tokens": True}),
    (CHAT, {"max_completion_tokens": "8"}),
    (TEXT, {"temperature": NAN}), (TEXT, {"temperature": INF}), (TEXT, {"temperature": -0.5}),
    (CHAT, {"temperature": "hot"}), (TEXT, {"top_p": 1.5}), (TEXT, {"top_p": NAN}), (TEXT, {"min_p": -0.1}),
    (TEXT, {"top_k": -1}), (TEXT, {"top_k": 100000}), (TEXT, {"top_k": 2.5}),
    (TEXT, {"repetition_penalty": INF}), (TEXT, {"presence_penalty": NAN}), (TEXT, {"frequency_penalty": "x"}),
    (TEXT, {"n": 2}), (TEXT, {"logprobs": 5}), (TEXT, {"top_logprobs": 50}), (TEXT, {"top_logprobs": True}),
    (TEXT, {"seed": -1}), (TEXT, {"model": 5}),
    (CHAT, {"messages": []}), (CHAT, {"messages": None}), (CHAT, {"messages": "hello"}),
    (CHAT, {"messages": [{"content": "hi"}]}), (CHAT, {"messages": [{"role": "user", "content": 5}]}),
    (CHAT, {"chat_template_kwargs": "think"}), (CHAT, {"tools": "none"}),
]


def post(url: str, path: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def answer(url: str, path: str = TEXT, **fields) -> str:
    status, raw = post(url, path, {**GOOD[path], **fields})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return choice["text"] if path == TEXT else choice["message"]["content"]


def events(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def clean(log) -> str:
    text = log.read_text()
    assert "Traceback" not in text and "generation thread died" not in text, text[-3000:]
    return text


@pytest.fixture(scope="module", params=["mtp", "plain"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"bad-{request.param}")
    model = demo_qwen(root / "model")
    wrapper = root / "planted_fault.py"
    wrapper.write_text(WRAPPER)
    (root / "hf-home").mkdir()
    settings = []
    if request.param == "plain":
        (root / "plain.yaml").write_text("mtp_enabled: false\n")
        settings = ["--settings", str(root / "plain.yaml")]
    port, log = _free_port(), root / "server.log"
    command = ["env", "-u", "HF_HUB_CACHE", "-u", "HUGGINGFACE_HUB_CACHE", f"HF_HOME={root / 'hf-home'}",
               PY, str(wrapper), "serve", "--model", str(model), *settings, "--port", str(port)]
    with served(command, log, port, timeout=120) as url:
        expected = {path: answer(url, path) for path in GOOD}
        assert ("MTP on for" if request.param == "mtp" else "MTP off for") in log.read_text()
        yield SimpleNamespace(url=url, log=log, model=model, expected=expected)
    clean(log)


def test_bad_requests_are_answered_400_in_one_line_and_the_server_goes_on(server):
    for path, fields in BAD:
        status, raw = post(server.url, path, {**GOOD[path], **fields})
        assert status == 400, (fields, status, raw)
        lines = raw.splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["error"], (fields, raw)
    assert {path: answer(server.url, path) for path in GOOD} == server.expected  # the thread is alive
    assert clean(server.log).count("omlx-mtp: refused POST") == len(BAD)


def test_a_stream_with_empty_stream_options_ends_with_done(server):
    for options in ({}, {"include_usage": True}):
        status, raw = post(server.url, TEXT, {**GOOD[TEXT], "stream": True, "stream_options": options})
        got = events(raw)
        assert status == 200 and got[-1] == "[DONE]", raw[-500:]
        chunks = [json.loads(e) for e in got[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == server.expected[TEXT]
        assert ("usage" in chunks[-1]) == bool(options)
    clean(server.log)


def test_a_request_failing_inside_generation_ends_alone(server):
    before = server.log.read_text().count("omlx-mtp: generation failed")
    status, raw = post(server.url, TEXT, {**GOOD[TEXT], "max_tokens": FAULT_TOKENS})
    assert status == 500 and len(raw.splitlines()) == 1 and "planted fault" in json.loads(raw)["error"], raw
    status, raw = post(server.url, CHAT, {**GOOD[CHAT], "max_tokens": FAULT_TOKENS, "stream": True})
    got = events(raw)  # the stream says why and ends, without [DONE]
    assert status == 200 and "planted fault" in json.loads(got[-1])["error"] and "[DONE]" not in got, raw
    assert {path: answer(server.url, path) for path in GOOD} == server.expected
    assert clean(server.log).count("omlx-mtp: generation failed") == before + 2


def test_a_client_that_hangs_up_is_one_log_line(server):
    before = server.log.read_text().count("went away")
    disconnect_mid_stream(server.url, GOOD[TEXT]["prompt"])
    deadline = time.monotonic() + 20
    while server.log.read_text().count("went away") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert answer(server.url) == server.expected[TEXT]
    text = clean(server.log)
    assert text.count("went away") == before + 1, text[-3000:]


def test_models_is_json_without_a_hugging_face_cache(server):
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as reply:
        assert reply.status == 200
        listed = json.loads(reply.read())
    assert [m["id"] for m in listed["data"]] == [str(server.model.resolve())]
    clean(server.log)


def test_a_model_that_cannot_load_stops_serve_before_it_listens(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    for model in ("/nonexistent", str(broken)):
        started = time.monotonic()
        done = subprocess.run([PY, str(SCRIPT), "serve", "--model", model, "--port", str(_free_port())],
                              capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=45)
        errors = [line for line in done.stderr.splitlines() if line.startswith("omlx-mtp: error:")]
        assert done.returncode == 2 and len(errors) == 1 and model in errors[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr + done.stdout and "Starting httpd" not in done.stderr
        assert time.monotonic() - started < 45


# -- the pieces, in process ----------------------------------------------------------------------

def test_request_checks():
    assert check_request(GOOD[TEXT], text=True, vocabulary=1024) is None
    assert check_request({**GOOD[CHAT], "stream_options": {}}, text=False) == {"include_usage": False}
    assert check_request({**GOOD[TEXT], "logit_bias": {"1023": -5}, "stop": ["\n"], "seed": 3}, text=True,
                         vocabulary=1024) is None
    for fields, message in [({"logit_bias": {"1024": 1}}, "out of the vocabulary"), ({"n": 2}, "only one choice"),
                            ({"top_k": 1024}, "smaller than the vocabulary"), ({"top_p": 2}, "top_p")]:
        with pytest.raises(BadRequest, match=message):
            check_request({**GOOD[TEXT], **fields}, text=True, vocabulary=1024)
    assert check_request({**GOOD[TEXT], "logit_bias": {"5000": 1}}, text=True) is None  # vocabulary unknown


def test_a_logit_bias_past_the_logits_is_left_out():
    import mlx.core as mx

    processor = bounded_logit_bias({3: 1.5, 50: 2.0})
    out = processor(None, mx.zeros((2, 10)))
    assert out.shape == (2, 10) and out[:, 3].tolist() == [1.5, 1.5] and float(out.sum()) == 3.0


def test_a_bf16_moe_is_served_on_a_cpu_whose_gather_mm_takes_float32_only(tmp_path):
    """The shipped bf16 GLM demo: served as generate runs it (upcast where the CPU needs it, saying
    so once), its answers drafting with its MTP layer."""
    glm = demo_qwen(tmp_path).parent / "demo_glm"
    port, log = _free_port(), tmp_path / "server.log"
    with served([str(SCRIPT), "serve", "--model", str(glm), "--port", str(port)], log, port, timeout=120) as url:
        assert answer(url)
        assert answer(url, CHAT)
    text = clean(log)
    assert "MTP on for" in text
    assert ("runs upcast to float32" in text) == (not gather_mm_takes_bf16())
