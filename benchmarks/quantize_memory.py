"""Peak memory and wall time of `omlx-mtp quantize` beside `mlx_lm.convert -q`, at two model sizes.

Builds synthetic float16 Gemma-4-text checkpoints (random weights, HF names, one shard per ~1 GB),
then runs both quantizers as child processes under /usr/bin/time and prints wall time, peak RSS,
the ratios, and the largest tensor (our bound is 3x the largest tensor + 500 MB).

    python benchmarks/quantize_memory.py [--sizes 1,2] [--work DIR]
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx_mtp.fixtures.tiny import write_tokenizer


def synthetic_checkpoint(directory: Path, layers: int, hidden: int = 2048, vocab: int = 32768) -> int:
    """Returns the largest tensor's size in bytes."""
    directory.mkdir(parents=True)
    config = {
        "model_type": "gemma4_text", "hidden_size": hidden, "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "global_head_dim": 256, "vocab_size": vocab, "sliding_window": 512, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6) +
                       ["sliding_attention"] * (layers % 6 - 1) + ["full_attention"] if layers % 6 else
                       (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6),
        "tie_word_embeddings": True, "torch_dtype": "float16",
    }
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[p + n + ".weight"] = (hidden,)
        shapes[p + "layer_scalar"] = (1,)
        shapes[p + "self_attn.q_proj.weight"] = (8 * 256, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (2 * 256, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (2 * 256, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, 8 * 256)
        shapes[p + "self_attn.q_norm.weight"] = (256,)
        shapes[p + "self_attn.k_norm.weight"] = (256,)
        for n, shape in (("gate_proj", (4 * hidden, hidden)), ("up_proj", (4 * hidden, hidden)),
                         ("down_proj", (hidden, 4 * hidden))):
            shapes[p + "mlp." + n + ".weight"] = shape
    shard, shard_bytes, index, largest = {}, 0, {}, 0
    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        mx.save_safetensors(str(directory / name), shard)
        index.update({k: name for k in shard})
        shard, shard_bytes = {}, 0
    for name, shape in shapes.items():
        value = mx.array(rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(mx.float16)
        shard[name] = value
        shard_bytes += value.nbytes
        largest = max(largest, value.nbytes)
        if shard_bytes > 1 << 30:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (directory / "config.json").write_text(json.dumps(config))
    write_tokenizer(directory, vocab)  # mlx_lm.convert insists on one
    return largest


def measure(command) -> tuple[float, float]:
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr).group(1)
    parts = [float(x) for x in wall.split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    return seconds, rss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,2", help="approximate checkpoint sizes in GB")
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="qbench-"))
    exe = Path(sys.executable).parent
    print("size_gb  largest_mb | ours: wall_s  peak_mb | mlx_lm.convert: wall_s  peak_mb | wall ratio  peak ratio")
    for size in [float(s) for s in args.sizes.split(",")]:
        layers = max(1, round(size * (1 << 30) / (2 * (12 * 2048 * 2048 + 2 * 2048 * 256 * 10))))
        src = work / f"src-{size}"
        largest = synthetic_checkpoint(src, layers)
        total = sum(f.stat().st_size for f in src.glob("*.safetensors")) / (1 << 30)
        ours = measure([str(exe / "omlx-mtp"), "quantize", str(src), str(work / f"ours-{size}"), "--bits", "4"])
        theirs = measure([str(exe / "python"), "-m", "mlx_lm", "convert", "--hf-path", str(src),
                          "--mlx-path", str(work / f"convert-{size}"), "-q", "--q-bits", "4"])
        print(f"{total:7.2f}  {largest / 2**20:10.0f} | {ours[0]:11.1f} {ours[1]:8.0f} | {theirs[0]:21.1f} "
              f"{theirs[1]:8.0f} | {ours[0] / theirs[0]:10.2f} {ours[1] / theirs[1]:11.2f}")
        for d in (src, work / f"ours-{size}", work / f"convert-{size}"):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
