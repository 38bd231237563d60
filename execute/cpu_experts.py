"""The CPU expert pool: Numba kernels computing a layer's CPU experts from quantized host weights.

A call computes ``y[i] = down_e(act(gate_e x[i] + bg_e, up_e x[i] + bu_e)) + bd_e`` for each row
``i`` of ``x`` with ``e = experts[i]`` (one row per (expert, token) pair; act and the optional
biases are the layer's, see ``LayerExperts``), unweighted: the caller combines the
outputs with the router weights. Pairs are grouped by expert so that each weight row is read once
per call however many tokens use it. Each call runs two parallel regions (gate+up, then down)
over (expert group, block of rows) tasks. A weight row is dotted with each input in place, block by
block, with float32 activations (results within float32 rounding of the exact dot): per block, a
vectorized loop converts the packed weights (int8, nibbles, 6-bit, f16, bf16, MXFP4 codes through a
16-entry table) to float32 and multiplies-adds them with the input, then one multiply applies the
block's scale. Offsets and
mins (Q4_0's -8, Q4_K's dmin*m) are applied through the input's 32-column sums, computed once per
call. What keeps LLVM's loops vectorized (checked in the assembly: vpmovsxbd/vpmovzxbd, vcvtdq2ps,
vfmadd on ymm): 2-D block views indexed by loop counters (no per-element index wrap-around),
inner trip counts passed at run time (see ``_LANES``), int32 casts of nibble arithmetic, f16 and
bf16 converted by LLVM intrinsics (``_half``, ``_bits_f32``) rather than a table or a store.

``CpuExpertPool`` owns one persistent worker thread that calls the kernels (compiled ``nogil``,
so the GPU driver thread runs meanwhile) with the configured Numba thread count. ``submit``
returns at once; ``CpuJob.result`` waits at most ``timeout_s`` and raises ``ExecutorError`` on a
stall or a failure (the pool is then marked broken): never a hang, never an abort.

The pool runs one parallel call per layer, so Numba's OpenMP team idles between calls; with
OpenMP's default (active) waiting those threads spin there and take the cores the engine's own
thread needs (H200 box, 15 threads, 2026-11-29, four configs of experiments/sim_vs_real.py, 4
repeats each: passive waiting gave 6-13% more tokens/s and 7-45% lower p99 token latency). This module
sets ``OMP_WAIT_POLICY=PASSIVE`` before Numba's threading layer starts, unless the user set it.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the OpenMP runtime loads (see above)

import numba  # noqa: E402
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import quant as Q
from .cpu_simd import (addr, comb256, dpbusd, fma_cvt, fma_cvt2, hsum, load_f16, load_f32, load_i8, load_i8x32,
                       load_nib32, load_u8, load_u16,
                       lut16, nib_hi, nib_lo, vand, vor, vshl, vshr, xor80, zero_f32, zero_i32)
from .experts import ExecutorError, ExpertTensor, LayerExperts

__all__ = ["CpuExpertPool", "CpuJob", "run_experts", "tensor_views"]

_Q8_0, _Q4_0, _Q4_K, _Q6_K, _F32, _F16, _BF16 = Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16
_MXFP4 = Q.MXFP4
# MXFP4 code -> integer value + 12 (0..24, unsigned for dpbusd; the 12 comes off through the sums)
_MXFP4_U8 = (Q.MXFP4_VALUES + 12).astype(np.uint8)


@intrinsic
def _half(typingctx, bits):
    """float16 bit pattern (uint16) -> float32, exact (LLVM fpext: vcvtph2ps when vectorized)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _bits_f32(typingctx, bits):
    """uint32 bit pattern -> float32 (a register reinterpretation, no memory round trip)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(inline="always")
def _e8m0(e):
    """MXFP4 block exponent (0..255) -> float32 2^(e - 128) from its bits (denormal for e < 2)."""
    ee = np.uint32(e)
    return _bits_f32(np.uint32(np.uint32(0x00200000) << ee if ee < 2 else (ee - np.uint32(1)) << np.uint32(23)))


# Quantized rows are dotted with int8 activations (see _quantize): per 32 weights, dpbusd of the
# weights as unsigned bytes (Q8_0: w + 128; Q4_0, Q4_K: nibbles; Q6_K: 6-bit q; MXFP4: value + 12)
# with the activation bytes, converted and FMA'd into a vector accumulator with the product of the
# two block scales; the unsigned offset (or Q4_K's min) comes off through the activation block's
# sum xs (float, = scale * sum of its int8 values). Arguments (arrays by address, see cpu_simd.addr):
# w the weights' bytes, o the row's first byte, nb the row's 32-weight blocks; xq the int8
# activations from byte xo; xd, xs the activation blocks' scales and sums from block xb (xs16:
# 16-weight sums, from 2 * xb); l2 the offset of the second activation level in xq (0: one level;
# see _quantize).

@njit(inline="always")
def _idot(q, xq, a, l2):
    """Per-lane integer dot of weight bytes q with the activation block at byte a of xq: 256 q.x1 +
    q.x2 with two levels (|lane| <= 4 * 255 * 127 * 257 < 2^31)."""
    v = dpbusd(zero_i32(), q, load_i8x32(xq, a))
    if l2:
        v = comb256(v, dpbusd(zero_i32(), q, load_i8x32(xq, a + l2)))
    return v


@njit(inline="always", fastmath=True)
def _dot_q8_0(w, o, nb, xq, xo, xd, xs, xb, l2):
    acc = zero_f32()
    corr = np.float32(0.0)
    for b in range(nb):
        p = o + 34 * b  # f16 d, i8 qs[32]
        d = load_f16(w, p)
        v = _idot(xor80(load_i8x32(w, p + 2)), xq, xo + 32 * b, l2)
        acc = fma_cvt(acc, v, d * load_f32(xd, xb + b))
        corr += d * load_f32(xs, xb + b)
    return hsum(acc) - np.float32(128.0) * corr


@njit(inline="always", fastmath=True)
def _dot_q4_0(w, o, nb, xq, xo, xd, xs, xb, l2):
    acc = zero_f32()
    corr = np.float32(0.0)
    for b in range(nb):
        p = o + 18 * b  # f16 d, u8 qs[16] (low nibbles: weights 0-15, high: 16-31)
        d = load_f16(w, p)
        v = _idot(load_nib32(w, p + 2), xq, xo + 32 * b, l2)
        acc = fma_cvt(acc, v, d * load_f32(xd, xb + b))
        corr += d * load_f32(xs, xb + b)
    return hsum(acc) - np.float32(8.0) * corr


@njit(inline="always", fastmath=True)
def _dot_mxfp4(w, o, nb, xq, xo, xd, xs, xb, l2, table):
    acc = zero_f32()
    corr = np.float32(0.0)
    for b in range(nb):
        p = o + 17 * b  # u8 e, u8 qs[16] (nibble codes, Q4_0's order)
        d = _e8m0(load_u8(w, p))
        v = _idot(lut16(load_nib32(w, p + 1), table), xq, xo + 32 * b, l2)
        acc = fma_cvt(acc, v, d * load_f32(xd, xb + b))
        corr += d * load_f32(xs, xb + b)
    return hsum(acc) - np.float32(12.0) * corr


@njit(inline="always")
def _q4k_scale_min(w, p, s):
    """6-bit scale and min of sub-block ``s`` (0..7) of the Q4_K block at byte ``p``."""
    if s < 4:
        return np.float32(load_u8(w, p + 4 + s) & 63), np.float32(load_u8(w, p + 8 + s) & 63)
    sc = (load_u8(w, p + 8 + s) & 15) | ((load_u8(w, p + s) >> 6) << 4)
    mn = (load_u8(w, p + 8 + s) >> 4) | ((load_u8(w, p + 4 + s) >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(inline="always", fastmath=True)
def _dot_q4_k(w, o, nb, xq, xo, xd, xs, xb, l2):
    acc0 = zero_f32()
    acc1 = zero_f32()
    corr = np.float32(0.0)
    for b in range(nb // 8):
        p = o + 144 * b  # f16 d, f16 dmin, u8 scales[12], u8 qs[128]
        d = load_f16(w, p)
        dmin = load_f16(w, p + 2)
        mins = np.float32(0.0)
        for c in range(4):  # 32 bytes: low nibbles are sub-block 2c, high nibbles 2c + 1
            q = load_i8x32(w, p + 16 + 32 * c)
            s = xb + 8 * b + 2 * c
            sc0, m0 = _q4k_scale_min(w, p, 2 * c)
            sc1, m1 = _q4k_scale_min(w, p, 2 * c + 1)
            a = xo + 256 * b + 64 * c
            acc0 = fma_cvt(acc0, _idot(nib_lo(q), xq, a, l2), d * sc0 * load_f32(xd, s))
            acc1 = fma_cvt(acc1, _idot(nib_hi(q), xq, a + 32, l2), d * sc1 * load_f32(xd, s + 1))
            mins += m0 * load_f32(xs, s) + m1 * load_f32(xs, s + 1)
        corr += dmin * mins
    return hsum(acc0) + hsum(acc1) - corr


@njit(inline="always", fastmath=True)
def _q6_part(acc, q, w, sp, dq, xq, a, l2, xd, xs16, s):
    """acc + dpbusd(q, activation block at a) scaled per 16 weights (i8 scales at sp, sp + 1);
    and the block's offset term sum(scale * xs16)."""
    s0 = np.float32(load_i8(w, sp))
    s1 = np.float32(load_i8(w, sp + 1))
    ds = dq * load_f32(xd, s)
    acc = fma_cvt2(acc, _idot(q, xq, a, l2), ds * s0, ds * s1)
    return acc, s0 * load_f32(xs16, 2 * s) + s1 * load_f32(xs16, 2 * s + 1)


