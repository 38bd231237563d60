"""The CPU kernels of every type they read, on every instruction-set path this host runs (forced)."""
from __future__ import annotations

import numpy as np
import pytest

from execute import cpu_iq, cpu_simd
from execute import quant as Q
from execute.cpu_experts import run_experts
from execute.experts import ExpertTensor, LayerExperts

from .conftest import gguf_dequant

CPU = sorted(Q.CPU_QTYPES)
NEW = sorted(set(Q.CPU_QTYPES) - set(Q.QTYPES))
PATHS = cpu_simd.host_isas()
REL_ERR_INT8 = 2e-4  # two int8 levels of the inputs, as tests/execute/test_cpu_experts.py
# signed weights read on the vnni path as w + 128 (unsigned bytes), the 128 taken off in float: its
# rounding differs from the other paths' (which read |w| against sign(x, w)) within float32's
OFFSET_ON_VNNI = (Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS)


def assert_paths_agree(qtype, ys: dict) -> None:
    """Every path's output equal to the plain path's, bit for bit (their integer dots are exact), but
    for OFFSET_ON_VNNI's types on the vnni path: within 1e-5."""
    for isa, y in ys.items():
        if qtype in OFFSET_ON_VNNI and isa == "vnni":
            assert rel_err(y, ys["plain"].astype(np.float64)) < 1e-5
        else:
            np.testing.assert_array_equal(y, ys["plain"])


def layer_of(rng, qtype, num_experts, hidden, ffn, scale=1.0) -> LayerExperts:
    """Random valid blocks of ``qtype`` (any layout) as a layer."""
    def t(rows, cols, name):
        data = Q.random_blocks(rng, qtype, num_experts * rows, cols, scale / np.sqrt(cols)).reshape(num_experts, -1)
        return ExpertTensor(data, qtype, rows, cols, name)
    return LayerExperts(0, t(ffn, hidden, "gate"), t(ffn, hidden, "up"), t(hidden, ffn, "down"))


def reference(layer: LayerExperts, experts, x) -> np.ndarray:
    """float64 down(silu(gate x) * up x) per pair from gguf-py's dequantized weights."""
    out = np.empty((len(experts), layer.hidden))
    for i, (e, xi) in enumerate(zip(experts, np.asarray(x, np.float64))):
        g = gguf_dequant(layer.gate.data[e], layer.gate.qtype, layer.hidden) @ xi
        u = gguf_dequant(layer.up.data[e], layer.up.qtype, layer.hidden) @ xi
        d = gguf_dequant(layer.down.data[e], layer.down.qtype, layer.ffn)
        with np.errstate(over="ignore"):  # silu of a very negative g: g / inf = -0
            out[i] = d @ (g / (1 + np.exp(-g)) * u)
    return out


def rel_err(y, ref) -> float:
    assert np.isfinite(y).all()
    return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("qtype", NEW, ids=[Q.LAYOUTS[t].name for t in NEW])
def test_new_types_match_gguf_on_every_path(qtype, rng):
    """Every type beyond the common ones (Q4_1 .. Q5_K, IQ2_XXS .. IQ4_XS) against gguf-py's
    dequantizer and a float64 product; the paths agree (assert_paths_agree)."""
    k = Q.LAYOUTS[qtype].block_weights
    hidden, ffn = (512, 256) if k == 256 else (160, 96)  # 32-weight types: 5- and 3-block rows, odd row starts
    layer = layer_of(rng, qtype, 4, hidden, ffn)
    experts = [3, 1, 3, 0]
    x = (rng.standard_normal((4, hidden)) * [[1.0], [1e-3], [30.0], [1.0]]).astype(np.float32)
    ys = {isa: run_experts(layer, experts, x, threads=2, isa=isa) for isa in PATHS}
    ref = reference(layer, experts, x)
    assert max(rel_err(y, ref) for y in ys.values()) < REL_ERR_INT8
    assert_paths_agree(qtype, ys)


