"""One rank of the distributed tests, started by ``mlx.launch`` (tests/test_distributed.py).

Loads a checkpoint sharded over the ranks, runs the scenarios asked for, and prints one JSON line
``{"rank", "ranks", "sharding", "results": {scenario: tokens per request}}``.  Scenarios: plain
decoding on the sharded model (mlx-lm's loop), MTP at fixed depths and auto as one batch, a batch
that rows join late, and sampling at T=1.  ``--own-seed`` is the mutation the rank check exists
for (each rank samples with a seed of its own); ``--die-after N`` kills rank 1 after N rounds,
``--die-in-prefill N`` at its Nth prompt's prefill."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import mlx.core as mx

from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.decode.batch import LiveBatch
from omlx_mtp.decode.loop import SpeculativeDecoder
from omlx_mtp.decode.ranks import RankGroup
from omlx_mtp.decode.requests import Request
from omlx_mtp.decode.sampling import SamplingParams
from omlx_mtp.drafters import load_merged_drafter
from omlx_mtp.targets import wrap_target
from omlx_mtp.tools.session import run_plain


def late_joins(decoder: SpeculativeDecoder, requests: list[Request], K, seed: int) -> list[list[int]]:
    """The first half of the requests start together; one more joins every third round."""
    batch = decoder.batch(K, seed)
    waiting = list(enumerate(requests))
    out: dict[int, list[int]] = {}
    live: dict[int, int] = {}  # id(row) -> request index

    def join(items):
        rows = [batch.new_row(r) for _, r in items]
        cache, hidden, logits = decoder._prefill([r for _, r in items], slack=batch.max_depth + 1)
        for (i, _), row in zip(items, rows):
            live[id(row)] = i
            out[i] = row.generated
        batch.start(rows, cache, hidden, logits)

    join(waiting[: len(waiting) // 2])
    waiting = waiting[len(waiting) // 2 :]
    rounds = 0
    while batch.rows or waiting:
        if waiting and (rounds % 3 == 0 or not batch.rows):
            join([waiting.pop(0)])
        if batch.rows:
            batch.round()
            batch.retire([row for row in batch.rows if row.finish_reason is not None])
        rounds += 1
    return [out[i] for i in range(len(requests))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--sharding", default="auto")
    parser.add_argument("--prompts", required=True, help="JSON list of token lists")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--scenarios", default="plain,K1,K3,auto,join")
    parser.add_argument("--own-seed", action="store_true")
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--die-in-prefill", type=int, default=None, help="rank 1 dies at its Nth prompt")
    args = parser.parse_args()

    group = mx.distributed.init()
    ranks = RankGroup(group)
    if args.own_seed:  # the mutation: every rank samples from a random state of its own
        RankGroup.agree_seed = lambda self, seed: seed + 1000 * self.rank
    if args.die_after is not None and ranks.rank == 1:
        original, count = LiveBatch.round, [0]

        def dying(self):
            count[0] += 1
            if count[0] > args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self)

        LiveBatch.round = dying
    if args.die_in_prefill is not None and ranks.rank == 1:
        prefill, prompts_seen = SpeculativeDecoder.prefill_one, [0]

        def dying_in_prefill(self, *a, **k):
            prompts_seen[0] += 1
            if prompts_seen[0] >= args.die_in_prefill:  # rank 0 is then inside the same prompt's forward
                os.kill(os.getpid(), signal.SIGKILL)
            return prefill(self, *a, **k)

        SpeculativeDecoder.prefill_one = dying_in_prefill
    model, _, _ = load_target(args.model, with_tokenizer=False, sharding=args.sharding)
    target = wrap_target(model)
    drafter = load_merged_drafter(args.model, target)
    prompts = json.loads(args.prompts)
    results = {}
    for scenario in args.scenarios.split(","):
        if scenario == "plain":
            results[scenario] = [run_plain(model, Request(p, max_tokens=args.max_tokens)).row.generated for p in prompts]
            continue
        if scenario == "sampled":
            params = SamplingParams(temperature=1.0)
            decoder = SpeculativeDecoder(target, drafter, draft_tokens=2, ranks=ranks)
            rows = decoder.generate([Request(p, params, max_tokens=args.max_tokens) for p in prompts], seed=7)
            results[scenario] = [row.generated for row in rows]
            continue
        requests = [Request(p, max_tokens=args.max_tokens) for p in prompts]
        depth = "auto" if scenario in ("auto", "join") else int(scenario[1:])
        decoder = SpeculativeDecoder(target, drafter, draft_tokens=depth, ranks=ranks)
        if scenario == "join":
            results[scenario] = late_joins(decoder, requests, 3, seed=5)
        else:
            results[scenario] = [row.generated for row in decoder.generate(requests, seed=5)]
    print(json.dumps({"rank": ranks.rank, "ranks": ranks.size, "sharding": target.sharding, "results": results,
                      "collectives": ranks.rounds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
