"""execute.gpu_quant: dequantize-and-multiply of every layout against the numpy dequantizer."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from execute import quant as Q

ALL = sorted(Q.LAYOUTS)


def test_kernel_decodes_every_layout():
    """gpu_quant.cu has a case for every type of quant.LAYOUTS (its switch returns 0 otherwise)."""
    src = (Path(__file__).parents[2] / "execute" / "gpu_quant.cu").read_text()
    cases = {int(c) for c in re.findall(r"case (\d+):", src)}
    assert cases == set(Q.LAYOUTS)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("qtype", ALL, ids=[Q.LAYOUTS[t].name for t in ALL])
def test_matmul_matches_numpy_dequantize(qtype, tokens, rng):
    cp = pytest.importorskip("cupy")
    from execute.gpu_quant import matmul

    rows, cols = 72, 512  # 18 blocks of 4 warps' rows; 2 K-blocks or 16 legacy blocks per row
    raw = Q.random_blocks(rng, qtype, rows, cols, scale=0.05)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ Q.dequantize(raw, qtype, cols).astype(np.float64).T
    y = cp.asnumpy(matmul(cp.asarray(raw.reshape(-1)), qtype, rows, cols, cp.asarray(x)))
    assert y.shape == (tokens, rows) and np.isfinite(y).all()
    assert np.linalg.norm(y - ref) <= 1e-5 * np.linalg.norm(ref)
