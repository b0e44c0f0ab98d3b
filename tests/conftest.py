"""Tiny random Gemma 4 pairs, built once per test session."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from omlx_mtp.targets import wrap_target
from omlx_mtp.drafters import load_drafter
from omlx_mtp.checkpoint.loading import load_target
from omlx_mtp.fixtures.tiny import TinySpec, write_pair

# Tests never reach the network: subprocesses (oMLX, oQ) inherit these too.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# OMLX_MTP_QUICK=1 (CI's second suite, oMLX 0.3.8's pins): the long per-family sweeps run one
# depth and fewer layouts there; the first suite runs them whole.  Compatibility is what that
# suite checks, and CI's time is bounded.
QUICK = os.environ.get("OMLX_MTP_QUICK") == "1"


def sweep(full: list, quick: list) -> list:
    """The cases of a long sweep: all of them, or the quick suite's few."""
    return quick if QUICK else full

# 31B-like: every layer owns K/V, K-eq-V full layers, original config spelling, text-only type.
SPEC_31B = TinySpec(layout="31b", model_type="gemma4_text", spelling="original", k_eq_v=True)
# E2B-like: K/V-shared layers, per-layer inputs, centroid head, transformers' per_layer_config
# spelling, multimodal wrapper type.
SPEC_E2B = TinySpec(layout="e2b", model_type="gemma4", spelling="per_layer", num_layers=6, centroid_head=True)


class Pair:
    def __init__(self, directory, spec):
        self.spec = spec
        self.target_dir, self.drafter_dir = write_pair(directory, spec)
        self.model, self.tokenizer, self.config = load_target(self.target_dir)
        self.target = wrap_target(self.model)
        self.drafter = load_drafter(self.drafter_dir, self.target)


@pytest.fixture(scope="session")
def pair_31b(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("pair31b"), SPEC_31B)


@pytest.fixture(scope="session")
def pair_e2b(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("paire2b"), SPEC_E2B)


@pytest.fixture(params=["31b", "e2b"])
def pair(request, pair_31b, pair_e2b):
    return {"31b": pair_31b, "e2b": pair_e2b}[request.param]


def prompts(count: int, vocab: int, seed: int = 0, lengths=(3, 9, 17, 40, 70)) -> list[list[int]]:
    """Deterministic prompts; several are longer than the fixtures' 16-token sliding window."""
    key = mx.random.key(seed)
    out = []
    for i in range(count):
        key, sub = mx.random.split(key)
        n = lengths[i % len(lengths)] + i
        out.append(mx.random.randint(3, vocab, (n,), key=sub).tolist())
    return out