# types whose rows are read a block group at a time with state carried from one group to the next:
# the 32-weight types eight blocks at a time and then the rest one by one, the grid i-quants' staged
# offsets and signs written one block ahead into two alternating slots
STAGED = [Q.Q8_0, Q.MXFP4, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M]


@pytest.mark.parametrize("qtype", STAGED, ids=[Q.LAYOUTS[t].name for t in STAGED])
def test_long_rows_of_the_staged_kernels(qtype, rng):
    """Rows of 11 and 19 32-weight blocks (8 + 3, 16 + 3) and of 3 and 5 i-quant blocks (each slot
    written more than once) against gguf-py's dequantizer; the paths agree (assert_paths_agree)."""
    hidden, ffn = (352, 608) if Q.LAYOUTS[qtype].block_weights == 32 else (768, 1280)
    layer = layer_of(rng, qtype, 2, hidden, ffn)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ys = {isa: run_experts(layer, [1, 0, 1], x, threads=2, isa=isa) for isa in PATHS}
    ref = reference(layer, [1, 0, 1], x)
    assert max(rel_err(y, ref) for y in ys.values()) < REL_ERR_INT8
    assert_paths_agree(qtype, ys)


@pytest.mark.parametrize("qtype", CPU, ids=[Q.LAYOUTS[t].name for t in CPU])
def test_paths_agree_bit_for_bit_at_the_extremes(qtype, rng):
    """Weights at their largest magnitudes (bytes 0x80 / 0xFF / 0x7F: Q8_0's -128 and 127, the
    top nibbles and 6-bit values) against activations at +-127 in both int8 levels: the avx2 path's
    int16 pair sums would saturate if a kernel fed it out-of-range bytes."""
    hidden, ffn = 256, 256
    layer = layer_of(rng, qtype, 2, hidden, ffn)
    q = Q.LAYOUTS[qtype]
    fields = [o + i for o in Q._F16_FIELDS.get(qtype, ()) for i in (0, 1)] + ([0] if qtype == Q.MXFP4 else [])
    for t in (layer.gate, layer.up, layer.down):
        if q.block_weights > 1:  # every byte but the scales: 0x80, 0xFF, 0x7F or 0
            b = t.data.reshape(-1, q.block_bytes)
            scales = b[:, fields].copy()
            d_nibbles = b[:, 49:56:2] & 0xF0  # IQ1_M: d's bits, in the top nibbles of the u16 scales
            b[:] = rng.choice(np.array([0x80, 0xFF, 0x7F, 0x00], np.uint8), b.shape)
            b[:, fields] = scales
            if qtype == Q.IQ1_M:
                b[:, 49:56:2] = (b[:, 49:56:2] & 0x0F) | d_nibbles
    x = np.where(rng.random((3, hidden)) < 0.5, -1.0, 1.0).astype(np.float32) * 3.0
    x[:, ::7] = 2.999  # second level at its clip
    ys = {isa: run_experts(layer, [0, 1, 1], x, threads=2, isa=isa) for isa in PATHS}
    assert_paths_agree(qtype, ys)
    assert rel_err(ys["plain"], reference(layer, [0, 1, 1], x)) < REL_ERR_INT8


