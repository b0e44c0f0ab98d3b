"""Reproduce the shipped demo pair from scratch: a small Gemma 4 target trained on the Python
standard library's sources and a Gemma 4 assistant distilled from it (CPU, MLX).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python scripts/train_demo_pair.py [OUT]

With --assistant-only, only the assistant is distilled again (fresh weights, --drafter-steps steps)
from the target already in OUT.
"""

import argparse
import shutil
import tempfile
from pathlib import Path

from omlx_mtp.training.gemma4 import PairSpec, build_pair, distill_assistant

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "omlx_mtp" / "fixtures" / "demo_pair"

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
parser.add_argument("--target-steps", type=int, default=800)
parser.add_argument("--drafter-steps", type=int, default=1200)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--assistant-only", action="store_true", help="keep OUT's target, distill a new assistant")
args = parser.parse_args()

out = Path(args.out)
if args.assistant_only:
    staging = Path(tempfile.mkdtemp(prefix="demo-assistant-", dir=out))
    distill_assistant(out / "target", staging / "assistant", PairSpec(), args.drafter_steps, args.batch)
    shutil.rmtree(out / "assistant")
    (staging / "assistant").rename(out / "assistant")
    staging.rmdir()
    print(f"wrote {out / 'assistant'}")
    raise SystemExit(0)
staging = Path(tempfile.mkdtemp(prefix="demo-pair-", dir=out.parent))
build_pair(staging, PairSpec(), args.target_steps, args.drafter_steps, args.batch)
if out.exists():
    shutil.rmtree(out)
staging.rename(out)
print(f"wrote {out}")
