"""A server's load through the host API: clients sending requests while others decode.

Drives mlx-lm's ``BatchGenerator`` and this package's ``MTPBatchGenerator`` (MTP off and ``auto``)
the way each host does, on the embedded demo pair:

* ``--host omlx``: oMLX's scheduler prefills each prompt outside (all but its last token), then
  inserts the last token with that cache;
* ``--host mlx-lm``: mlx-lm's server inserts the whole prompt (the generator prefills it).

Requests (stdlib source cut to 10-400 tokens, greedy and sampled, 16-96 tokens each) come from
``--clients`` clients, each sending its next request as soon as its previous one finished.  Each engine runs the same requests, rotated over
``--repeats`` passes after a warm-up; the throughput counts every generated token over the whole
run, prefill included, as a server's would.  ``--profile ENGINE`` prints where that engine's time
goes (cProfile, top functions by cumulative time).

    python benchmarks/served_load.py --host omlx --repeats 5
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.sampling import SamplingParams
from omlx_mtp.fixtures.demo import demo_pair
from omlx_mtp.hosts.batch_generator import MTPBatchGenerator
from omlx_mtp.tools.session import Session, regime, rotated

mlx_generate = importlib.import_module("mlx_lm.generate")


def requests_for(session, count: int, seed: int) -> list[dict]:
    import json
    import textwrap

    source = inspect.getsource(json) + inspect.getsource(textwrap)
    ids = session.encode(source)
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = rng.choice([10, 40, 100, 200, 400])
        start = rng.randrange(0, len(ids) - length)
        temp = 0.0 if i % 2 == 0 else 1.0
        out.append({"prompt": ids[start:start + length], "params": SamplingParams(temperature=temp, top_p=0.95 if temp else 0.0),
                    "max_tokens": rng.choice([16, 48, 96])})
    return out


def drive(generator, model, requests, host: str, clients: int) -> dict:
    """Closed loop, as a server's clients: ``clients`` requests run at once, and each finished one
    is followed by the next request at the following call (its client sends again at once)."""
    queue = list(enumerate(requests))
    tokens, running, uid_of = {}, set(), {}
    ours = isinstance(generator, MTPBatchGenerator)
    start, prefill, calls = time.perf_counter(), 0.0, 0
    while queue or running:
        while queue and len(running) < clients:
            index, r = queue.pop(0)
            kwargs = dict(max_tokens=[r["max_tokens"]])
            kwargs["sampling_params" if ours else "samplers"] = [r["params"] if ours else r["params"].mlx_sampler()]
            prompt = r["prompt"]
            if host == "omlx":  # the scheduler's prefill, outside the generator
                t0 = time.perf_counter()
                cache = make_prompt_cache(model)
                model(mx.array(prompt[:-1])[None], cache=cache)
                mx.eval([c.state for c in cache])
                prefill += time.perf_counter() - t0
                kwargs.update(caches=[cache], all_tokens=[prompt[:-1]])
                prompt = prompt[-1:]
            (uid,) = generator.insert([prompt], **kwargs)
            uid_of[uid], tokens[uid] = index, []
            running.add(uid)
        for response in generator.next_generated():
            if response.finish_reason != "stop":
                tokens[response.uid].append(response.token)
            if response.finish_reason is not None:
                running.discard(response.uid)
                generator.remove([response.uid])
        calls += 1
    seconds = time.perf_counter() - start
    generator.close()
    order = sorted(uid_of, key=uid_of.get)
    return {"tokens": [tokens[u] for u in order], "seconds": seconds, "prefill_seconds": prefill,
            "generated": sum(len(t) for t in tokens.values()), "steps": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", choices=["omlx", "mlx-lm"], default="omlx")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", choices=["mlx-lm", "no-draft", "auto"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, assistant_dir, label = demo_pair(Path(tmp))
        session = Session.load(target_dir, assistant_dir, draft_tokens="auto")
    stops = [[t] for t in session.stop_tokens()] or None
    model = session.model
    off = SpeculativeDecoder(session.target, None, draft_tokens=0)
    size = args.clients
    engines = {
        "mlx-lm": lambda: mlx_generate.BatchGenerator(model, stop_tokens=stops, completion_batch_size=size),
        "no-draft": lambda: MTPBatchGenerator(off, mlx_generate.BatchGenerator, model=model, stop_tokens=stops,
                                              completion_batch_size=size),
        "auto": lambda: MTPBatchGenerator(session.decoder, mlx_generate.BatchGenerator, model=model,
                                          stop_tokens=stops, completion_batch_size=size),
    }
    print(f"{label}\nregime: {regime()}; host pattern {args.host}; {args.requests} requests from {size} "
          f"clients (closed loop); {args.repeats} rotated passes after a warm-up")
    speeds = {name: [] for name in engines}
    for repeat in range(args.repeats + 1):
        requests = requests_for(session, args.requests, seed=repeat)
        outputs = {}
        for name, make in rotated(list(engines.items()), repeat):
            mx.random.seed(repeat)
            if args.profile == name and repeat == args.repeats:
                profiler = cProfile.Profile()
                result = profiler.runcall(drive, make(), model, requests, args.host, args.clients)
                stats = pstats.Stats(profiler)
                stats.sort_stats("cumulative").print_stats(30)
            else:
                result = drive(make(), model, requests, args.host, args.clients)
            outputs[name] = result["tokens"]
            if repeat:
                speeds[name].append(result["generated"] / result["seconds"])
                print(f"  pass {repeat} {name:<9} {result['generated'] / result['seconds']:7.1f} tok/s "
                      f"({result['seconds']:.2f} s, {result['steps']} steps, outside prefill {result['prefill_seconds']:.2f} s)")
        greedy = [i for i, r in enumerate(requests) if r["params"].temperature == 0]
        for name in ("no-draft", "auto"):
            same = sum(outputs[name][i] == outputs["mlx-lm"][i] for i in greedy)
            if same != len(greedy):
                print(f"  note: {name} greedy answers equal to mlx-lm's: {same} of {len(greedy)}")
    base = speeds["mlx-lm"]
    for name, values in speeds.items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"{name:<9} median {statistics.median(values):7.1f} tok/s  x{statistics.median(ratios):.2f} of mlx-lm's "
              f"(passes x{min(ratios):.2f}-x{max(ratios):.2f})")


if __name__ == "__main__":
    main()
