"""The CPU expert pool: Numba kernels computing a layer's CPU experts from quantized host weights.

A call computes ``y[i] = down_e(act(gate_e x[i] + bg_e, up_e x[i] + bu_e)) + bd_e`` for each row
``i`` of ``x`` with ``e = experts[i]`` (one row per (expert, token) pair; act and the optional
biases are the layer's, see ``LayerExperts``), unweighted: the caller combines the outputs with
the router weights. Pairs are grouped by expert so that each weight row is read once per call
however many tokens use it.

Quantized weights are dotted with int8 activations: x (and h before the down projection) is
quantized once per call, per 32 values, in two int8 levels (``_quantize``); per 32 weights one
integer dot per level of the weights as bytes with the activation bytes, one conversion and one
FMA into a vector accumulator (``execute.cpu_simd``); offsets and mins come off through the
activations' block sums. The integer dot has three instruction-set paths, chosen per call from a
job field (``cpu_simd.choose_isa``: ``MOELAB_CPU_ISA``, else the host's best): ``vnni``
(``vpdpbusd``), ``avx2`` (``vpmaddubsw`` + ``vpmaddwd``, whose int16 pair sums need unsigned
weight bytes <= 127: signed weights go through |w| and sign(x, w)) and ``plain``. Types: every
one of ``quant.CPU_QTYPES``. Float weights (F32, F16, BF16) are dotted with float32 x. A call
runs in two phases, gate+up then down, over the flat (expert group, row) work: ``run_experts``
splits each into equal runs, one per thread; the pool into chunks its hands claim (``cpu_pool``).
The lattice i-quants' dots are in ``execute.cpu_iq``, Q8_0's and MXFP4's in ``execute.cpu_q32``. Each type's row kernel is compiled on its
own (``row_kernel``), when a layer of that type is first used, and the phases call it through its
address in the job: a process compiles the types it runs, not the whole family.

``CpuExpertPool`` (``execute.cpu_pool``) runs calls on a team of native threads (Numba ``nogil`` functions that never
take the GIL) fed through a ring of job descriptions; ``submit`` returns at once, ``CpuJob.result``
waits at most ``timeout_s`` and raises ``ExecutorError`` on a stall or a failure (the pool is then
marked broken): never a hang, never an abort. ``run_experts`` runs the same phases on the calling
thread with Numba's OpenMP pool, whose waiting policy this module sets to passive (unless the
user set one) before the OpenMP runtime loads: its threads idle between calls and spinning ones
took the cores the engine's own thread needs.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the OpenMP runtime loads (see above)

import numba  # noqa: E402
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import quant as Q
from .cpu_simd import (bits32, choose_isa, choose_prefetch, fma_cvt, hsum, load_f16, load_f32, addr, load_nib32,
                       load_u16, prefetch, store_f32, ptr_f32, ptr_i64, ptr_i8, ptr_i16, lut16, vor, vshl, zero_f32)
from .cpu_iq import IQ_TABLES, choose_gather, dot_iq1, dot_iq_s, dot_iq_xxs
from .cpu_q32 import dot_mxfp4, dot_q8_0, sdots_any
from .cpu_kq import (acc_dots, acc_dots_x16lo, block_scratch, dot_iq4_xs, dot_q2_3k, dot_q4_k, dot_q6_k, dots, f16x8, fadd, fmul,
                     idot as _idot, load_f32x8, load_nib32_x16, prefetch_plan, sdot as _sdot, store_i8x32)
from .cpu_simd import drop_stale_kernel_caches
from .experts import ExecutorError, ExpertTensor, LayerExperts
from .iq_grids import IQ4_NL_VALUES

__all__ = ["run_experts", "tensor_views", "row_kernel", "run_phase"]

drop_stale_kernel_caches()  # before any kernel here or in cpu_pool is loaded from Numba's cache

_Q8_0, _Q4_0, _Q4_K, _Q6_K, _F32, _F16, _BF16 = Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16
_MXFP4 = Q.MXFP4
_Q4_1, _Q5_0, _Q5_1, _Q5_K, _IQ4_NL, _IQ4_XS = Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.IQ4_NL, Q.IQ4_XS
_Q2_K, _Q3_K = Q.Q2_K, Q.Q3_K
_IQ2_XXS, _IQ3_XXS, _IQ2_XS, _IQ2_S, _IQ3_S, _IQ1_S, _IQ1_M = (Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_S,
                                                               Q.IQ1_S, Q.IQ1_M)
# code tables (lut16): bytes 0-15 MXFP4 code -> integer value + 12 (0..24, unsigned for dpbusd; the
# 12 comes off through the sums); bytes 16-31 IQ4_NL/IQ4_XS code -> level (signed, see _sdot); from
# byte 32 (_IQX) cpu_iq's grids; then (_IQ4U) IQ4 code -> level + 128 (unsigned, the vnni path)
_TABLES = np.concatenate([(Q.MXFP4_VALUES + 12).astype(np.uint8), IQ4_NL_VALUES.view(np.uint8), IQ_TABLES,
                          IQ4_NL_VALUES.view(np.uint8) ^ 0x80])
_IQX = 32
_IQ4 = 16  # offset of the IQ4 table
_IQ4U = _IQX + IQ_TABLES.size  # the IQ4 levels + 128 (unsigned, the vnni path's)


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
def _q45_0(w, p, bs, hi):
    """The 32 weights of a Q4_1/Q5_0/Q5_1 block at byte p as bytes: nibbles | fifth bits << 4."""
    q = load_nib32(w, p + bs - 16)
    if hi:
        q = vor(q, vshl(bits32(w, p + hi), 4))
    return q


@njit(inline="always", fastmath=True)
def _dot_q4_1(w, o, nb, xq, xo, xd, xs, xb, l2, isa, bs, hi):
    """Q4_1 (bs 20, hi 0), Q5_0 (bs 22, hi 2: q - 16) and Q5_1 (bs 24, hi 4): f16 d, [f16 m],
    [u32 qh at byte hi], u8 qs[16] (lo/hi nibbles); w = d q + m, or d (q - 16) without m. Eight
    blocks at a time as Q4_0's, the rest one by one."""
    acc = zero_f32()
    cor = zero_f32()
    for b8 in range(nb // 8):
        p = o + 8 * bs * b8
        q = (_q45_0(w, p, bs, hi), _q45_0(w, p + bs, bs, hi), _q45_0(w, p + 2 * bs, bs, hi), _q45_0(w, p + 3 * bs, bs, hi),
             _q45_0(w, p + 4 * bs, bs, hi), _q45_0(w, p + 5 * bs, bs, hi), _q45_0(w, p + 6 * bs, bs, hi),
             _q45_0(w, p + 7 * bs, bs, hi))  # the 8 blocks' bytes, to the dots in registers
        dv = f16x8(w, p, bs)
        blk = xb + 8 * b8
        acc = acc_dots(acc, dots(isa, q, xq, xo + 256 * b8, l2), fmul(dv, load_f32x8(xd, blk)))
        mv = fmul(dv, np.float32(-16.0)) if bs == 22 else f16x8(w, p + 2, bs)
        cor = fadd(cor, fmul(mv, load_f32x8(xs, blk)))
    corr = np.float32(0.0)
    for b in range(nb - nb % 8, nb):
        p = o + bs * b
        d = load_f16(w, p)
        acc = fma_cvt(acc, _idot(_q45_0(w, p, bs, hi), xq, xo + 32 * b, l2, isa), d * load_f32(xd, xb + b))
        corr += (load_f16(w, p + 2) if bs != 22 else np.float32(-16.0) * d) * load_f32(xs, xb + b)
    return hsum(acc) + hsum(cor) + corr


@njit(inline="always", fastmath=True)
def _dot_iq4_nl(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table):
    """IQ4_NL (18-byte blocks: f16 d, 16 bytes of codes); codes -> levels by lut16. Eight blocks at
    a time as Q4_0's, the rest one by one: on the vnni path the levels + 128 as unsigned bytes, the
    128 off through the sums xs; on the others (int16 pair sums) the signed levels (cpu_kq.sdots)."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
    for b8 in range(nb // 8):
        p = o + 144 * b8
        dv = f16x8(w, p, 18)
        f = fmul(dv, load_f32x8(xd, xb + 8 * b8))
        if isa == 0:
            for k in range(8):
                store_i8x32(buf, 32 * k, lut16(load_nib32(w, p + 18 * k + 2), table + _IQ4U))
            acc = acc_dots(acc, dots(isa, buf, xq, xo + 256 * b8, l2), f)
            cor = fadd(cor, fmul(dv, load_f32x8(xs, xb + 8 * b8)))
        else:
            for k in range(8):
                store_i8x32(buf, 32 * k, lut16(load_nib32(w, p + 18 * k + 2), table + _IQ4))
            acc = acc_dots(acc, sdots_any(isa, buf, xq, xo + 256 * b8, l2), f)
    for b in range(nb - nb % 8, nb):
        p = o + 18 * b
        v = _sdot(lut16(load_nib32(w, p + 2), table + _IQ4), xq, xo + 32 * b, l2, isa)
        acc = fma_cvt(acc, v, load_f16(w, p) * load_f32(xd, xb + b))
    return hsum(acc) - np.float32(128.0) * hsum(cor)


@njit(inline="always", fastmath=True)
def _dot_q4_0(w, o, nb, xq, xo, xd, xs, xb, l2, isa):
    """Q4_0 (18-byte blocks: f16 d, u8 qs[16], low nibbles weights 0-15): w = d (q - 8). Eight
    blocks at a time staged (cpu_kq.block_scratch), their dots behind one branch on the path and
    their d as one vector (on the vnni path the high nibbles masked in place, 16 q, no shift:
    cpu_kq.acc_dots_x16lo); a row's last nb % 8 blocks one by one."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
    for b8 in range(nb // 8):
        p = o + 144 * b8
        dv = f16x8(w, p, 18)
        blk = xb + 8 * b8
        f = fmul(dv, load_f32x8(xd, blk))
        if isa == 0:  # high nibbles left in place (16 q <= 240: vpdpbusd's bytes are unsigned), see acc_dots_x16lo
            for k in range(8):
                store_i8x32(buf, 32 * k, load_nib32_x16(w, p + 18 * k + 2))
            acc = acc_dots_x16lo(acc, dots(isa, buf, xq, xo + 256 * b8, l2), fmul(f, np.float32(0.0625)))
        else:
            for k in range(8):
                store_i8x32(buf, 32 * k, load_nib32(w, p + 18 * k + 2))
            acc = acc_dots(acc, dots(isa, buf, xq, xo + 256 * b8, l2), f)
        cor = fadd(cor, fmul(dv, load_f32x8(xs, blk)))
    corr = np.float32(0.0)
    for b in range(nb - nb % 8, nb):
        p = o + 18 * b
        d = load_f16(w, p)
        acc = fma_cvt(acc, _idot(load_nib32(w, p + 2), xq, xo + 32 * b, l2, isa), d * load_f32(xd, xb + b))
        corr += d * load_f32(xs, xb + b)
    return hsum(acc) - np.float32(8.0) * (hsum(cor) + corr)


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
def _quantize16(xf, xq, j0, d, inv, l2, x16):
    """xq[j0:j0 + 16] (and its second level at l2 when l2 > 0) from xf; the sum of the integers
    (256 q1 + q2 for two levels), each also in x16[j0:j0 + 16] unless x16 is empty."""
    s = np.int32(0)
    for j in range(j0, j0 + 16):
        q = np.int32(np.rint(xf[j] * inv))
        xq[j] = q
        if l2:
            r = np.int32(np.rint((xf[j] - np.float32(q) * d) * (np.float32(256.0) * inv)))
            r = min(max(r, np.int32(-127)), np.int32(127))
            xq[l2 + j] = r
            q = np.int32(256) * q + r
        if x16.size:
            x16[j] = q
        s += q
    return s


@njit(fastmath=True, nogil=True, cache=True)
def _quantize(xf, xq, xd, xs, xs16, l2, x16):
    """xf (m,) float32, m a multiple of 32 -> xq int8, xd, xs (m / 32,), xs16 (m / 16,): per 32
    values, d = max |x| / 127 and q1 = round(x / d) (llama.cpp's q8_0 activations); with l2 > 0
    also q2 = round((x - d q1) * 256 / d), clipped to +-127, l2 bytes after q1, so that
    x = d / 256 (256 q1 + q2) to within d / 512. xd is the scale of the integer a kernel forms (d,
    or d / 256 for two levels), xs and xs16 the sums of the dequantized values per 32 and 16
    values (the offsets' terms). Unless x16 is empty, each value's integer (256 q1 + q2, or q1) also
    as int16 in x16 (the signed types' dots off vnni: cpu_q32.sdots_any, cpu_kq.dot_i16)."""
    for b in range(xf.size // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(xf[32 * b + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        s0 = _quantize16(xf, xq, 32 * b, d, inv, l2, x16)
        s1 = _quantize16(xf, xq, 32 * b + 16, d, inv, l2, x16)
        ds = d / np.float32(256.0) if l2 else d
        xd[b] = ds
        xs[b] = ds * np.float32(s0 + s1)
        xs16[2 * b] = ds * np.float32(s0)
        xs16[2 * b + 1] = ds * np.float32(s1)


# A call is described by one int64 array, its "job": sizes, the addresses of the inputs, outputs,
# weights and scratch (all kept alive by the caller until the call has finished), and two clock
# stamps. The phases below read it; the synchronous path (_moe, OpenMP) and the pool's thread team
# (_team_worker) run the same phases.
(J_N, J_HIDDEN, J_FFN, J_EXPERTS, J_X, J_Y, J_QT, J_W, J_RB, J_BIAS, J_ACT, J_KERN, J_NG, J_ORDER, J_GSTART, J_GEXP,
 J_H, J_HU, J_XQ, J_XD, J_XS, J_XS16, J_LEVELS, J_TABLE, J_ISA, J_T0, J_T1) = (0, 1, 2, 3, 4, 5, 6, 9, 12, 15, 18, 19, 22,
                                                                     23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36)
JOB_FIELDS = 37  # J_QT, J_W, J_RB, J_BIAS, J_KERN: 3 fields each (gate, up, down); bias address 0 = none;
# J_KERN: the address of the projection's row kernel (row_kernel)
_LEVELS = 2  # int8 levels of the activations (see _quantize): 2 keeps the NMSE ~1e-9, 1 is llama.cpp's


@njit(inline="always")
def _qtype_is_float(qt):
    return qt == _F32 or qt == _F16 or qt == _BF16


def _row_kernel_of(qt: int):
    """The row kernel of type qt as Python: ``rows(job, k, g, r0, r1, x, cols, out, nrows)`` sets
    out[i * nrows + r] = row r of expert e = J_GEXP[g] of projection k (0 gate, 1 up, 2 down) .
    input i, for rows r0..r1 - 1 and the pairs i of group g (all int64: job the job's address, x
    the (n, cols) float32 inputs, out float32; their int8 form from the job, see _quantize). qt is a
    constant, so Numba prunes every other type's branch before it compiles one (see row_kernel);
    the instruction-set path (J_ISA's low 2 bits) is a branch LLVM unswitches out of the loops; the
    rows are prefetched as J_ISA's higher bits say (cpu_kq.prefetch_plan). Addresses, not arrays,
    so that Numba adds no reference counting per row."""
    def rows(job, k, g, r0, r1, x, cols, out, nrows):
        j = numba.carray(ptr_i64(job), JOB_FIELDS)
        n, w, rb, isa, table = j[J_N], j[J_W + k], j[J_RB + k], j[J_ISA] & 3, j[J_TABLE]
        order = numba.carray(ptr_i64(j[J_ORDER]), n)
        gstart = numba.carray(ptr_i64(j[J_GSTART]), n + 1)
        e = numba.carray(ptr_i64(j[J_GEXP]), n)[g]
        p0, p1 = gstart[g], gstart[g + 1]
        xq, xd, xs, xs16, nb = j[J_XQ], j[J_XD], j[J_XS], j[J_XS16], cols // 32
        l2 = n * cols if j[J_LEVELS] == 2 else 0
        base = w + e * nrows * rb
        end = base + r1 * rb
        vg = (j[J_ISA] >> 4) & 3  # the i-quants' grid gather (cpu_iq.GATHER_MODES)
        ahead, pf = prefetch_plan(base, r0, rb, end, (j[J_ISA] >> 2) & 3)  # pf: the next byte to prefetch; per
        for r in range(r0, r1):  # row up to ``ahead`` bytes past it, into the caches while it is dotted
            to = min(base + (r + 1) * rb + ahead, end)
            while pf < to:
                prefetch(pf, 0)
                pf += 64
            o = (e * nrows + r) * rb
            for p in range(p0, p1):
                i = order[p]
                xo, xb = i * cols, i * nb
                if qt == _Q8_0:
                    v = dot_q8_0(w, o, nb, xq, xo, xd, xs, xb, l2, isa)
                elif qt == _Q4_K:  # the type flags as constants: each variant compiled alone
                    v = dot_q4_k(w, o, nb, xq, xo, xd, xs, xb, l2, isa, False)
                elif qt == _Q5_K:
                    v = dot_q4_k(w, o, nb, xq, xo, xd, xs, xb, l2, isa, True)
                elif qt == _Q6_K:
                    v = dot_q6_k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa)
                elif qt == _Q2_K:
                    v = dot_q2_3k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, False)
                elif qt == _Q3_K:
                    v = dot_q2_3k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, True)
                elif qt == _IQ4_XS:
                    v = dot_iq4_xs(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table + _IQ4, table + _IQ4U)
                elif qt == _IQ2_XXS or qt == _IQ3_XXS:
                    v = dot_iq_xxs(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table + _IQX, qt == _IQ3_XXS, vg)
                elif qt == _IQ2_XS or qt == _IQ2_S or qt == _IQ3_S:
                    kind = 0 if qt == _IQ2_XS else 1 if qt == _IQ2_S else 2
                    v = dot_iq_s(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table + _IQX, kind, vg)
                elif qt == _IQ1_S or qt == _IQ1_M:
                    v = dot_iq1(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table + _IQX, qt == _IQ1_M, vg)
                elif qt == _Q4_0:
                    v = _dot_q4_0(w, o, nb, xq, xo, xd, xs, xb, l2, isa)
                elif qt == _Q4_1 or qt == _Q5_0 or qt == _Q5_1:
                    bs, hi = (20, 0) if qt == _Q4_1 else (22, 2) if qt == _Q5_0 else (24, 4)
                    v = _dot_q4_1(w, o, nb, xq, xo, xd, xs, xb, l2, isa, bs, hi)
                elif qt == _IQ4_NL:
                    v = _dot_iq4_nl(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table)
                elif qt == _MXFP4:
                    v = dot_mxfp4(w, o, nb, xq, xo, xd, xs, xb, l2, table, isa)
                else:
                    v = _dot_float(qt, w, (e * nrows + r) * cols, x, xo, cols)
                store_f32(out, i * nrows + r, v)

    rows.__qualname__ = f"_rows_{Q.LAYOUTS[qt].name}"  # its own entry in Numba's cache (see row_kernel)
    return rows


