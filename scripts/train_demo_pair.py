"""Reproduce the shipped demo pair from scratch: a small Gemma 4 target trained on the Python
standard library's sources and a Gemma 4 assistant distilled from it (CPU, MLX).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python scripts/train_demo_pair.py [OUT]
"""

import argparse
import shutil
import tempfile
from pathlib import Path

from omlx_mtp.train import PairSpec, build_pair

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "omlx_mtp" / "demo_pair"

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
parser.add_argument("--target-steps", type=int, default=1200)
parser.add_argument("--drafter-steps", type=int, default=600)
parser.add_argument("--batch", type=int, default=16)
args = parser.parse_args()

out = Path(args.out)
staging = Path(tempfile.mkdtemp(prefix="demo-pair-", dir=out.parent))
build_pair(staging, PairSpec(), args.target_steps, args.drafter_steps, args.batch)
if out.exists():
    shutil.rmtree(out)
staging.rename(out)
print(f"wrote {out}")
