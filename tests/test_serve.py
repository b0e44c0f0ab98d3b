"""``omlx-mtp serve``: mlx-lm's own HTTP server with MTP decoding, against mlx-lm's own server.

The checkpoint is the shipped demo Qwen3.5 with its built-in MTP head (trained: drafts are accepted),
quantized by ``omlx-mtp quantize`` (8 bits, float32: mlx-lm's layout with an index, which mlx-lm's
pipeline loading needs), served three ways, each on a free 127.0.0.1 port: by ``python -m mlx_lm
server`` (the reference), by ``omlx-mtp serve`` (depth 3 from ``--settings``), and the same weights
without their MTP tensors by ``omlx-mtp serve`` (plain, and the log says why).  At temperature 0
every answer equals the reference's, streaming and not, four at once; the MTP server's log shows
each request drafting.  Then the same under ``mlx.launch -n 2 --backend ring`` (mlx-lm's distributed
server mode: pipeline stages where mlx-lm's model has them, tensor parallelism otherwise), equal to
the one-process answers, both ranks running every request.  Every process runs under a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from omlx_mtp.errors import MTPError
from omlx_mtp.fixtures.demo import demo_qwen
from omlx_mtp.hosts import mlx_lm_server
from omlx_mtp.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SCRIPT = Path(PY).with_name("omlx-mtp")  # the console script, as `$(which omlx-mtp)` finds it
SCRIPT = SCRIPT if SCRIPT.exists() else ROOT / "omlx_mtp" / "__main__.py"
LAUNCH = Path(shutil.which("mlx.launch") or Path(PY).with_name("mlx.launch"))
PROMPTS = ["def parse_args(argv):", "class Queue:", "import os\nimport sys\n", "    return self"]
MAX_TOKENS = 60
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
REQUEST_LINE = re.compile(r"omlx-mtp: request uid \d+ finished \((\w+)\): (\d+) tokens in (\d+) rounds, "
                          r"(\d+) of (\d+) drafts accepted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(command: list[str], log: Path, port: int, timeout: float = 150):
    """Run a server command (its own process group) until /health answers; stop the group after."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"server did not come up:\n{log.read_text()[-4000:]}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _post(url: str, path: str, body: dict) -> bytes:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        return reply.read()


def chat(url: str, content: str, stream: bool = False) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    raw = _post(url, "/v1/chat/completions", body).decode()
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: ") and line[6:] != "[DONE]":
            choices = json.loads(line[6:]).get("choices") or [{}]
            text += choices[0].get("delta", {}).get("content") or ""
    return text


def chat_usage(url: str, system: str, content: str) -> tuple[str, dict]:
    """(answer, usage) of a chat with a system prompt."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = json.loads(_post(url, "/v1/chat/completions", body))
    return reply["choices"][0]["message"]["content"], reply["usage"]


def disconnect_mid_stream(url: str, content: str) -> None:
    """Start a long streamed answer, read its first events, and hang up."""
    import http.client
    from urllib.parse import urlparse

    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 400, "temperature": 0, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    events = 0
    while events < 3:
        line = reply.fp.readline()
        assert line, "the stream ended before the client hung up"
        events += line.startswith(b"data: ")
    reply.close()  # gone, mid-answer: the socket is closed under the server's writes
    connection.close()


def complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return json.loads(_post(url, "/v1/completions", body))["choices"][0]["text"]


def request_lines(log: Path) -> list[tuple]:
    return [m.groups() for m in REQUEST_LINE.finditer(log.read_text())]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    mtp = root / "demo-qwen-q8"
    assert main(["quantize", str(demo_qwen(root / "src")), str(mtp), "--bits", "8", "--group-size", "32",
                 "--dtype", "float32"]) == 0
    plain = root / "demo-qwen-q8-no-mtp"  # the same weights without the MTP head (config unchanged)
    shutil.copytree(mtp, plain)
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (plain / "model.safetensors.index.json").write_text(json.dumps(index))
    for file in set(json.loads((mtp / "model.safetensors.index.json").read_text())["weight_map"].values()):
        if file not in index["weight_map"].values():
            (plain / file).unlink()
    settings = root / "depth3.yaml"
    settings.write_text("mtp_enabled: true\nmtp_draft_tokens: 3\n")
    return SimpleNamespace(root=root, mtp=mtp, plain=plain, settings=settings)


@pytest.fixture(scope="module")
def servers(checkpoints):
    c = checkpoints
    ports = [_free_port() for _ in range(3)]
    commands = {
        "reference": [PY, "-m", "mlx_lm", "server", "--model", str(c.mtp), "--port", str(ports[0])],
        "mtp": [PY, str(SCRIPT), "serve", "--model", str(c.mtp), "--settings", str(c.settings),
                "--port", str(ports[1]), "--log-level", "INFO"],
        "plain": [PY, str(SCRIPT), "serve", "--model", str(c.plain), "--port", str(ports[2])],
    }
    logs = {name: c.root / f"{name}.log" for name in commands}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(served(cmd, logs[name], port))
                for (name, cmd), port in zip(commands.items(), ports)}
        yield {name: SimpleNamespace(url=urls[name], log=logs[name]) for name in commands}


@pytest.fixture(scope="module")
def expected(servers):
    """mlx-lm's own server (MTP off), one request at a time."""
    return {stream: [chat(servers["reference"].url, p, stream) for p in PROMPTS] for stream in (False, True)}


