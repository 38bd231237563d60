"""Shared fixtures for the executor tests: random quantized layers and a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402  (tests may import gguf directly; the package may not)

from execute.experts import LayerExperts  # noqa: E402


def gguf_dequant(data: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """gguf-py's reference dequantizer, as float64 (rows, cols)."""
    return quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(qtype)).reshape(-1, cols).astype(np.float64)


def experts_reference(layer: LayerExperts, experts, x: np.ndarray) -> np.ndarray:
    """float64 down(silu(gate x) * up x) per pair, from gguf's dequantized weights."""
    out = np.empty((len(experts), layer.hidden))
    for i, (e, xi) in enumerate(zip(experts, np.asarray(x, np.float64))):
        g = gguf_dequant(layer.gate.data[e], layer.gate.qtype, layer.hidden)
        u = gguf_dequant(layer.up.data[e], layer.up.qtype, layer.hidden)
        d = gguf_dequant(layer.down.data[e], layer.down.qtype, layer.ffn)
        a = g @ xi
        out[i] = d @ (a / (1 + np.exp(-a)) * (u @ xi))
    return out


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261129)


@pytest.fixture
def reference():
    return experts_reference


@pytest.fixture(name="gguf_dequant")
def gguf_dequant_fixture():
    return gguf_dequant