_KERNEL_SIG = types.void(*(types.int64,) * 9)
_KERNELS: dict = {}  # qtype -> its row kernel (a Numba cfunc), compiled or loaded once per process
_KERNELS_LOCK = threading.Lock()


def row_kernel(qt: int):
    """Type qt's row kernel (``_row_kernel_of``) as a C function (``.address``): compiled on the
    first call for qt in a process, or loaded from Numba's on-disk cache, so that a pool compiles
    the kernels of the types it is given and no others. Each type is its own function to the cache
    (two processes compiling two types at once would otherwise share an index and could swap them)."""
    with _KERNELS_LOCK:
        kernel = _KERNELS.get(qt)
        if kernel is None:
            kernel = numba.cfunc(_KERNEL_SIG, nopython=True, fastmath=True, cache=True)(_row_kernel_of(qt))
            _KERNELS[qt] = kernel
    return kernel


@intrinsic
def _call(typingctx, fn, args):
    """Call the C function at address fn, ``void f(int64, ...)``, with the integers of the tuple args."""
    if not isinstance(fn, types.Integer) or not all(isinstance(t, types.Integer) for t in args):
        return None

    def codegen(context, builder, sig, llargs):
        i64 = ir.IntType(64)
        vals = [context.cast(builder, builder.extract_value(llargs[1], k), t, types.int64) for k, t in enumerate(args)]
        f = builder.inttoptr(llargs[0], ir.FunctionType(ir.VoidType(), [i64] * len(vals)).as_pointer())
        builder.call(f, vals)
        return context.get_dummy_value()
    return types.void(fn, args), codegen


