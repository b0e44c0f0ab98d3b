"""omlx-mtp: lossless multi-token-prediction speculative decoding for oMLX, mlx-lm and mlx-vlm.

Packages by concern: ``checkpoint`` (reading, loading, quantizing, inspecting checkpoints),
``decode`` (the speculative loop; depends on nothing above it), ``drafters`` and ``targets`` (one
module per model family), ``hosts`` (what oMLX and mlx-lm's BatchGenerator call), ``tools`` (the
``omlx-mtp`` command), ``fixtures`` and ``training`` (tiny and demo checkpoints)."""

__version__ = "0.2.0"
