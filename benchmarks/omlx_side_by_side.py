"""oMLX 0.6.2 over HTTP: MTP off, oMLX's own MTP and omlx-mtp, side by side on one checkpoint.

The embedded demo Qwen3.5 (built-in MTP head) quantized by oMLX's own oQ (8 bits, its
``preserve_mtp``), served three times by one patched oMLX: ``off`` (no MTP), ``omlx`` (oMLX's
``mtp_enabled``, handed to oMLX's own MTP by ``mtp_engine: omlx``) and ``ours`` (oMLX's
``mtp_enabled``: omlx-mtp drafts).  Scenarios: one client at T=0 and T=1, four clients arriving
50 ms apart at T=0 and T=1, and a JSON-schema request at T=0.  Each scenario runs the three
configurations alternated (off, omlx, ours, off, ...) for ``--repeats`` rounds after a warm-up;
it prints tokens/s as medians of per-round ratios to ``off``, acceptance where a log or counter
gives it, and whether every T=0 answer equals ``off``'s.

    OMLX_SRC=/path/to/omlx-0.6.2 python benchmarks/omlx_side_by_side.py [--repeats 5] [--json]

Run it in an environment with oMLX 0.6.2's pins (``.ci/omlx-0.6.2-host.sh`` installs one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from omlx_mtp.fixtures.demo import demo_qwen
from omlx_mtp.hosts.omlx.patcher import run as patch
from omlx_mtp.tools.session import regime

CONFIGS = ("off", "omlx", "ours")
PROMPTS = ["def parse_args(argv):", "class Queue:", "import os\nimport sys\n", "    return self"]
SCHEMA = {"type": "object", "required": ["name", "size", "kind"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 24}, "size": {"type": "integer"},
                         "kind": {"enum": ["file", "dir", "link"]}}}
SCENARIOS = {  # name -> (clients, temperature, response_format)
    "1 client, T=0": (1, 0.0, None),
    "1 client, T=1": (1, 1.0, None),
    "4 clients 50 ms apart, T=0": (4, 0.0, None),
    "4 clients 50 ms apart, T=1": (4, 1.0, None),
    "JSON schema, T=0": (1, 0.0, {"type": "json_schema", "json_schema": {"name": "entry", "schema": SCHEMA}}),
}


def build(root: Path, omlx_src: Path) -> tuple[Path, Path]:
    tree = root / "omlx-tree"
    shutil.copytree(omlx_src, tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
    patch("apply", tree)
    models, base = root / "models", root / "base"
    source = demo_qwen(root / "demo")
    code = ("from omlx.oq import quantize_oq_streaming; "
            f"quantize_oq_streaming({str(source)!r}, {str(models / 'off')!r}, 8, group_size=32, dtype='float16', "
            "preserve_mtp=True)")
    subprocess.run([sys.executable, "-c", code], env=_env(tree), check=True, capture_output=True)
    for name in CONFIGS[1:]:
        shutil.copytree(models / "off", models / name)
    (base / "model_settings").mkdir(parents=True)
    (base / "model_settings.json").write_text(json.dumps({"version": 1, "models": {
        "omlx": {"mtp_enabled": True}, "ours": {"mtp_enabled": True}}}))
    (base / "model_settings" / "omlx.yaml").write_text("mtp_engine: omlx\n")
    (base / "settings.json").write_text(json.dumps({"auth": {"skip_api_key_verification": True}}))
    return tree, base


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def request(url: str, model: str, prompt: str, temperature: float, fmt, max_tokens: int) -> tuple[str, int]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": 0}
    if fmt is not None:
        body["response_format"] = fmt
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
    return reply["choices"][0]["message"].get("content") or "", reply["usage"]["completion_tokens"]


def scenario(url: str, model: str, clients: int, temperature: float, fmt, max_tokens: int) -> tuple[float, list[str]]:
    """Every prompt, ``clients`` at a time arriving 50 ms apart; (tokens/s over the wall time, texts)."""
    texts, tokens = [None] * len(PROMPTS), [0] * len(PROMPTS)

    def send(i):
        texts[i], tokens[i] = request(url, model, PROMPTS[i], temperature, fmt, max_tokens)

    start = time.perf_counter()
    for first in range(0, len(PROMPTS), clients):
        threads = []
        for i in range(first, min(first + clients, len(PROMPTS))):
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            time.sleep(0.05)
        for thread in threads:
            thread.join()
    return sum(tokens) / (time.perf_counter() - start), texts


def acceptance(url: str, log: Path) -> dict:
    """omlx-mtp's counters from the status API, oMLX's own from its log lines (accept=a/b)."""
    ours = {m["id"]: m.get("mtp") for m in httpx.get(f"{url}/v1/models/status", timeout=30).json()["models"]}
    stats = ours.get("ours") or {}
    own = [tuple(map(int, m)) for m in re.findall(r"MTP\[\d+\] finish=\S+ .*?accept=(\d+)/(\d+)", log.read_text())]
    return {"ours": (stats.get("accepted", 0), stats.get("drafted", 0)),
            "omlx": (sum(a for a, _ in own), sum(b for _, b in own))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--omlx", default=os.environ.get("OMLX_SRC"), help="an unpacked oMLX 0.6.2 tree")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.omlx:
        parser.error("--omlx or OMLX_SRC must name an oMLX 0.6.2 tree")
    root = Path(tempfile.mkdtemp(prefix="omlx-side-by-side-"))
    tree, base = build(root, Path(args.omlx))
    port, log = 8731, root / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "omlx.cli", "serve", "--model-dir", str(base.parent / "models"),
                                   "--base-path", str(base), "--host", "127.0.0.1", "--port", str(port), "--no-cache"],
                                  env={**_env(tree), "HOME": str(root)}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                httpx.get(f"{url}/v1/models", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(1)
        print(regime(), f"| oMLX {Path(args.omlx).name}, demo Qwen3.5 oQ8 (fp16), {args.max_tokens} tokens per request")
        results = {}
        for name, (clients, temperature, fmt) in SCENARIOS.items():
            for config in CONFIGS:  # warm-up: loads the model, traces its graphs
                scenario(url, config, clients, temperature, fmt, 8)
            speeds = {c: [] for c in CONFIGS}
            equal = {c: True for c in CONFIGS}
            for _ in range(args.repeats):
                texts = {}
                for config in CONFIGS:
                    speed, texts[config] = scenario(url, config, clients, temperature, fmt, args.max_tokens)
                    speeds[config].append(speed)
                if temperature == 0:
                    for config in CONFIGS:
                        equal[config] &= texts[config] == texts["off"]
            ratio = {c: statistics.median(s / o for s, o in zip(speeds[c], speeds["off"])) for c in CONFIGS}
            results[name] = {"tok_s": {c: statistics.median(speeds[c]) for c in CONFIGS}, "vs_off": ratio,
                             "ours_vs_omlx": statistics.median(a / b for a, b in zip(speeds["ours"], speeds["omlx"])),
                             "equal_to_off": equal if temperature == 0 else None}
            row = results[name]
            print(f"{name:28s} off {row['tok_s']['off']:6.1f} tok/s | oMLX MTP x{ratio['omlx']:.2f} | "
                  f"omlx-mtp x{ratio['ours']:.2f} (x{row['ours_vs_omlx']:.2f} of oMLX's)"
                  + (f" | T=0 equal: {equal}" if temperature == 0 else ""), flush=True)
        accepted = acceptance(url, log)
        print("accepted/drafted over the run: "
              + ", ".join(f"{k} {a}/{b} ({a / b:.0%})" if b else f"{k} 0/0" for k, (a, b) in accepted.items()))
        if args.json:
            print(json.dumps({"results": results, "acceptance": accepted}))
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
