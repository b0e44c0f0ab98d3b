#!/usr/bin/env bash
# oMLX 0.6.2 and its git-pinned siblings (mlx-lm ab1806e, mlx-vlm 78b96eb, mlx-embeddings 32981fa),
# from the source archives in ../shared/hosts/ (sha256 checked) and PyPI, into the active venv;
# then this package with its test tools.  Prints the oMLX tree for OMLX_SRC, or nothing where the
# archives are absent (a user's clone: the 0.6.2 served tests then skip).
#   usage: OMLX_SRC="$(bash .ci/omlx-0.6.2-host.sh DEST)"
set -euo pipefail
dest=$1 hosts="../shared/hosts"
archives=(omlx-0.6.2 mlx-lm-ab1806e mlx-vlm-78b96eb mlx-embeddings-32981fa)
for a in "${archives[@]}"; do
  [ -f "$hosts/$a.tar.gz" ] || { echo "no $hosts/$a.tar.gz: the oMLX 0.6.2 tests will skip" >&2; exit 0; }
done
(cd "$hosts" && for a in "${archives[@]}"; do sha256sum -c --quiet "$a.tar.gz.sha256"; done) >&2
rm -rf "$dest" && mkdir -p "$dest"
for a in "${archives[@]}"; do tar -xzf "$hosts/$a.tar.gz" -C "$dest"; done
C=(-q -c "$(dirname "$0")/omlx-0.6.2-constraints.txt")
{
  pip install "${C[@]}" torch==2.13.0  # CPU torch first, so nothing pulls a CUDA build
  pip install "${C[@]}" "mlx==0.32.0" "mlx-cpu==0.32.0"
  # mlx-vlm and mlx-embeddings without their requirements (datasets, mlx-audio, opencv ...), as oMLX's notes say
  pip install "${C[@]}" --no-deps "$dest/mlx-vlm-78b96eb" "$dest/mlx-embeddings-32981fa"
  pip install "${C[@]}" "$dest/mlx-lm-ab1806e" -r "$(dirname "$0")/omlx-0.6.2-host.txt"
  pip install "${C[@]}" --no-deps xgrammar apache-tvm-ffi  # oMLX's [grammar] extra, no-deps as it says
  pip install "${C[@]}" pytest pytest-asyncio
  pip install "${C[@]}" --no-deps -e .
} >&2
echo "$PWD/$dest/omlx-0.6.2"
