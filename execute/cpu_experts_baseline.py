"""The CPU expert kernels as they were before the int8 rewrite of ``cpu_experts``: float32
activations, each weight row dotted block by block in place (vectorized by LLVM: vpmovsxbd,
vcvtdq2ps, vfmadd on ymm), two parallel regions on Numba's OpenMP pool per call; Q8_0, Q4_0, Q4_K,
Q6_K, MXFP4, F32, F16 and BF16. A baseline only: experiments/bench_cpu_experts.py prints its rates
beside the current kernels' in one run; the executor never imports it.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the OpenMP runtime loads (see above)

import numba  # noqa: E402
import numpy as np
from numba import njit, prange

from . import quant as Q
from .cpu_experts import _bits_f32, _half  # the same bit reinterpretations
from .experts import ExpertTensor, LayerExperts

__all__ = ["run_experts", "tensor_views"]

_Q8_0, _Q4_0, _Q4_K, _Q6_K, _F32, _F16, _BF16 = Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16
_MXFP4 = Q.MXFP4
# MXFP4 code -> value, a float32 table (a compile-time constant: on this AVX2 VM the lookup measured
# faster than computing the value from the code's bits with selects or max)
_MXFP4_VALUES = Q.MXFP4_VALUES.copy()
# Inner-loop trip counts, passed to the kernels as run-time values: with a constant trip count
# LLVM unrolls the 32-weight loop completely and then vectorizes across blocks (stride-34 byte
# gathers, vpinsrb); with a run-time one it vectorizes the loop itself (vpmovsxbd, vcvtdq2ps, vfmadd).
_LANES = np.array([32, 16], np.int64)
# Numba computes integer arithmetic in int64, whose conversion to float32 has no packed
# instruction before AVX-512DQ (scalar vcvtsi2ss): nibble expressions are cast to int32 (LLVM then
# narrows the arithmetic) before they become float32.


@njit(inline="always")
def _q4k_scale_min(u8b, k, s):
    """6-bit scale and min of sub-block ``s`` (0..7) of Q4_K block ``k`` (bytes 4..15 of it)."""
    if s < 4:
        return np.float32(u8b[k, 4 + s] & 63), np.float32(u8b[k, 8 + s] & 63)
    sc = (u8b[k, 8 + s] & 15) | ((u8b[k, s] >> 6) << 4)
    mn = (u8b[k, 8 + s] >> 4) | ((u8b[k, 4 + s] >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(inline="always", fastmath=True)
def _dot_q8_0(i8b, u16b, k0, x, xs, n32):
    """Row of Q8_0 blocks k0.. (i8b: (blocks, 34), u16b: (blocks, 17)) . x (cols,)."""
    xb = x.reshape((x.size // 32, 32))  # (blocks, 32)
    acc = np.float32(0.0)
    for b in range(xb.shape[0]):
        k = k0 + b
        s = np.float32(0.0)
        for j in range(n32):
            s += np.float32(i8b[k, 2 + j]) * xb[b, j]
        acc += _half(u16b[k, 0]) * s
    return acc


@njit(inline="always", fastmath=True)
def _dot_q4_0(u8b, u16b, k0, x, xs, n16):
    """Row of Q4_0 blocks (u8b: (blocks, 18)) . x; xs: x's 32-weight block sums (the -8 offset)."""
    xb = x.reshape((x.size // 32, 2, 16))  # (blocks, low/high nibble, 16)
    acc = np.float32(0.0)
    for b in range(xb.shape[0]):
        k = k0 + b
        s = np.float32(0.0)
        for j in range(n16):
            q = u8b[k, 2 + j]
            s += np.float32(np.int32(q & 15)) * xb[b, 0, j] + np.float32(np.int32(q >> 4)) * xb[b, 1, j]
        acc += _half(u16b[k, 0]) * (s - np.float32(8.0) * xs[b])
    return acc


@njit(inline="always")
def _e8m0(e):
    """MXFP4 block exponent (uint8) -> float32 2^(e - 128) from its bits (denormal for e < 2)."""
    ee = np.uint32(e)
    return _bits_f32(np.uint32(np.uint32(0x00200000) << ee if ee < 2 else (ee - np.uint32(1)) << np.uint32(23)))


@njit(inline="always", fastmath=True)
def _dot_mxfp4(u8b, k0, x, n16):
    """Row of MXFP4 blocks (u8b: (blocks, 17): u8 e, u8 qs[16]) . x; only byte loads (odd blocks)."""
    xb = x.reshape((x.size // 32, 2, 16))  # (blocks, low/high nibble, 16)
    acc = np.float32(0.0)
    for b in range(xb.shape[0]):
        k = k0 + b
        s = np.float32(0.0)
        for j in range(n16):
            q = u8b[k, 1 + j]
            s += _MXFP4_VALUES[q & 15] * xb[b, 0, j] + _MXFP4_VALUES[q >> 4] * xb[b, 1, j]
        acc += _e8m0(u8b[k, 0]) * s
    return acc


@njit(inline="always", fastmath=True)
def _dot_q4_k(u8b, u16b, k0, x, xs, n32):
    """Row of Q4_K blocks (u8b: (blocks, 144)) . x; mins through xs (x's 32-weight sums)."""
    xb = x.reshape((x.size // 256, 4, 2, 32))  # (blocks, 64-weight chunk, nibble, 32)
    xsb = xs.reshape((x.size // 256, 8))  # (blocks, sub-block)
    acc = np.float32(0.0)
    for b in range(xb.shape[0]):
        k = k0 + b
        d = _half(u16b[k, 0])
        dmin = _half(u16b[k, 1])
        for c in range(4):
            sc0, m0 = _q4k_scale_min(u8b, k, 2 * c)
            sc1, m1 = _q4k_scale_min(u8b, k, 2 * c + 1)
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for j in range(n32):
                q = u8b[k, 16 + 32 * c + j]
                s0 += np.float32(np.int32(q & 15)) * xb[b, c, 0, j]
                s1 += np.float32(np.int32(q >> 4)) * xb[b, c, 1, j]
            acc += d * (sc0 * s0 + sc1 * s1) - dmin * (m0 * xsb[b, 2 * c] + m1 * xsb[b, 2 * c + 1])
    return acc


@njit(inline="always", fastmath=True)
def _dot_q6_k(u8b, i8b, u16b, k0, x, n16):
    """Row of Q6_K blocks (u8b/i8b: (blocks, 210): ql[128], qh[64], i8 scales[16], f16 d) . x."""
    xb = x.reshape((x.size // 256, 2, 4, 2, 16))  # (blocks, half, 32-group, 16-half, 16)
    acc = np.float32(0.0)
    for b in range(xb.shape[0]):
        k = k0 + b
        s = np.float32(0.0)
        for h in range(2):
            ql = 64 * h
            qh = 128 + 32 * h
            for m in range(2):
                sc = 192 + 8 * h + m
                c0 = np.float32(i8b[k, sc])
                c1 = np.float32(i8b[k, sc + 2])
                c2 = np.float32(i8b[k, sc + 4])
                c3 = np.float32(i8b[k, sc + 6])
                for j in range(n16):
                    jj = 16 * m + j
                    lo0 = u8b[k, ql + jj]
                    lo1 = u8b[k, ql + 32 + jj]
                    hb = u8b[k, qh + jj]
                    q0 = np.int32((lo0 & 15) | ((hb & 3) << 4)) - np.int32(32)
                    q1 = np.int32((lo1 & 15) | ((hb & 12) << 2)) - np.int32(32)
                    q2 = np.int32((lo0 >> 4) | (hb & 48)) - np.int32(32)
                    q3 = np.int32((lo1 >> 4) | ((hb >> 2) & 48)) - np.int32(32)
                    s += (c0 * np.float32(q0) * xb[b, h, 0, m, j] + c1 * np.float32(q1) * xb[b, h, 1, m, j]
                          + c2 * np.float32(q2) * xb[b, h, 2, m, j] + c3 * np.float32(q3) * xb[b, h, 3, m, j])
        acc += _half(u16b[k, 104]) * s
    return acc


@njit(inline="always", fastmath=True)
def _dot_row(v, row, x, xs, lanes):
    """Weight row ``row`` (of all experts' rows) of tensor views ``v`` (see _blocks) . x (cols,)."""
    qt, u8b, i8b, u16b, f32b = v
    if qt == _F32:
        s = np.float32(0.0)
        for j in range(x.size):
            s += f32b[row, j] * x[j]
        return s
    if qt == _F16:
        s = np.float32(0.0)
        for j in range(x.size):
            s += _half(u16b[row, j]) * x[j]
        return s
    if qt == _BF16:
        s = np.float32(0.0)
        for j in range(x.size):
            s += _bits_f32(np.uint32(u16b[row, j]) << 16) * x[j]
        return s
    if qt == _Q8_0:
        return _dot_q8_0(i8b, u16b, row * (x.size // 32), x, xs, lanes[0])
    if qt == _Q4_0:
        return _dot_q4_0(u8b, u16b, row * (x.size // 32), x, xs, lanes[1])
    if qt == _MXFP4:
        return _dot_mxfp4(u8b, row * (x.size // 32), x, lanes[1])
    if qt == _Q4_K:
        return _dot_q4_k(u8b, u16b, row * (x.size // 256), x, xs, lanes[0])
    return _dot_q6_k(u8b, i8b, u16b, row * (x.size // 256), x, lanes[1])


@njit(inline="always")
def _blocks(v, cols):
    """tensor_views tuple -> (qtype, u8, i8, u16 as (blocks, block units), f32 as (rows, cols)):
    a float type's block is one row, so every weight row starts at block ``row * blocks per row``.
    MXFP4's 17-byte blocks have no 16-bit view (u16 is a (1, 1) dummy)."""
    u8, i8, u16, f32, qt, eb, rb = v
    if qt == _Q8_0:
        bb = 34
    elif qt == _Q4_0:
        bb = 18
    elif qt == _Q4_K:
        bb = 144
    elif qt == _Q6_K:
        bb = 210
    elif qt == _MXFP4:
        bb = 17
    else:
        bb = rb
    n = u8.size // bb
    f2 = f32.reshape((n, cols)) if qt == _F32 else f32.reshape((1, 1))
    u2 = u16.reshape((1, 1)) if qt == _MXFP4 else u16.reshape((n, bb // 2))
    return qt, u8.reshape((n, bb)), i8.reshape((n, bb)), u2, f2


@njit(inline="always", fastmath=True)
def _swiglu_oai(a, b, limit, alpha):
    """gpt-oss's clamped SwiGLU on gate ``a`` and up ``b`` (biases added)."""
    a = min(a, limit)
    b = min(max(b, -limit), limit)
    return a / (np.float32(1.0) + np.exp(-alpha * a)) * (b + np.float32(1.0))


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _gate_up(g, u, bg, bu, oai, group_expert, group_start, order, x, xs, h, rows_per_task, lanes):
    """h[i] = act(gate_e x[i] + bg[e], up_e x[i] + bu[e]) for every pair i: act is silu(a) * b when
    ``oai`` is None, else ``_swiglu_oai`` with ``oai`` = (limit, alpha). x: (n, hidden); xs: (n,
    hidden/32) block sums of x; h: (n, ffn); bg, bu: (experts, ffn) or None. None arguments are
    typed as such, so their branches are compiled out (the plain silu path has none)."""
    ffn = h.shape[1]
    hidden = x.shape[1]
    gv = _blocks(g, hidden)
    uv = _blocks(u, hidden)
    tasks_per_group = (ffn + rows_per_task - 1) // rows_per_task
    n_tasks = group_expert.shape[0] * tasks_per_group
    for t in prange(n_tasks):
        k = t // tasks_per_group
        r0 = (t % tasks_per_group) * rows_per_task
        r1 = min(r0 + rows_per_task, ffn)
        e = group_expert[k]
        for r in range(r0, r1):
            for p in range(group_start[k], group_start[k + 1]):
                i = order[p]
                a = _dot_row(gv, e * ffn + r, x[i], xs[i], lanes)
                b = _dot_row(uv, e * ffn + r, x[i], xs[i], lanes)
                if bg is not None:
                    a += bg[e, r]
                if bu is not None:
                    b += bu[e, r]
                if oai is None:
                    h[i, r] = a / (np.float32(1.0) + np.exp(-a)) * b
                else:
                    h[i, r] = _swiglu_oai(a, b, oai[0], oai[1])


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _down(dn, bd, group_expert, group_start, order, h, hs, y, rows_per_task, lanes):
    """y[i] = down_e h[i] + bd[e] for every pair i. h: (n, ffn); hs: (n, ffn/32) block sums;
    y: (n, hidden); bd: (experts, hidden) or None (compiled out)."""
    hidden = y.shape[1]
    ffn = h.shape[1]
    dv = _blocks(dn, ffn)
    tasks_per_group = (hidden + rows_per_task - 1) // rows_per_task
    n_tasks = group_expert.shape[0] * tasks_per_group
    for t in prange(n_tasks):
        k = t // tasks_per_group
        r0 = (t % tasks_per_group) * rows_per_task
        r1 = min(r0 + rows_per_task, hidden)
        e = group_expert[k]
        for r in range(r0, r1):
            for p in range(group_start[k], group_start[k + 1]):
                i = order[p]
                y[i, r] = _dot_row(dv, e * hidden + r, h[i], hs[i], lanes)
                if bd is not None:
                    y[i, r] += bd[e, r]


_EMPTY_F32 = np.zeros(1, np.float32)
_EMPTY_U16 = np.zeros(1, np.uint16)
_OAI = {"silu": None, "swiglu_oai": (np.float32(7.0), np.float32(1.702))}  # activation -> _gate_up's oai


def tensor_views(t: ExpertTensor) -> tuple:
    """(u8, i8, u16, f32, qtype, expert_bytes, row_bytes): the byte views the kernels read."""
    Q.row_bytes(t.qtype, t.cols, t.name or "expert tensor")
    rb = Q.row_bytes(t.qtype, t.cols)
    if t.expert_bytes != rb * t.rows:
        raise ValueError(f"{t.name or 'expert tensor'}: {t.expert_bytes} bytes per expert, expected "
                         f"{t.rows} rows x {rb} = {rb * t.rows} for {Q.QTYPES[t.qtype].name}")
    flat = np.asarray(t.data).reshape(-1)
    f32 = flat.view(np.float32) if t.qtype == Q.F32 else _EMPTY_F32
    u16 = _EMPTY_U16 if t.qtype == Q.MXFP4 else flat.view(np.uint16)
    return (flat, flat.view(np.int8), u16, f32, np.int64(t.qtype),
            np.int64(t.expert_bytes), np.int64(rb))


def _block_sums(x: np.ndarray) -> np.ndarray:
    """(n, cols) -> (n, cols / 32) float32 sums of each 32-column block (Q4_0/Q4_K offsets)."""
    if x.shape[1] % 32:  # only float types have such rows; they do not read the sums
        return np.zeros((x.shape[0], 1), np.float32)
    return x.reshape(x.shape[0], -1, 32).sum(axis=2, dtype=np.float32)


def _groups(experts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.argsort(experts, kind="stable").astype(np.int64)
    ids, start = np.unique(experts[order], return_index=True)
    return ids.astype(np.int64), np.append(start, len(experts)).astype(np.int64), order


def _rows_per_task(rows: int, groups: int, threads: int) -> int:
    """About 4 tasks per thread, at least 4 rows each."""
    return max(4, math.ceil(rows * groups / (4 * max(threads, 1))))


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
    if not len(e):
        return y
    g, u, d = views or (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down))
    ids, start, order = _groups(e)
    th = threads or numba.get_num_threads()
    h = np.empty((len(e), layer.ffn), np.float32)
    _gate_up(g, u, layer.gate_bias, layer.up_bias, _OAI[layer.activation], ids, start, order, x, _block_sums(x), h,
             _rows_per_task(layer.ffn, len(ids), th), _LANES)
    _down(d, layer.down_bias, ids, start, order, h, _block_sums(h), y, _rows_per_task(layer.hidden, len(ids), th),
          _LANES)
    return y