def test_greedy_answers_equal_mlx_lm_streaming_and_not(servers, expected):
    mtp = servers["mtp"]
    before = len(request_lines(mtp.log))
    for stream in (False, True):
        assert [chat(mtp.url, p, stream) for p in PROMPTS] == expected[stream]
    assert complete(mtp.url, PROMPTS[0]) == complete(servers["reference"].url, PROMPTS[0])
    text = mtp.log.read_text()
    assert text.count("omlx-mtp: MTP on for") == 1, text[-3000:]
    assert "draft tokens 3" in text and "Qwen35MTPHead" in text
    lines = request_lines(mtp.log)[before:]
    assert len(lines) == 2 * len(PROMPTS) + 1
    # Every request drafted (3 per MTP round) and had drafts accepted; rounds emit several tokens.
    assert all(int(drafted) > 0 and int(accepted) > 0 for *_, accepted, drafted in lines), lines
    assert sum(int(rounds) for _, _, rounds, _, _ in lines) < sum(int(tokens) for _, tokens, _, _, _ in lines)


def test_four_concurrent_requests_equal_and_draft(servers, expected):
    mtp = servers["mtp"]
    before = len(request_lines(mtp.log))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: chat(mtp.url, p), PROMPTS))
    assert got == expected[False]
    lines = request_lines(mtp.log)[before:]
    assert len(lines) == len(PROMPTS) and all(int(accepted) > 0 for *_, accepted, _ in lines), lines


def test_a_shared_system_prompt_is_served_from_the_cache_filed_at_its_end(servers):
    """The demo Qwen3.5's caches can't be trimmed: a second chat with the first one's system
    prompt finds a cached prefix only if the cache at the system prompt's end was filed.  It is,
    as by mlx-lm's own generator: the same answers, the same cached tokens reported."""
    system = "You are a terse assistant that writes Python."
    got = {}
    for name in ("reference", "mtp"):
        chat_usage(servers[name].url, system, "class Queue:")
        got[name] = chat_usage(servers[name].url, system, "def parse_args(argv):")
    cached = {name: (usage.get("prompt_tokens_details") or {}).get("cached_tokens") for name, (_, usage) in got.items()}
    assert got["mtp"][0] == got["reference"][0]
    assert cached["mtp"] == cached["reference"] and cached["mtp"] > 0, cached


def test_model_without_mtp_serves_plainly_and_says_why(servers, expected):
    plain = servers["plain"]
    assert [chat(plain.url, p) for p in PROMPTS] == expected[False]  # the same weights, decoded plainly
    text = plain.log.read_text()
    off = [line for line in text.splitlines() if "omlx-mtp: MTP off for" in line]
    assert len(off) == 1 and "mlx-lm serves it plainly" in off[0] and "mtp" in off[0].lower(), text[-3000:]
    assert "MTP on for" not in text and not request_lines(plain.log)


def test_sampled_and_penalised_requests_draft_seeded_ones_go_plain(servers):
    mtp = servers["mtp"]
    before = len(request_lines(mtp.log))
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.9, "top_k": 50,
            "repetition_penalty": 1.1, "logit_bias": {"5": -2.0}}
    assert json.loads(_post(mtp.url, "/v1/completions", body))["choices"][0]["text"]
    lines = request_lines(mtp.log)[before:]
    assert len(lines) == 1 and int(lines[0][3]) > 0, lines  # the distribution rebuilt: it drafted
    seeded = {**body, "seed": 7}  # mlx-lm serves a seeded request alone, outside its batch generator
    assert json.loads(_post(mtp.url, "/v1/completions", seeded))["choices"][0]["text"]
    assert len(request_lines(mtp.log)) == before + 1


