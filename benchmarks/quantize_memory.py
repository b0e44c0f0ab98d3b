"""Wall time and peak memory of `omlx-mtp quantize` beside `mlx_lm.convert -q`, on synthetic checkpoints.

Builds synthetic Gemma-4-text checkpoints (random weights, HF names): float16 ones of the given
sizes (one shard per ~1 GB) and, with --bf16-gb, a bfloat16 one cut into --shard-mb shards.  Both
quantizers run as child processes under /usr/bin/time, --repeats times each, alternating which
goes first; before every run the source is read in full (so both read an already-cached file) and
dirty pages are synced (so no run pays for the previous one's writeback).  Prints every run, the
medians and the two ratios (ours / mlx_lm.convert), and the load average, since other work on the
machine skews timings.

    python benchmarks/quantize_memory.py [--sizes 1,3] [--bf16-gb 2 --shard-mb 512] [--repeats 3] [--work DIR]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx_mtp.fixtures.tiny import write_tokenizer

HIDDEN = 2048


def synthetic_checkpoint(directory: Path, layers: int, hidden: int = HIDDEN, vocab: int = 32768,
                         dtype: str = "float16", shard_bytes: int = 1 << 30) -> int:
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
        "tie_word_embeddings": True, "torch_dtype": dtype,
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
    shard, shard_size, index, largest = {}, 0, {}, 0
    def flush():
        nonlocal shard, shard_size
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        mx.save_safetensors(str(directory / name), shard)
        index.update({k: name for k in shard})
        shard, shard_size = {}, 0
    for name, shape in shapes.items():
        value = mx.array(rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(getattr(mx, dtype))
        shard[name] = value
        shard_size += value.nbytes
        largest = max(largest, value.nbytes)
        if shard_size > shard_bytes:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (directory / "config.json").write_text(json.dumps(config))
    write_tokenizer(directory, vocab)  # mlx_lm.convert insists on one
    return largest


def layers_for(gigabytes: float) -> int:
    per_layer = 2 * (12 * HIDDEN * HIDDEN + 2 * HIDDEN * 256 * 10)  # bytes of a 2-byte layer, roughly
    return max(1, round(gigabytes * (1 << 30) / per_layer))


def warm_page_cache(directory: Path) -> None:
    """Read every file of the checkpoint, so each quantizer starts from the same cached source."""
    for file in directory.iterdir():
        with open(file, "rb") as handle:
            while handle.read(64 << 20):
                pass


def measure(command) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of one child process."""
    proc = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", proc.stderr).group(1)
    parts = [float(x) for x in wall.split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    return seconds, rss


def quantizers(src: Path, work: Path) -> dict:
    exe = Path(sys.executable).parent
    return {
        "ours": (work / "out-ours", [str(exe / "omlx-mtp"), "quantize", str(src), str(work / "out-ours"),
                                     "--bits", "4"]),
        "convert": (work / "out-convert", [str(exe / "python"), "-m", "mlx_lm", "convert", "--hf-path", str(src),
                                           "--mlx-path", str(work / "out-convert"), "-q", "--q-bits", "4"]),
    }


def compare(src: Path, work: Path, repeats: int) -> dict:
    """Run both quantizers `repeats` times, alternating which goes first; name -> [(wall, peak)]."""
    runs = {"ours": [], "convert": []}
    commands = quantizers(src, work)
    for r in range(repeats):
        for name in (("ours", "convert") if r % 2 == 0 else ("convert", "ours")):
            out, command = commands[name]
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            warm_page_cache(src)
            runs[name].append(measure(command))
            shutil.rmtree(out, ignore_errors=True)
    return runs


def report(label: str, src: Path, largest: int, runs: dict, load: tuple) -> None:
    files = list(src.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files) / (1 << 30)
    medians = {name: (statistics.median(w for w, _ in r), statistics.median(p for _, p in r)) for name, r in runs.items()}
    ours, theirs = medians["ours"], medians["convert"]
    print(f"{label}: {size:.2f} GB in {len(files)} shard(s), largest tensor {largest / 2**20:.0f} MB; "
          f"load average {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} cores)")
    for name, r in runs.items():
        print(f"  {name:8s} wall s " + " ".join(f"{w:6.2f}" for w, _ in r) + f"  median {medians[name][0]:6.2f} | "
              f"peak MB " + " ".join(f"{p:6.0f}" for _, p in r) + f"  median {medians[name][1]:6.0f}")
    print(f"  ratio ours/convert: wall {ours[0] / theirs[0]:.2f}  peak {ours[1] / theirs[1]:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,3", help="float16 checkpoint sizes in GB (1 GB shards); '' for none")
    parser.add_argument("--bf16-gb", type=float, default=2.0, help="size of the multi-shard bfloat16 checkpoint; 0: none")
    parser.add_argument("--shard-mb", type=int, default=512, help="shard size of the bfloat16 checkpoint")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="qbench-"))
    checkpoints = [(f"float16 {s} GB", float(s), "float16", 1 << 30) for s in args.sizes.split(",") if s]
    if args.bf16_gb:
        checkpoints.append((f"bfloat16 {args.bf16_gb:g} GB", args.bf16_gb, "bfloat16", args.shard_mb << 20))
    print(f"each quantizer {args.repeats}x, alternating which goes first; page cache: warm for both "
          "(the source is read in full before every run), dirty pages synced before every run")
    for label, gigabytes, dtype, shard_bytes in checkpoints:
        src = work / "src"
        shutil.rmtree(src, ignore_errors=True)
        largest = synthetic_checkpoint(src, layers_for(gigabytes), dtype=dtype, shard_bytes=shard_bytes)
        load = os.getloadavg()
        report(label, src, largest, compare(src, work, args.repeats), load)
        shutil.rmtree(src, ignore_errors=True)


if __name__ == "__main__":
    main()
