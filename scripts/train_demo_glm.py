"""Reproduce the shipped GLM-4.5-shaped demo checkpoint from scratch: a small ``glm4_moe`` target (GQA
with q/k/v biases, half-rotary RoPE, a dense first layer, then MoE layers with a shared expert)
trained on the Python standard library's sources with the demo pair's tokenizer, jointly with its
MTP ("nextn") layer, which is then distilled from it (CPU, MLX), and the layer's acceptance measured
through the decode loop.  About 20 minutes of 2 CPU cores with OpenBLAS (23 minutes' wall on a
lightly shared machine).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python scripts/train_demo_glm.py [OUT]
    python scripts/train_demo_glm.py --measure-only [OUT]     # the acceptance table of OUT
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from omlx_mtp.training.glm4_moe import acceptance_table, build_glm

PACKAGE = Path(__file__).resolve().parent.parent / "omlx_mtp" / "fixtures"

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?", default=str(PACKAGE / "demo_glm"))
parser.add_argument("--joint-steps", type=int, default=1100)
parser.add_argument("--distill-steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=128)
parser.add_argument("--joint-snapshot", help="also write the checkpoint before distillation here")
parser.add_argument("--measure-only", action="store_true", help="only print OUT's acceptance table")
args = parser.parse_args()

out = Path(args.out)
if not args.measure_only:
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="demo-glm-", dir=out.parent))
    build_glm(staging / "model", PACKAGE / "demo_pair" / "target", args.joint_steps, args.distill_steps, args.batch,
              args.seq_len, joint_snapshot=args.joint_snapshot)
    if out.exists():
        shutil.rmtree(out)
    (staging / "model").rename(out)
    staging.rmdir()
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s")
acceptance_table(out)