@njit(inline="always", fastmath=True)
def _dot_q6_k(w, o, nb, xq, xo, xd, xs16, xb, l2):
    acc0 = zero_f32()
    acc1 = zero_f32()
    corr = np.float32(0.0)
    for b in range(nb // 8):
        p = o + 210 * b  # u8 ql[128], u8 qh[64], i8 scales[16], f16 d
        d = load_f16(w, p + 208)
        off = np.float32(0.0)
        for hh in range(2):  # 128 weights: 32-weight groups g = 0..3 (activation block 4 hh + g)
            ql0 = load_i8x32(w, p + 64 * hh)
            ql1 = load_i8x32(w, p + 64 * hh + 32)
            qh = load_i8x32(w, p + 128 + 32 * hh)
            sp = p + 192 + 8 * hh  # scales of group g: sp + 2g (weights 0-15), sp + 2g + 1 (16-31)
            s = xb + 8 * b + 4 * hh
            a = xo + 256 * b + 128 * hh
            acc0, t0 = _q6_part(acc0, vor(nib_lo(ql0), vshl(vand(qh, 3), 4)), w, sp, d, xq, a, l2, xd, xs16, s)
            acc1, t1 = _q6_part(acc1, vor(nib_lo(ql1), vshl(vand(qh, 12), 2)), w, sp + 2, d, xq, a + 32, l2, xd, xs16,
                                s + 1)
            acc0, t2 = _q6_part(acc0, vor(nib_hi(ql0), vand(qh, 48)), w, sp + 4, d, xq, a + 64, l2, xd, xs16, s + 2)
            acc1, t3 = _q6_part(acc1, vor(nib_hi(ql1), vand(vshr(qh, 2), 48)), w, sp + 6, d, xq, a + 96, l2, xd, xs16,
                                s + 3)
            off += t0 + t1 + t2 + t3
        corr += d * off
    return hsum(acc0) + hsum(acc1) - np.float32(32.0) * corr


@njit(inline="always", fastmath=True)
def _dot_float(qt, w, o, x, xo, cols):
    """Row of a float tensor from element o (w: address of its F32 or F16/BF16 elements) . x[xo:xo + cols]."""
    s = np.float32(0.0)
    if qt == _F32:
        for j in range(cols):
            s += load_f32(w, o + j) * load_f32(x, xo + j)
    elif qt == _F16:
        for j in range(cols):
            s += _half(np.uint16(load_u16(w, o + j))) * load_f32(x, xo + j)
    else:
        for j in range(cols):
            s += _bits_f32(load_u16(w, o + j) << np.uint32(16)) * load_f32(x, xo + j)
    return s


@njit(inline="always", fastmath=True)
def _dot_row(qt, w, rb, row, cols, i, x, xq, xd, xs, xs16, l2, table):
    """Row ``row`` (of all experts' rows) of a tensor of type qt (w: its address, rb bytes per row)
    . input ``i``: x (address of the (n, cols) float32 inputs) for float types, the int8
    activations xq, xd, xs, xs16, l2 (see _quantize) for quantized ones."""
    o = row * rb
    nb = cols // 32
    if qt == _Q8_0:
        return _dot_q8_0(w, o, nb, xq, i * cols, xd, xs, i * nb, l2)
    if qt == _Q4_K:
        return _dot_q4_k(w, o, nb, xq, i * cols, xd, xs, i * nb, l2)
    if qt == _Q6_K:
        return _dot_q6_k(w, o, nb, xq, i * cols, xd, xs16, i * nb, l2)
    if qt == _Q4_0:
        return _dot_q4_0(w, o, nb, xq, i * cols, xd, xs, i * nb, l2)
    if qt == _MXFP4:
        return _dot_mxfp4(w, o, nb, xq, i * cols, xd, xs, i * nb, l2, table)
    return _dot_float(qt, w, row * cols, x, i * cols, cols)


@njit(inline="always", fastmath=True)
def _quantize16(xf, xq, j0, d, inv, l2):
    """xq[j0:j0 + 16] (and its second level at l2 when l2 > 0) from xf; the sum of the integers
    (256 q1 + q2 for two levels)."""
    s = np.int32(0)
    for j in range(j0, j0 + 16):
        q = np.int32(np.rint(xf[j] * inv))
        xq[j] = q
        if l2:
            r = np.int32(np.rint((xf[j] - np.float32(q) * d) * (np.float32(256.0) * inv)))
            r = min(max(r, np.int32(-127)), np.int32(127))
            xq[l2 + j] = r
            q = np.int32(256) * q + r
        s += q
    return s


@njit(inline="always", fastmath=True)
def _quantize(x, quantized, levels):
    """x (n, cols) float32 -> (xq (levels * n * cols,) int8, xd, xs (n * cols / 32,), xs16
    (n * cols / 16,), l2): per 32 columns, d = max |x| / 127 and q1 = round(x / d) (llama.cpp's
    q8_0 activations); with 2 levels also q2 = round((x - d q1) * 256 / d), clipped to +-127, from
    byte l2 = n * cols, so that x = d / 256 (256 q1 + q2) to within d / 512. xd is the scale of
    the integer a kernel forms (d, or d / 256 for two levels), xs and xs16 the sums of the
    dequantized values per 32 and 16 columns (the offsets' terms). Empty arrays when not
    ``quantized`` (float weights read x) or the rows are not whole blocks."""
    n, cols = x.shape
    m = n * cols if quantized and cols % 32 == 0 else 0
    xq = np.empty(levels * m, np.int8)
    xd = np.empty(m // 32, np.float32)
    xs = np.empty(m // 32, np.float32)
    xs16 = np.empty(m // 16, np.float32)
    if m == 0:
        return xq, xd, xs, xs16, 0
    xf = x.reshape(m)
    l2 = m if levels == 2 else 0
    for b in range(m // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(xf[32 * b + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        s0 = _quantize16(xf, xq, 32 * b, d, inv, l2)
        s1 = _quantize16(xf, xq, 32 * b + 16, d, inv, l2)
        ds = d / np.float32(256.0) if l2 else d
        xd[b] = ds
        xs[b] = ds * np.float32(s0 + s1)
        xs16[2 * b] = ds * np.float32(s0)
        xs16[2 * b + 1] = ds * np.float32(s1)
    return xq, xd, xs, xs16, l2


@njit(inline="always", fastmath=True)
def _swiglu_oai(a, b, limit, alpha):
    """gpt-oss's clamped SwiGLU on gate ``a`` and up ``b`` (biases added)."""
    a = min(a, limit)
    b = min(max(b, -limit), limit)
    return a / (np.float32(1.0) + np.exp(-alpha * a)) * (b + np.float32(1.0))


@njit(fastmath=True, nogil=True, cache=True)
def _rows(v, e, r0, r1, pairs, xf, ax, out, table):
    """out[i, r] = row r of expert e (tensor views v) . input i, for rows r0..r1 - 1 and the pairs
    i in ``pairs``; xf (n * cols,) the inputs, ax their int8 form (see _quantize); out (n, rows).
    The one compiled copy of every type's dot (gate, up and down share it). The inner loops read
    through addresses: array accesses there would add reference counting per row."""
    u8, u16, f32, qt, rb = v
    xq, xd, xs, xs16, l2 = ax
    w = addr(f32) if qt == _F32 else addr(u16) if qt == _F16 or qt == _BF16 else addr(u8)
    pxf, pq, pd, ps, ps16, pt = addr(xf), addr(xq), addr(xd), addr(xs), addr(xs16), addr(table)
    rows = out.shape[1]
    cols = xf.size // out.shape[0]
    for r in range(r0, r1):
        for p in range(pairs.size):
            i = pairs[p]
            out[i, r] = _dot_row(qt, w, rb, e * rows + r, cols, i, pxf, pq, pd, ps, ps16, l2, pt)


@njit(inline="always", fastmath=True)
def _activate(hg, hu, bg, bu, oai, e, r0, r1, pairs):
    """hg[i, r] = act(hg[i, r] + bg[e, r], hu[i, r] + bu[e, r]) for rows r0..r1 - 1 of the pairs:
    act is silu(a) * b when ``oai`` is None, else _swiglu_oai with oai = (limit, alpha); biases
    None (compiled out) or (experts, ffn) float32."""
    for i in pairs:
        for r in range(r0, r1):
            a = hg[i, r]
            b = hu[i, r]
            if bg is not None:
                a += bg[e, r]
            if bu is not None:
                b += bu[e, r]
            if oai is None:
                hg[i, r] = a / (np.float32(1.0) + np.exp(-a)) * b
            else:
                hg[i, r] = _swiglu_oai(a, b, oai[0], oai[1])


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _moe(g, u, dn, bg, bu, bd, oai, experts, x, y, ffn, chunks, table):
    """y[i] = down_e(act(gate_e x[i] + bg[e], up_e x[i] + bu[e])) + bd[e], e = experts[i], for every
    pair i (see _activate), in two parallel regions (gate+up, then down), each ``chunks`` equal
    runs of the (expert, row) work; pairs are grouped by expert so that a weight row is read once
    per call. x: (n, hidden) float32; y: (n, hidden) float32, written; bd None or (experts, hidden)."""
    n, hidden = x.shape
    order = np.argsort(experts, kind="mergesort")
    group_start = np.empty(n + 1, np.int64)
    group_expert = np.empty(n, np.int64)
    ng = 0
    for p in range(n):
        if p == 0 or experts[order[p]] != experts[order[p - 1]]:
            group_start[ng] = p
            group_expert[ng] = experts[order[p]]
            ng += 1
    group_start[ng] = n
    gq = g[3] not in (_F32, _F16, _BF16) or u[3] not in (_F32, _F16, _BF16)
    ax = _quantize(x, gq, 2)
    xf = x.reshape(n * hidden)
    h = np.empty((n, ffn), np.float32)
    hu = np.empty((n, ffn), np.float32)
    work = ng * ffn
    for t in prange(chunks):  # gate + up: h (n, ffn); chunk t: flat (expert group, row) f0..f1 - 1
        f0 = t * work // chunks
        f1 = (t + 1) * work // chunks
        for k in range(f0 // ffn, (f1 + ffn - 1) // ffn):
            r0 = max(f0 - k * ffn, 0)
            r1 = min(f1 - k * ffn, ffn)
            pairs = order[group_start[k]:group_start[k + 1]]
            _rows(g, group_expert[k], r0, r1, pairs, xf, ax, h, table)
            _rows(u, group_expert[k], r0, r1, pairs, xf, ax, hu, table)
            _activate(h, hu, bg, bu, oai, group_expert[k], r0, r1, pairs)
    ah = _quantize(h, dn[3] not in (_F32, _F16, _BF16), 2)
    hf = h.reshape(n * ffn)
    work = ng * hidden
    for t in prange(chunks):  # down: y (n, hidden)
        f0 = t * work // chunks
        f1 = (t + 1) * work // chunks
        for k in range(f0 // hidden, (f1 + hidden - 1) // hidden):
            r0 = max(f0 - k * hidden, 0)
            r1 = min(f1 - k * hidden, hidden)
            pairs = order[group_start[k]:group_start[k + 1]]
            _rows(dn, group_expert[k], r0, r1, pairs, hf, ah, y, table)
            if bd is not None:
                for i in pairs:
                    for r in range(r0, r1):
                        y[i, r] += bd[group_expert[k], r]


_EMPTY_F32 = np.zeros(1, np.float32)
_EMPTY_U16 = np.zeros(1, np.uint16)
_OAI = {"silu": None, "swiglu_oai": (np.float32(7.0), np.float32(1.702))}  # activation -> _moe's oai


def tensor_views(t: ExpertTensor) -> tuple:
    """(u8, u16, f32, qtype, row_bytes): the flat views of all experts' rows the kernels read
    (u16 for F16/BF16, f32 for F32; one-element dummies otherwise)."""
    Q.row_bytes(t.qtype, t.cols, t.name or "expert tensor")
    rb = Q.row_bytes(t.qtype, t.cols)
    if t.expert_bytes != rb * t.rows:
        raise ValueError(f"{t.name or 'expert tensor'}: {t.expert_bytes} bytes per expert, expected "
                         f"{t.rows} rows x {rb} = {rb * t.rows} for {Q.QTYPES[t.qtype].name}")
    flat = np.asarray(t.data).reshape(-1)
    f32 = flat.view(np.float32) if t.qtype == Q.F32 else _EMPTY_F32
    u16 = flat.view(np.uint16) if t.qtype in (Q.F16, Q.BF16) else _EMPTY_U16
    return flat, u16, f32, np.int64(t.qtype), np.int64(rb)


def run_experts(layer: LayerExperts, experts: Sequence[int], x: np.ndarray, threads: int | None = None,
                views: tuple | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Compute the pairs' expert outputs on the calling thread: (n, hidden) float32 (into ``out``
    when given, e.g. a page-locked buffer)."""
    e = np.asarray(experts, dtype=np.int64).reshape(-1)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape != (len(e), layer.hidden):
        raise ValueError(f"layer {layer.layer}: x has shape {x.shape}, expected ({len(e)}, {layer.hidden})")
    if len(e) and (e.min() < 0 or e.max() >= layer.num_experts):
        raise ValueError(f"layer {layer.layer}: expert ids must be in 0..{layer.num_experts - 1}")
    y = np.empty((len(e), layer.hidden), np.float32) if out is None else out
    if y.shape != (len(e), layer.hidden) or y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError(f"layer {layer.layer}: out must be C-contiguous float32 ({len(e)}, {layer.hidden})")
    g, u, d = views or (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down))
    th = threads or numba.get_num_threads()
    _moe(g, u, d, layer.gate_bias, layer.up_bias, layer.down_bias, _OAI[layer.activation], e, x, y, layer.ffn, th,
         _MXFP4_U8)
    return y


class CpuJob:
    """A submitted layer's CPU experts; ``result()`` waits for them at most the pool's timeout."""

    def __init__(self, pool: "CpuExpertPool", layer: int, n: int):
        self._pool = pool
        self.layer = layer
        self.num_pairs = n
        self._done = threading.Event()
        self._out: np.ndarray | None = None
        self._error: BaseException | None = None
        self.submitted_s = time.perf_counter()
        self.compute_s = 0.0
        # perf_counter stamps (0.0 until set): the worker starts and ends the Numba call; the
        # caller's first successful result() returns (moelab calibrate splits the hand-offs by them)
        self.started_s = 0.0
        self.finished_s = 0.0
        self.collected_s = 0.0

    def _finish(self, out: np.ndarray | None, error: BaseException | None) -> None:
        self._out, self._error = out, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> np.ndarray:
        """(n, hidden) float32 unweighted outputs; ExecutorError on failure or timeout."""
        left = self._pool.timeout_s - (time.perf_counter() - self.submitted_s)
        if not self._done.wait(max(left, 0.0)):
            self._pool._broken = f"layer {self.layer}: CPU experts did not finish within {self._pool.timeout_s} s"
            raise ExecutorError(self._pool._broken)
        if self._error is not None:
            raise ExecutorError(f"layer {self.layer}: CPU experts failed: {self._error!r}") from self._error
        if not self.collected_s:
            self.collected_s = time.perf_counter()
        return self._out


class CpuExpertPool:
    """One persistent worker thread running the Numba expert kernels with ``threads`` threads."""

    def __init__(self, threads: int, timeout_s: float = 30.0):
        if threads < 1 or threads > numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"CpuExpertPool threads: {threads}, expected 1..{numba.config.NUMBA_NUM_THREADS} "
                             f"(NUMBA_NUM_THREADS)")
        if not timeout_s > 0:
            raise ValueError(f"CpuExpertPool timeout_s: {timeout_s}, expected > 0")
        self.threads = int(threads)
        self.timeout_s = float(timeout_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._views: dict[int, tuple] = {}
        self._broken: str | None = None
        self._thread: threading.Thread | None = None

    def _views_of(self, layer: LayerExperts) -> tuple:
        v = self._views.get(id(layer))
        if v is None or v[0] is not layer:
            v = (layer, (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down)))
            self._views[id(layer)] = v
        return v[1]

    def _work(self) -> None:
        numba.set_num_threads(self.threads)
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, layer, experts, x, views, out = item
            t0 = job.started_s = time.perf_counter()
            try:
                out = run_experts(layer, experts, x, self.threads, views, out)
            except BaseException as exc:  # reported to the caller by result()
                job._finish(None, exc)
            else:
                job.finished_s = time.perf_counter()
                job.compute_s = job.finished_s - t0
                job._finish(out, None)

    def submit(self, layer: LayerExperts, experts: Sequence[int], x: np.ndarray,
               out: np.ndarray | None = None) -> CpuJob:
        """Start computing ``experts[i]`` on ``x[i]`` for every i in the background (results
        into ``out`` when given; it must not be touched until ``result()`` returns)."""
        if self._broken:
            raise ExecutorError(f"CPU expert pool is unusable: {self._broken}")
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="moelab-cpu-experts", daemon=True)
            self._thread.start()
        job = CpuJob(self, layer.layer, len(experts))
        self._queue.put((job, layer, np.asarray(experts, np.int64), np.ascontiguousarray(x, np.float32),
                         self._views_of(layer), out))
        return job

    def warmup(self, layer: LayerExperts) -> None:
        """Compile the kernels for this layer's types (first use compiles; disk-cached after)."""
        x = np.zeros((1, layer.hidden), np.float32)
        job = self.submit(layer, [0], x)
        job._done.wait()
        job.result()

    def close(self) -> None:
        """Stop the worker after the queued jobs (a stalled worker is left behind, daemonic)."""
        if self._thread is not None:
            self._queue.put(None)
            if not self._broken:
                self._thread.join(self.timeout_s)
            self._thread = None

    def __enter__(self) -> "CpuExpertPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