def mlx_lm_sharding(model_dir: Path) -> str:
    """The sharding mlx-lm's server gives this checkpoint: pipeline where its model has stages
    (mlx-lm 0.32's Qwen3.5), else tensor parallelism (0.31.3's)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir, lazy=True, strict=False)
    return "pipeline" if hasattr(getattr(model, "model", None), "pipeline") else "tensor"


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_two_ranks_under_mlx_launch_equal_one_process(checkpoints, expected, tmp_path):
    port = _free_port()
    log = tmp_path / "ranks.log"
    sharding = mlx_lm_sharding(checkpoints.mtp)
    command = [str(LAUNCH), "-n", "2", "--backend", "ring", "--python", PY, str(SCRIPT), "serve",
               "--model", str(checkpoints.mtp), "--settings", str(checkpoints.settings), "--port", str(port),
               *(["--pipeline"] if sharding == "pipeline" else [])]
    with served(command, log, port, timeout=180) as url:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: chat(url, p), PROMPTS))
        streamed = chat(url, PROMPTS[1], stream=True)
        deadline = time.monotonic() + 20  # mlx.launch forwards each rank's output as it comes
        while len(request_lines(log)) < 2 * (len(PROMPTS) + 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        text, lines = log.read_text(), request_lines(log)
        # A client that goes away mid-stream: the ranks stay in step and the next request is right.
        disconnect_mid_stream(url, PROMPTS[0])
        after = chat(url, PROMPTS[2])
    assert after == expected[False][2]
    assert got == expected[False]
    assert streamed == expected[True][1]
    assert text.count(f"2 ranks ({sharding})") == 2, text[-4000:]  # each rank's decoder holds the RankGroup
    assert len(lines) == 2 * (len(PROMPTS) + 1), lines  # both ranks ran every request
    assert all(int(accepted) > 0 for *_, accepted, _ in lines)


# -- the decision, in process -------------------------------------------------------------------

def _provider(**overrides):
    values = dict(draft_model=None, is_batchable=True, cli_args=SimpleNamespace(kv_bits=None), model=None,
                  pipeline_group=None)
    return SimpleNamespace(**{**values, **overrides})


def test_why_not_mtp(checkpoints, tmp_path):
    off = tmp_path / "off.yaml"
    off.write_text("mtp_enabled: false\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mtp_draft_token: 3\n")
    model = str(checkpoints.mtp)
    cases = [
        (_provider(), off, "mtp_enabled is false"),
        (_provider(draft_model=object()), None, "--draft-model"),
        (_provider(is_batchable=False), None, "one request at a time"),
        (_provider(cli_args=SimpleNamespace(kv_bits=4)), None, "--kv-bits"),
    ]
    for provider, settings, reason in cases:
        strategy, why = mlx_lm_server.plan_mtp(provider, model, settings)
        assert strategy is None and reason in why
    with pytest.raises(MTPError, match="unknown key 'mtp_draft_token'"):
        mlx_lm_server.plan_mtp(_provider(), model, bad)
    with pytest.raises(MTPError, match="neither a directory"):
        mlx_lm_server.plan_mtp(_provider(), str(tmp_path / "missing"), None)


def test_settings_beside_the_model(tmp_path):
    settings, source = mlx_lm_server.serve_settings(tmp_path, None)
    assert settings.mtp_enabled and source == "no settings file"
    (tmp_path / mlx_lm_server.SETTINGS_NAME).write_text("mtp_draft_tokens: 2\n")
    settings, source = mlx_lm_server.serve_settings(tmp_path, None)
    assert settings.mtp_enabled and settings.mtp_draft_tokens == 2 and source.endswith("omlx-mtp.yaml")


def test_version_check_and_restore():
    import mlx_lm
    import mlx_lm.server as server

    with pytest.raises(MTPError, match="0.31.3 and 0.32.x"):
        mlx_lm_server.check_mlx_lm("0.30.0", server)
    mlx_lm_server.check_mlx_lm(mlx_lm.__version__, server)
    original = server.BatchGenerator, server.ModelProvider, server._make_sampler
    with mlx_lm_server.install(server) as installation:
        assert server.BatchGenerator == installation.batch_generator
        assert issubclass(server.ModelProvider, original[1])
    assert (server.BatchGenerator, server.ModelProvider, server._make_sampler) == original


def test_a_prompt_held_whole_by_the_cache_feeds_its_last_token_again():
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    prompt, cache, tokens = mlx_lm_server._refeed_last([kv], [7, 8, 9])
    assert (prompt, tokens, cache[0].offset) == ([9], [7, 8], 2)
    state = ArraysCache(size=2)  # can't be trimmed: the prompt prefills anew
    assert mlx_lm_server._refeed_last([state], [7, 8, 9]) == ([7, 8, 9], None, [])


def test_mtp_stays_on_only_where_every_rank_set_it_up(monkeypatch):
    """Under mlx.launch a rank that could not set MTP up (its stage, its drafter) serves plainly;
    every other rank must then serve plainly too, or their loops' collectives would not match."""
    import mlx.core as mx

    sums = []

    class Group:  # two ranks, of which the other one could not set MTP up
        def size(self):
            return 2

    def all_sum(x, group=None, stream=None):
        sums.append(x.item())
        return x  # the other rank adds 0

    monkeypatch.setattr(mx.distributed, "init", lambda *a, **k: Group())
    monkeypatch.setattr(mx.distributed, "all_sum", all_sum)
    strategy, note = mlx_lm_server._agreed(object(), "drafter D")
    assert strategy is None and note == "1 of 2 ranks could not set MTP up (their logs say why)" and sums == [1]
    strategy, note = mlx_lm_server._agreed(None, "its own reason")  # this rank's reason is kept
    assert strategy is None and note == "its own reason"
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: mx.array(2))
    kept = object()
    assert mlx_lm_server._agreed(kept, "drafter D") == (kept, "drafter D")  # both ranks ready
