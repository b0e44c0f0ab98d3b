"""Reproduce the shipped Qwen3.5 demo checkpoint from scratch: a small Qwen3.5 target (Gated DeltaNet
and full attention) trained on the Python standard library's sources, with the demo pair's
tokenizer, and its built-in MTP head distilled from it (CPU, MLX).  About half an hour on 2 cores.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python scripts/train_demo_qwen.py [OUT]
"""

import argparse
import shutil
import tempfile
from pathlib import Path

from omlx_mtp.training.qwen3_5 import build_qwen_pair

PACKAGE = Path(__file__).resolve().parent.parent / "omlx_mtp" / "fixtures"

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?", default=str(PACKAGE / "demo_qwen"))
parser.add_argument("--target-steps", type=int, default=500)
parser.add_argument("--head-steps", type=int, default=400)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=64)
args = parser.parse_args()

out = Path(args.out)
staging = Path(tempfile.mkdtemp(prefix="demo-qwen-", dir=out.parent))
build_qwen_pair(staging / "model", PACKAGE / "demo_pair" / "target", args.target_steps, args.head_steps, args.batch,
                args.seq_len)
if out.exists():
    shutil.rmtree(out)
(staging / "model").rename(out)
staging.rmdir()
print(f"wrote {out}")
