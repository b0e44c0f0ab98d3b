#!/usr/bin/env bash
# One prepared GPU run: mlx's CUDA build, then the 31B-shaped bench at batch 1 and 4, drafts right at
# 70% (the real assistant's cost paid), bf16 target and 4-bit target (assistant head at 8 bits).
# Run from the repository root on an NVIDIA Linux machine with PyPI reachable, or with WHEELS=DIR
# holding the wheels (pip download "mlx[cuda]" mlx-lm safetensors pluggy pyyaml tqdm -d DIR).
#   OUT=results bash benchmarks/gpu_31b.sh
set -euo pipefail
OUT=${OUT:-gpu-results}
LAYERS=${LAYERS:-8}      # target layers at 31B widths (60 in the real model; 8 keep it minutes, not hours)
TOKENS=${TOKENS:-64}
mkdir -p "$OUT"
python3 -m venv "${VENV:-/tmp/omlx-mtp-gpu}"
source "${VENV:-/tmp/omlx-mtp-gpu}/bin/activate"
pip_args=(); [ -n "${WHEELS:-}" ] && pip_args=(--no-index --find-links "$WHEELS")
pip install -q "${pip_args[@]}" "mlx[cuda]" mlx-lm safetensors pluggy pyyaml tqdm
pip install -q --no-deps -e .
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())"
} | tee "$OUT/device.txt"
common=(--synthetic gemma4-31b-shaped --synthetic-layers "$LAYERS" --draft-tokens 3,auto --accuracy 0.7
        --batch 1,4 --max-tokens "$TOKENS" --repeats 2 --prompt-tokens 64)
omlx-mtp bench "${common[@]}" --dtype bfloat16 --json "$OUT/gpu-31b-bf16.json" | tee "$OUT/gpu-31b-bf16.txt"
omlx-mtp bench "${common[@]}" --dtype bfloat16 --target-bits 4 --head-bits 8 --json "$OUT/gpu-31b-4bit.json" \
    | tee "$OUT/gpu-31b-4bit.txt"