@njit(inline="always", fastmath=True)
def _group(job):
    """Group the pairs by expert, stable (J_ORDER, J_GSTART, J_GEXP, J_NG): a counting sort."""
    n = job[J_N]
    experts = numba.carray(ptr_i64(job[J_EXPERTS]), n)
    order = numba.carray(ptr_i64(job[J_ORDER]), n)
    gstart = numba.carray(ptr_i64(job[J_GSTART]), n + 1)
    gexp = numba.carray(ptr_i64(job[J_GEXP]), n)
    top = 0
    for p in range(n):
        top = max(top, experts[p] + 1)
    first = np.zeros(top + 1, np.int64)
    for p in range(n):
        first[experts[p] + 1] += 1
    ng = 0
    for e in range(top):
        if first[e + 1]:
            gstart[ng] = first[e]
            gexp[ng] = e
            ng += 1
        first[e + 1] += first[e]
    gstart[ng] = n
    job[J_NG] = ng
    for p in range(n):
        e = experts[p]
        order[first[e]] = p
        first[e] += 1


@njit(inline="always", fastmath=True)
def _quantize_input(job, x, cols, k0, k1, t, parts):
    """Part t of ``parts`` of the int8 form of the (n, cols) inputs at x (whole 32-value blocks),
    for projections k0..k1 (nothing when they are all float)."""
    if _qtype_is_float(job[J_QT + k0]) and _qtype_is_float(job[J_QT + k1]):
        return
    if cols % 32:
        return
    m = job[J_N] * cols
    l2 = m if job[J_LEVELS] == 2 else 0
    b0 = t * (m // 32) // parts
    b1 = (t + 1) * (m // 32) // parts
    xq = numba.carray(ptr_i8(job[J_XQ]), m * job[J_LEVELS])
    qa, qb = job[J_QT + k0], job[J_QT + k1]  # off vnni, the signed types' dots read the int16 form, from byte 2 m + 64
    i16 = l2 > 0 and (job[J_ISA] & 3) != 0 and (qa == _Q8_0 or qa == _IQ4_XS or qa == _IQ4_NL or qb == _Q8_0
                                               or qb == _IQ4_XS or qb == _IQ4_NL)
    x16 = numba.carray(ptr_i16(job[J_XQ] + 2 * m + 64), m if i16 else 0)[32 * b0:]
    _quantize(numba.carray(ptr_f32(x), m)[32 * b0:32 * b1], xq[32 * b0:], numba.carray(ptr_f32(job[J_XD]), m // 32)[b0:],
              numba.carray(ptr_f32(job[J_XS]), m // 32)[b0:], numba.carray(ptr_f32(job[J_XS16]), m // 16)[2 * b0:], l2, x16)


@njit(inline="always", fastmath=True)
def _chunk(job, t, chunks, phase):
    """Chunk t of ``chunks`` equal runs of the flat (expert group, row) work of ``phase``: 0 gate
    and up into h (activation and biases applied), 1 down into y (bias added)."""
    n, hidden, ffn = job[J_N], job[J_HIDDEN], job[J_FFN]
    rows = ffn if phase == 0 else hidden
    cols = hidden if phase == 0 else ffn
    work = job[J_NG] * rows
    f0 = t * work // chunks
    f1 = (t + 1) * work // chunks
    gexp = numba.carray(ptr_i64(job[J_GEXP]), n)
    order = numba.carray(ptr_i64(job[J_ORDER]), n)
    gstart = numba.carray(ptr_i64(job[J_GSTART]), n + 1)
    ja = addr(job)
    for g in range((f0 // rows) if rows else 0, ((f1 + rows - 1) // rows) if rows else 0):
        r0 = max(f0 - g * rows, 0)
        r1 = min(f1 - g * rows, rows)
        e = gexp[g]
        if phase == 0:
            h, hu = job[J_H], job[J_HU]
            _call(job[J_KERN], (ja, 0, g, r0, r1, job[J_X], cols, h, rows))
            _call(job[J_KERN + 1], (ja, 1, g, r0, r1, job[J_X], cols, hu, rows))
            _activate(job, e, r0, r1, order[gstart[g]:gstart[g + 1]], h, hu, rows)
        else:
            _call(job[J_KERN + 2], (ja, 2, g, r0, r1, job[J_H], cols, job[J_Y], rows))
            bd = job[J_BIAS + 2]
            if bd:
                for p in range(gstart[g], gstart[g + 1]):
                    i = order[p]
                    for r in range(r0, r1):
                        store_f32(job[J_Y], i * rows + r, load_f32(job[J_Y], i * rows + r) + load_f32(bd, e * rows + r))


_EXP_MAX = np.float32(80.0)  # exp's argument is clipped here: fastmath assumes no infinities


@njit(inline="always", fastmath=True)
def _activate(job, e, r0, r1, pairs, h, hu, rows):
    """h = act(h + bg[e], hu + bu[e]) at rows r0..r1 - 1 of the pairs: silu(a) * b (J_ACT 0) or
    gpt-oss's clamped SwiGLU (J_ACT 1; limit 7, alpha 1.702); bias address 0 = none."""
    bg, bu, oai = job[J_BIAS], job[J_BIAS + 1], job[J_ACT]
    for i in pairs:
        for r in range(r0, r1):
            a = load_f32(h, i * rows + r)
            b = load_f32(hu, i * rows + r)
            if bg:
                a += load_f32(bg, e * rows + r)
            if bu:
                b += load_f32(bu, e * rows + r)
            if oai:
                a = min(a, np.float32(7.0))
                b = min(max(b, np.float32(-7.0)), np.float32(7.0))
                v = a / (np.float32(1.0) + np.exp(min(np.float32(-1.702) * a, _EXP_MAX))) * (b + np.float32(1.0))
            else:
                v = a / (np.float32(1.0) + np.exp(min(-a, _EXP_MAX))) * b
            store_f32(h, i * rows + r, v)


@njit(fastmath=True, nogil=True, cache=True)
def run_phase(job, phase, c, chunks):
    """Chunk c of ``chunks`` of a call's ``phase``: 0 group the pairs (one chunk), 1 quantize x,
    2 gate+up, 3 quantize h, 4 down. The pool's team and _moe share this one compiled copy (int64
    arguments: a constant argument would compile a copy of its own)."""
    if phase == 0:
        _group(job)
    elif phase == 1:
        _quantize_input(job, job[J_X], job[J_HIDDEN], 0, 1, c, chunks)
    elif phase == 2:
        _chunk(job, c, chunks, 0)
    elif phase == 3:
        _quantize_input(job, job[J_H], job[J_FFN], 2, 2, c, chunks)
    else:
        _chunk(job, c, chunks, 1)


@njit(parallel=True, nogil=True, cache=True)
def _moe(job, chunks):
    """The whole call on Numba's thread pool: two parallel regions of ``chunks`` chunks."""
    zero, one, n = np.int64(0), np.int64(1), np.int64(chunks)
    run_phase(job, zero, zero, one)
    run_phase(job, one, zero, one)
    for t in prange(chunks):
        run_phase(job, np.int64(2), np.int64(t), n)
    run_phase(job, np.int64(3), zero, one)
    for t in prange(chunks):
        run_phase(job, np.int64(4), np.int64(t), n)


_OAI = {"silu": 0, "swiglu_oai": 1}  # activation -> J_ACT


def tensor_views(t: ExpertTensor) -> tuple:
    """(flat uint8 bytes of all experts' rows, qtype, row_bytes): what the kernels read, checked."""
    rb = Q.row_bytes(t.qtype, t.cols, t.name or "expert tensor", Q.CPU_QTYPES)
    if t.expert_bytes != rb * t.rows:
        raise ValueError(f"{t.name or 'expert tensor'}: {t.expert_bytes} bytes per expert, expected "
                         f"{t.rows} rows x {rb} = {rb * t.rows} for {Q.LAYOUTS[t.qtype].name}")
    flat = np.ascontiguousarray(t.data).reshape(-1)
    if t.qtype in (Q.F16, Q.BF16, Q.F32) and flat.ctypes.data % (4 if t.qtype == Q.F32 else 2):
        raise ValueError(f"{t.name or 'expert tensor'}: {Q.LAYOUTS[t.qtype].name} data must be aligned to its element size")
    return flat, int(t.qtype), int(rb)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class _Scratch:
    """Per-call work buffers (grown on demand, never shrunk); a call's job holds their addresses,
    so an in-flight call keeps the set it started with (``CpuJob`` holds a reference)."""

    def __init__(self, isa: str | None = None):
        self.n = self.width = 0
        self.arrays: tuple = ()
        self.isa = choose_isa(isa) | choose_prefetch() << 2 | choose_gather() << 4  # MOELAB_CPU_ISA (else the
        # host's best), MOELAB_CPU_PREFETCH, MOELAB_CPU_GATHER

    def fields(self, n: int, hidden: int, ffn: int) -> tuple[tuple, np.ndarray]:
        """(arrays, the job fields J_ORDER .. J_ISA: their addresses, _LEVELS, the code tables',
        the instruction-set path)."""
        width = max(hidden, ffn)
        if n > self.n or width > self.width or (n * ffn > 0 and not self.arrays):
            self.n, self.width = max(n, self.n, 1), max(width, self.width)
            nn, m = self.n, self.n * self.width
            self.arrays = (np.empty(nn, np.int64), np.empty(nn + 1, np.int64), np.empty(nn, np.int64),
                           np.empty(nn * max(ffn, self.width), np.float32), np.empty(nn * max(ffn, self.width), np.float32),
                           np.empty(4 * m + 128, np.int8), np.empty(m // 32 + 1, np.float32),  # xq: levels, int16 form
                           np.empty(m // 32 + 1, np.float32), np.empty(m // 16 + 1, np.float32))
            self.addrs = np.array([_addr(a) for a in self.arrays] + [_LEVELS, _addr(_TABLES), self.isa], np.int64)
        return self.arrays, self.addrs


def _layer_fields(layer: LayerExperts, views: tuple) -> np.ndarray:
    """The job fields of a layer that do not change between calls (J_HIDDEN, J_FFN, J_QT .. J_KERN):
    the first layer of a type compiles its row kernel (see row_kernel)."""
    bias = tuple(0 if b is None else _addr(b) for b in (layer.gate_bias, layer.up_bias, layer.down_bias))
    return np.array((layer.hidden, layer.ffn) + tuple(v[1] for v in views) + tuple(_addr(v[0]) for v in views)
                    + tuple(v[2] for v in views) + bias + (_OAI[layer.activation],)
                    + tuple(row_kernel(v[1]).address for v in views), np.int64)


def _check_call(layer: LayerExperts, experts, x, out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(experts int64, x, y) checked but for the expert range (see _launch): ValueError naming the
    layer and what was expected."""
    e = np.ascontiguousarray(experts, dtype=np.int64).reshape(-1)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (len(e), layer.hidden):
        raise ValueError(f"layer {layer.layer}: x has shape {x.shape}, expected ({len(e)}, {layer.hidden})")
    y = np.empty((len(e), layer.hidden), np.float32) if out is None else out
    if y.shape != (len(e), layer.hidden) or y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError(f"layer {layer.layer}: out must be C-contiguous float32 ({len(e)}, {layer.hidden})")
    return e, x, y


def _bad_experts(layer: LayerExperts) -> ValueError:
    return ValueError(f"layer {layer.layer}: expert ids must be in 0..{layer.num_experts - 1}")


@njit(nogil=True, cache=True)
def _fill(job, e, x, y, num_experts, fixed, scratch):
    """Fill ``job`` for a call of pairs (e, x) into y (fixed: _layer_fields, scratch:
    _Scratch.fields). False, with nothing written, when an expert id is out of 0..num_experts - 1."""
    for v in e:
        if v < 0 or v >= num_experts:
            return False
    job[J_N] = e.size
    job[J_HIDDEN:J_EXPERTS] = fixed[:2]
    job[J_EXPERTS] = addr(e)
    job[J_X] = addr(x)
    job[J_Y] = addr(y)
    job[J_QT:J_NG] = fixed[2:]
    job[J_NG] = 0
    job[J_ORDER:J_T0] = scratch
    return True


def run_experts(layer: LayerExperts, experts: Sequence[int], x: np.ndarray, threads: int | None = None,
                views: tuple | None = None, out: np.ndarray | None = None, isa: str | None = None) -> np.ndarray:
    """Compute the pairs' expert outputs on the calling thread with Numba's thread pool (``threads``
    chunks per region): (n, hidden) float32 (into ``out`` when given, e.g. a page-locked buffer);
    ``isa`` forces an instruction-set path (cpu_simd.ISA_PATHS; default MOELAB_CPU_ISA, else the best)."""
    e, x, y = _check_call(layer, experts, x, out)
    views = views or (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down))
    job = np.zeros(JOB_FIELDS, np.int64)
    keep, scratch = _Scratch(isa).fields(len(e), layer.hidden, layer.ffn)
    if not _fill(job, e, x, y, layer.num_experts, _layer_fields(layer, views), scratch):
        raise _bad_experts(layer)
    _moe(job, int(threads or numba.get_num_threads()))
    del keep
    return y
