"""The same trained text weights decoded through both target paths, in one process, alternating:
the text path (mlx-lm's Gemma 4, what oMLX's LLM engine runs) and the multimodal path (the demo target
with a vision tower, through mlx-vlm's Gemma 4, what oMLX's VLM engine runs).  Per path and depth: plain
decoding (mlx-lm's loop), MTP with the demo assistant, and their ratio; then the ratio of the two ratios.

    python benchmarks/vlm_path.py [--depths 1,3,auto] [--repeats 5] [--max-tokens 96]
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from omlx_mtp.decode.requests import Request
from omlx_mtp.fixtures.demo import PROMPTS, demo_pair
from omlx_mtp.tools.session import Session, regime, run_mtp, run_plain  # noqa: E402
from omlx_mtp.fixtures.tiny_vlm import demo_vlm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="1,3,auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    depths = [d if d == "auto" else int(d) for d in args.depths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        text_dir, assistant, _ = demo_pair(Path(tmp) / "text")
        vlm_dir, _ = demo_vlm(Path(tmp) / "vlm")
        sessions = {"text (mlx-lm)": Session.load(text_dir, assistant), "vlm (mlx-vlm)": Session.load(vlm_dir, assistant)}
    print(f"regime: {regime()}; demo prompts x {args.repeats} repeats, {args.max_tokens} tokens, medians")
    ratios: dict = {}
    for depth in depths:
        speeds = {(name, engine): [] for name in sessions for engine in ("plain", "mtp")}
        for repeat in range(args.repeats + 1):  # the first pass warms up (compiles) and is not counted
            for name, session in sessions.items():
                for prompt in PROMPTS:
                    request = Request(session.encode(prompt), max_tokens=args.max_tokens)
                    plain = run_plain(session.model, request)
                    mtp = run_mtp(session.decoder, request, draft_tokens=depth)
                    assert mtp.row.generated == plain.row.generated, "MTP left plain decoding"
                    if repeat:
                        speeds[name, "plain"].append(plain.tokens_per_second)
                        speeds[name, "mtp"].append(mtp.tokens_per_second)
        for name in sessions:
            plain, mtp = (statistics.median(speeds[name, e]) for e in ("plain", "mtp"))
            ratios[name, depth] = mtp / plain
            print(f"K={depth!s:<4} {name:14} plain {plain:6.1f} tok/s  mtp {mtp:6.1f} tok/s  x{mtp / plain:.2f}")
        print(f"K={depth!s:<4} vlm / text ratio: {ratios['vlm (mlx-vlm)', depth] / ratios['text (mlx-lm)', depth]:.2f}")


if __name__ == "__main__":
    main()
