"""A served model under load and faults: many clients, mixed requests, answers checked.

``plan`` draws a seeded mix of chat requests (streaming or not; greedy or sampled with top-p,
top-k, min-p; repetition penalty; grammars; stop strings; prompts of 10 to 4,000 tokens;
max_tokens 1 to 256) with faults among them (clients that hang up mid-stream, right after the
first chunk, or before a non-streamed answer).  ``run`` sends them from many clients at once
over plain HTTP and samples the server's resident memory.  ``check`` compares a run with
reference answers (the model without MTP): every greedy answer must be the reference's, a
request cut at max_tokens must report exactly max_tokens, a repeated prompt must answer as the
first time, no answer may be a 5xx.  Only the standard library is used, so it runs in any host's
environment.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Compact JSON the grammar requests must produce (xgrammar EBNF, as oMLX's structured_outputs takes).
GRAMMAR = ('root ::= "{\\"name\\": \\"" [a-z_]{1,12} "\\", \\"count\\": " [1-9] [0-9]{0,3} '
           '", \\"kind\\": \\"" ("file" | "dir" | "link") "\\"}"')
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["file", "dir"]}}}
HANG_UP_MID_STREAM, HANG_UP_AFTER_FIRST, HANG_UP_BEFORE_ANSWER = "mid-stream", "after-first-chunk", "before-answer"


@dataclass
class Job:
    index: int
    prompt: str
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    sampling: dict = field(default_factory=dict)  # top_p, top_k, min_p, repetition_penalty
    extra: dict = field(default_factory=dict)  # structured_outputs / response_format
    stop: list | None = None
    fault: str | None = None
    repeat_of: int | None = None
    images: list = field(default_factory=list)  # image URLs (data: URLs work offline) before the text

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def body(self, model: str) -> dict:
        content = self.prompt if not self.images else [
            *({"type": "image_url", "image_url": {"url": url}} for url in self.images), {"type": "text", "text": self.prompt}]
        body = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream,
                **self.sampling, **self.extra}
        if self.stop:
            body["stop"] = self.stop
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Result:
    index: int
    status: int | None = None
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    fault: str | None = None  # the fault injected, when it was
    error: str | None = None
    seconds: float = 0.0


def text_pool(length: int = 40_000) -> str:
    """Source text for prompts: Python's own standard library (what the demo pair was trained on)."""
    import json.decoder
    import json.encoder
    import logging

    out = ""
    for module in (json.decoder, json.encoder, logging, threading, urllib.parse, http.client):
        out += Path(module.__file__).read_text()
        if len(out) >= length:
            break
    return out[:length]