def test_choose_isa(monkeypatch):
    assert PATHS[-1] == "plain" and cpu_simd.choose_isa("plain") == cpu_simd.ISA_PATHS.index("plain")
    monkeypatch.setenv("MOELAB_CPU_ISA", "plain")
    assert cpu_simd.choose_isa() == cpu_simd.ISA_PATHS.index("plain")
    monkeypatch.setenv("MOELAB_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="MOELAB_CPU_ISA='sse9': expected one of vnni, avx2, plain"):
        cpu_simd.choose_isa()
    monkeypatch.delenv("MOELAB_CPU_ISA")
    assert cpu_simd.choose_isa() == cpu_simd.ISA_PATHS.index(PATHS[0])


def assert_path_instructions(asm: str) -> None:
    """vpdpbusd where the host has VNNI, vpmaddubsw + vpmaddwd where it has AVX2."""
    if "vnni" in PATHS:
        assert "vpdpbusd" in asm
    if "avx2" in PATHS:
        assert "vpmaddubsw" in asm and "vpmaddwd" in asm


def test_each_path_compiles_its_instructions():
    """The integer dots every kernel is built from, a block's 8 behind one branch on the path
    (cpu_kq.dots) and one at a time (cpu_kq.idot), compiled with the path a run-time argument as
    the kernels take it: forcing a path runs its instructions, not a fallback (a small function,
    compiled in about a second; every type's row kernel: the slow test below)."""
    from numba import njit

    from execute.cpu_kq import acc_dots, dots, idot, load_f32x8
    from execute.cpu_simd import fma_cvt, hsum, load_i8x32, zero_f32

    @njit(fastmath=True)
    def block(isa, q, xq, f):
        acc = acc_dots(zero_f32(), dots(isa, q, xq, 0, 256), load_f32x8(f, 0))
        return hsum(fma_cvt(acc, idot(load_i8x32(q, 0), xq, 0, 256, isa), 1.0))

    q, xq, f = np.full(256, 3, np.uint8), np.ones(512, np.int8), np.ones(8, np.float32)
    addr = [a.__array_interface__["data"][0] for a in (q, xq, f)]
    for isa in PATHS:  # each path's dots: 8 x (256 + 1) x 3 x 32 bytes, and one more
        assert block(cpu_simd.ISA_PATHS.index(isa), *addr) == 9 * 257 * 3 * 32
    assert_path_instructions(block.inspect_asm(block.signatures[0]))


@pytest.mark.slow
def test_the_row_kernels_compile_each_paths_instructions():
    """Each quantized type's compiled row kernel holds each path's instructions (a cold compile of
    every type's kernel, a few seconds each)."""
    from numba import njit
    from numba import types as T

    from execute.cpu_experts import _row_kernel_of

    sig = (T.int64,) * 9  # as the phases call it, through its address
    for qtype in sorted(set(CPU) - {Q.F32, Q.F16, Q.BF16}):
        fresh = njit(fastmath=True, nogil=True)(_row_kernel_of(qtype))  # not from Numba's cache, which keeps no assembly
        fresh.compile(sig)
        assert_path_instructions(fresh.inspect_asm(sig))


_ZMM_SCRIPT = """
import re, sys
from numba import njit, types as T
from execute import quant as Q
from execute.cpu_experts import _row_kernel_of
for name in sys.argv[1:]:
    f = njit(fastmath=True)(_row_kernel_of(Q.QTYPE_BY_NAME[name]))
    f.compile((T.int64,) * 9)
    asm = f.inspect_asm((T.int64,) * 9)
    for block in re.split(r"\\n\\.?[A-Za-z_$.][\\w$.]*:", asm):
        plain = re.search(r"vpmaddwd\\s.*zmm", block) and re.search(r"vpmovsxbd\\s.*zmm", block)
        if "zmm" in block and not plain:
            print(name, [l.strip() for l in block.splitlines() if "zmm" in l][:3])
"""


@pytest.mark.slow
def test_no_row_loop_uses_512_bit_registers(tmp_path):
    """Every quantized type's row kernel as compiled for an AVX-512 Intel core (sapphirerapids):
    no zmm register outside the plain path (whose widening multiplies the vnni and avx2 paths never
    run), since one zmm instruction in a loop turns off one of the core's three vector ports. The
    kernels are built with this host's instruction-set paths (cpu_simd's flags) for that target."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, NUMBA_CPU_NAME="sapphirerapids", NUMBA_CACHE_DIR=str(tmp_path))
    names = [Q.LAYOUTS[t].name for t in sorted(set(CPU) - {Q.F32, Q.F16, Q.BF16})]
    out = subprocess.run([sys.executable, "-c", _ZMM_SCRIPT, *names], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "", out.stdout


def test_a_changed_kernel_source_drops_the_cached_kernels(tmp_path, monkeypatch):
    """Numba keys a cached kernel on its own file: the indexes of every kernel module go when the
    digest of their sources changes (a pool loop cached in cpu_pool.py must not keep old kernels)."""

    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    cache = tmp_path / cpu_simd.kernel_cache_subpath()
    cache.mkdir(parents=True)
    pool, rows, other = (cache / n for n in ("cpu_pool._team_worker-1.py311.nbi", "cpu_experts._rows-1.py311.nbi",
                                             "quant.other-1.py311.nbi"))
    for f in (pool, other):
        f.write_bytes(b"index")
    assert cpu_simd.drop_stale_kernel_caches()
    assert not pool.exists() and other.exists()
    rows.write_bytes(b"index")
    assert not cpu_simd.drop_stale_kernel_caches() and rows.exists()  # same sources: kept
    (cache / "moelab-kernels.sha1").write_text("0" * 40)  # as after an edit of a kernel file
    assert cpu_simd.drop_stale_kernel_caches() and not rows.exists() and other.exists()


def test_every_prefetch_mode_gives_the_same_rows(monkeypatch, rng):
    """The prefetch of a run's rows is a hint: every mode's output bit for bit the default's, also
    when the rows (Q4_0 down: 48 bytes) are shorter than the distance prefetched."""
    layer = layer_of(rng, Q.Q4_0, 3, 256, 64)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    ys = {}
    for mode in cpu_simd.PREFETCH_MODES:
        monkeypatch.setenv("MOELAB_CPU_PREFETCH", mode)
        ys[mode] = run_experts(layer, [2, 0, 2, 1], x, threads=2)
    for y in ys.values():
        np.testing.assert_array_equal(y, ys["2k"])
    monkeypatch.setenv("MOELAB_CPU_PREFETCH", "far")
    with pytest.raises(ValueError, match="MOELAB_CPU_PREFETCH='far': expected one of 2k, rows, off"):
        run_experts(layer, [0], x[:1])


GRID = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M]


@pytest.mark.parametrize("qtype", GRID, ids=[Q.LAYOUTS[t].name for t in GRID])
def test_every_gather_mode_gives_the_same_rows(qtype, monkeypatch, rng):
    """The grid i-quants' entries gathered by blends (indices split by shifts or loaded one by one)
    or by one hardware gather: the same bytes, so the same rows bit for bit (3-block rows: both
    scratch slots)."""
    layer = layer_of(rng, qtype, 2, 768, 256)
    x = rng.standard_normal((3, 768)).astype(np.float32)
    ys = {}
    for mode in cpu_iq.GATHER_MODES:
        monkeypatch.setenv("MOELAB_CPU_GATHER", mode)
        ys[mode] = run_experts(layer, [1, 0, 1], x, threads=2)
    for y in ys.values():
        np.testing.assert_array_equal(y, ys["blend"])
    monkeypatch.setenv("MOELAB_CPU_GATHER", "scalar")
    with pytest.raises(ValueError, match="MOELAB_CPU_GATHER='scalar': expected one of blend, loads, vgather"):
        run_experts(layer, [0], x[:1])


def test_e8m0_scales_are_exact():
    """MXFP4's block exponents as scales, eight at a time (stride 17, as in a row) and one by one:
    2^(e - 128) exactly for every byte, the denormals of e = 0 and 1 included."""
    from numba import njit

    from execute.cpu_kq import lane
    from execute.cpu_q32 import e8m0, e8m0x8

    @njit
    def scales(a, out8, out1):
        for j in range(out8.size // 8):
            v = e8m0x8(cpu_simd.addr(a), 136 * j, 17)
            for k in range(8):
                out8[8 * j + k] = lane(v, k)
        for i in range(out1.size):
            out1[i] = e8m0(a[17 * i])

    a = np.zeros(256 * 17, np.uint8)
    a[::17] = np.arange(256)
    out8, out1 = np.zeros(256, np.float32), np.zeros(256, np.float32)
    scales(a, out8, out1)
    want = np.ldexp(1.0, np.arange(256) - 128).astype(np.float32)
    assert want[0] > 0 and want[0] == np.float32(2.0 ** -128)
    np.testing.assert_array_equal(out8, want)
    np.testing.assert_array_equal(out1, want)
