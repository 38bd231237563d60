"""pf_mm2 (execute/prefill_mm2.cu): the switch, where it applies, and on a GPU the same bits as pf_mm in
both modes (gate/up with SiLU, down) and the float64 reference, tiles of partial and several rows."""
from __future__ import annotations

import numpy as np
import pytest

from execute import quant as Q
from execute.experts import ExecutorError, random_layer
from execute.prefill_mm2 import applies, kernel_for, mm_env

from .conftest import cupy_or_skip


def test_switch_and_where_it_applies(monkeypatch):
    rng = np.random.default_rng(0)
    q8 = random_layer(rng, 0, 2, 128, 64, Q.Q8_0)
    assert applies(q8) and not applies(random_layer(rng, 0, 2, 128, 64, Q.Q4_0))
    assert not applies(random_layer(rng, 0, 2, 128, 96, Q.Q8_0))  # ffn not a multiple of 64
    assert not applies(random_layer(rng, 0, 2, 96, 64, Q.Q8_0)) and not applies(None)
    monkeypatch.delenv("MOELAB_PREFILL_MM", raising=False)
    assert mm_env() == 2 and kernel_for(q8) == "pf_mm2"  # the default
    assert kernel_for(random_layer(rng, 0, 2, 128, 64, Q.Q4_0)) == "pf_mm"
    monkeypatch.setenv("MOELAB_PREFILL_MM", "1")
    assert mm_env() == 1 and kernel_for(q8) == "pf_mm"
    monkeypatch.setenv("MOELAB_PREFILL_MM", "3")
    with pytest.raises(ExecutorError, match="MOELAB_PREFILL_MM='3'"):
        mm_env()


def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,ffn", ((128, 64), (256, 192)))
def test_pf_mm2_equals_pf_mm_bit_for_bit(hidden, ffn):
    cp = cupy_or_skip()
    if int(cp.cuda.Device().compute_capability) < 80:
        pytest.skip("mma.sync needs compute capability 8.0")
    from execute.prefill import _kernel, _tiles
    from execute.prefill_mm2 import kernel, launch

    rng = np.random.default_rng(hidden + ffn)
    counts = np.array([3, 0, 33, 1, 70, 16])  # tiles of 3, 32 + 1, 1, 32 + 32 + 6, 16 rows; one expert unused
    E = len(counts)
    lx = random_layer(rng, 0, E, hidden, ffn, Q.Q8_0)
    off_g, off_u, off_d = lx.device_offsets()
    slot = -(-lx.expert_bytes // 256) * 256
    arena = cp.asarray(np.concatenate([np.pad(np.concatenate([lx.gate.data[x], lx.up.data[x], lx.down.data[x]]),
                                              (0, slot - lx.expert_bytes)) for x in range(E)]))
    base = cp.asarray(np.array([arena.data.ptr + x * slot for x in range(E)], np.uint64))
    trow, tn, tg, _ = _tiles(counts)
    d_row, d_n, d_g = (cp.asarray(a) for a in (trow, tn, tg))
    R = int(counts.sum())
    x = rng.standard_normal((R, hidden)).astype(np.float32)
    split, mm1, mm2 = _kernel("pf_split"), _kernel("pf_mm"), kernel()

    def halves(v):
        n, c = v.shape
        hi, lo = cp.empty((n, c), cp.uint16), cp.empty((n, c), cp.uint16)
        inv = cp.empty(n, cp.float32)
        split((n,), (256,), (cp.asarray(v), np.uint64(0), np.int32(c), hi, lo, inv))
        return hi, lo, inv

    def product(f, a, K, nout, offs, rb, mode):
        out = cp.full((R, nout), np.nan, cp.float32)
        launch(f, base, (d_row, d_n, d_g), a, K, nout, offs[0], offs[1], rb, mode, out)
        return out.get()

    rb_h, rb_f = Q.row_bytes(Q.Q8_0, hidden), Q.row_bytes(Q.Q8_0, ffn)
    a = halves(x)
    h1 = product(mm1, a, hidden, ffn, (off_g, off_u), rb_h, 0)
    h2 = product(mm2, a, hidden, ffn, (off_g, off_u), rb_h, 0)
    assert np.array_equal(h1, h2)
    b = halves(h1)
    y1 = product(mm1, b, ffn, hidden, (off_d, 0), rb_f, 1)
    y2 = product(mm2, b, ffn, hidden, (off_d, 0), rb_f, 1)
    assert np.array_equal(y1, y2)
    # against float64: each row through its expert
    expert = np.repeat(np.arange(E), counts)
    for r in range(R):
        e = expert[r]
        wg = Q.dequantize(lx.gate.data[e], Q.Q8_0, hidden).astype(np.float64)
        wu = Q.dequantize(lx.up.data[e], Q.Q8_0, hidden).astype(np.float64)
        wd = Q.dequantize(lx.down.data[e], Q.Q8_0, ffn).astype(np.float64)
        h = _silu(wg @ x[r]) * (wu @ x[r])
        np.testing.assert_allclose(h2[r], h, rtol=1e-4, atol=1e-5 * np.abs(h).max())
        y = wd @ h1[r].astype(np.float64)
        np.testing.assert_allclose(y2[r], y, rtol=1e-4, atol=1e-5 * np.abs(y).max())