def plan(count: int = 320, seed: int = 0, chars_per_token: float = 2.5, faults: float = 0.08,
         images: list | None = None, image_share: float = 0.3) -> list[Job]:
    """``count`` requests; prompts are cut from ``text_pool`` at 10 to 4,000 tokens (estimated at
    ``chars_per_token``); stop strings are a few characters of source text, likely to turn up.
    With ``images`` (URLs), that share of the requests carries one of them (multimodal models)."""
    rng = random.Random(seed)
    pool = text_pool()
    jobs: list[Job] = []
    for i in range(count):
        # Prompt tokens: mostly short chat turns, one in ten long (up to 4,000) to stress prefill.
        tokens = int(1000 * 4 ** rng.random()) if rng.random() < 0.1 else int(10 * 50 ** rng.random())
        start = rng.randrange(0, len(pool) - int(tokens * chars_per_token) - 1)
        prompt = pool[start : start + int(tokens * chars_per_token)]
        max_tokens = rng.choice([1, 2, 3, 5, 8]) if rng.random() < 0.1 else rng.choice(
            [12, 16, 24, 32, 48, 64, 96]) if rng.random() < 0.9 else rng.choice([128, 200, 256])
        job = Job(i, prompt, max_tokens, stream=rng.random() < 0.5)
        kind = rng.random()
        if kind < 0.15:
            job.temperature = rng.choice([0.7, 1.0])
            job.sampling = rng.choice([{"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"top_p": 0.95, "top_k": 40}])
        elif kind < 0.25:
            job.sampling = {"repetition_penalty": rng.choice([1.1, 1.3])}
        elif kind < 0.35:
            job.extra = rng.choice([{"structured_outputs": {"grammar": GRAMMAR}},
                                    {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "f", "schema": SCHEMA}}}])
            job.max_tokens = max(job.max_tokens, 48)
        elif kind < 0.45:
            at = rng.randrange(len(pool) - 8)
            job.stop = [pool[at : at + rng.choice([2, 3, 5])]]
            job.max_tokens = max(job.max_tokens, 48)
        elif kind < 0.5 and jobs:
            earlier = rng.choice([j for j in jobs if j.greedy and not j.fault and j.repeat_of is None])
            job = Job(i, earlier.prompt, earlier.max_tokens, stream=earlier.stream, sampling=earlier.sampling,
                      extra=earlier.extra, stop=earlier.stop, repeat_of=earlier.index, images=earlier.images)
        if images and job.repeat_of is None and rng.random() < image_share:
            job.images = [rng.choice(images)]
        if job.repeat_of is None and rng.random() < faults:
            job.fault = rng.choice([HANG_UP_MID_STREAM, HANG_UP_AFTER_FIRST, HANG_UP_BEFORE_ANSWER])
            job.stream = job.fault != HANG_UP_BEFORE_ANSWER
            job.max_tokens = max(job.max_tokens, 64)
        jobs.append(job)
    return jobs


def send(url: str, model: str, job: Job, timeout: float = 600.0) -> Result:
    """One request; faults hang up where the job says."""
    result, started = Result(job.index, fault=job.fault), time.perf_counter()
    where = urllib.parse.urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        if job.fault == HANG_UP_BEFORE_ANSWER:
            connection.timeout = 0.3
        connection.request("POST", "/v1/chat/completions", json.dumps(job.body(model)),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        result.status = response.status
        if response.status != 200:
            result.error = response.read().decode(errors="replace")[:500]
        elif not job.stream:
            reply = json.loads(response.read())
            choice = reply["choices"][0]
            result.text, result.finish = choice["message"].get("content") or "", choice["finish_reason"]
            result.completion_tokens = (reply.get("usage") or {}).get("completion_tokens")
        else:
            chunks = 0
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line[6:] == "[DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    result.text += (choice.get("delta") or {}).get("content") or ""
                    result.finish = choice.get("finish_reason") or result.finish
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"].get("completion_tokens")
                chunks += 1
                if (job.fault == HANG_UP_AFTER_FIRST and chunks == 1) or (
                        job.fault == HANG_UP_MID_STREAM and chunks == 4):
                    break
    except (socket.timeout, TimeoutError) as exc:
        if job.fault != HANG_UP_BEFORE_ANSWER:
            result.error = f"timeout: {exc}"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
        result.seconds = time.perf_counter() - started
    return result


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Run:
    results: list[Result]
    seconds: float
    rss: list[tuple[float, int]]  # (seconds since start, bytes)
    warm_after: float  # seconds: the memory samples before this are warm-up

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens or 0 for r in self.results if r.fault is None)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0

    def rss_growth(self) -> tuple[int, int]:
        """(resident bytes after warm-up, growth from there to the end of the run)."""
        warm = [b for t, b in self.rss if t >= self.warm_after] or [b for _, b in self.rss]
        return warm[0], warm[-1] - warm[0]


def run(url: str, model: str, jobs: list[Job], clients: int = 16, pid: int | None = None,
        warm_up: float = 0.15) -> Run:
    """All jobs from ``clients`` threads at once (repeats wait for their original to finish);
    the server's RSS is sampled every half second when ``pid`` is given."""
    done = {j.index: threading.Event() for j in jobs}
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    started = time.perf_counter()

    def sample():
        while not stop.is_set():
            samples.append((time.perf_counter() - started, rss_bytes(pid)))
            stop.wait(0.5)

    def one(job: Job) -> Result:
        if job.repeat_of is not None:
            done[job.repeat_of].wait()
        try:
            return send(url, model, job)
        finally:
            done[job.index].set()

    sampler = threading.Thread(target=sample, daemon=True) if pid else None
    if sampler:
        sampler.start()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, jobs))
    seconds = time.perf_counter() - started
    stop.set()
    if sampler:
        sampler.join()
    return Run(results, seconds, samples, warm_after=seconds * warm_up)


