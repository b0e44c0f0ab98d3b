"""omlx-mtp: lossless multi-token-prediction speculative decoding for oMLX and mlx-lm."""

__version__ = "0.1.0"