def one_at_a_time(url: str, model: str, jobs: list[Job]) -> dict[int, Result]:
    """Greedy jobs without faults, one at a time (reference answers)."""
    return {j.index: send(url, model, j) for j in jobs if j.greedy and j.fault is None}


def check(jobs: list[Job], got: Run, expected: dict[int, Result]) -> dict:
    """The figures of a run and every way it failed (``problems``: empty when it held)."""
    by_index = {r.index: r for r in got.results}
    problems, mismatches, compared, restarts = [], [], 0, 0
    for job in jobs:
        r = by_index[job.index]
        if r.status is not None and r.status >= 500:
            problems.append(f"job {job.index}: HTTP {r.status} {r.error}")
        if job.fault is not None:
            continue
        if r.error is not None or r.status != 200:
            problems.append(f"job {job.index}: {r.status} {r.error}")
            continue
        if r.finish == "length" and r.completion_tokens is not None and r.completion_tokens != job.max_tokens:
            problems.append(f"job {job.index}: cut at max_tokens={job.max_tokens} after {r.completion_tokens}")
        if job.greedy and job.index in expected and expected[job.index].status == 200:
            compared += 1
            reference = expected[job.index].text
            if job.stream and restarted(r.text, reference):
                restarts += 1
            elif r.text != reference:
                mismatches.append(job.index)
        if job.repeat_of is not None and r.text != by_index[job.repeat_of].text:
            problems.append(f"job {job.index}: a repeat of job {job.repeat_of} answered differently")
    problems += [f"job {i}: greedy answer differs from the reference" for i in mismatches]
    warm, growth = got.rss_growth() if got.rss else (0, 0)
    return {
        "requests": len(jobs),
        "faults_injected": sum(j.fault is not None for j in jobs),
        "greedy_compared": compared,
        "mismatches": len(mismatches),
        "streams_restarted_by_host": restarts,
        "stop_jobs": sum(bool(j.stop) for j in jobs),
        "finished_by_stop": sum(r.finish == "stop" for r in got.results),
        "cut_at_max_tokens": sum(r.finish == "length" for r in got.results),
        "grammar_jobs": sum(bool(j.extra) for j in jobs),
        "sampled_jobs": sum(not j.greedy for j in jobs),
        "repeats": sum(j.repeat_of is not None for j in jobs),
        "server_errors": sum(r.status is not None and r.status >= 500 for r in got.results),
        "seconds": round(got.seconds, 1),
        "completion_tokens": got.completion_tokens,
        "tokens_per_second": round(got.tokens_per_second, 1),
        "rss_after_warm_up_mb": round(warm / 2**20, 1),
        "rss_growth_mb": round(growth / 2**20, 1),
        "problems": problems,
    }


def restarted(text: str, reference: str) -> bool:
    """A stream the host restarted from scratch: what it had streamed, then the whole answer again.
    (oMLX 0.3.8 does that to every running request when a client hangs up during another's prefill:
    it resets its BatchGenerator and re-prefills them, without or with MTP.)"""
    head = text[: len(text) - len(reference)]
    return len(text) > len(reference) and text.endswith(reference) and reference.startswith(head)


def dump(path: Path, jobs: list[Job], runs: dict[str, list[Result]]) -> None:
    """Every job and answer, for a look after a failure."""
    data = {"jobs": [asdict(j) for j in jobs],
            "runs": {name: [asdict(r) for r in results] for name, results in runs.items()}}
    path.write_text(json.dumps(data, indent=1))
