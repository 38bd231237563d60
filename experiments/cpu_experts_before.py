"""The CPU expert kernels as they were before the vectorized rewrite (execute/cpu_experts.py at
commit d26c8cb): each weight row dequantized into a float32 buffer, then dotted. Kept only so that
experiments/bench_cpu_experts.py can print old and new rates side by side in one run; the
executor never imports it.
"""
from __future__ import annotations

import math
from typing import Sequence

import numba
import numpy as np
from numba import njit, prange

from execute import quant as Q
from execute.experts import ExpertTensor, LayerExperts

__all__ = ["run_experts", "tensor_views"]

_LUT = Q.F16_TO_F32
_Q8_0, _Q4_0, _Q4_K, _Q6_K, _F32, _F16, _BF16 = Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16


@njit(inline="always", fastmath=True)
def _q4k_scale_min(u8, o, s):
    """6-bit scale and min of sub-block ``s`` (0..7) of the Q4_K block at byte ``o``."""
    p = o + 4
    if s < 4:
        return u8[p + s] & 63, u8[p + s + 4] & 63
    sc = (u8[p + s + 4] & 15) | ((u8[p + s - 4] >> 6) << 4)
    mn = (u8[p + s + 4] >> 4) | ((u8[p + s] >> 6) << 4)
    return sc, mn


@njit(inline="always", fastmath=True)
def _dequant_row(qt, u8, i8, u16, f32, off, cols, buf):
    """Weights of the row starting at byte ``off`` -> buf[:cols] (float32); BF16 is _load_row's."""
    if qt == _Q8_0:
        for b in range(cols // 32):  # block: f16 d, i8 qs[32]
            o = off + b * 34
            d = _LUT[u16[o >> 1]]
            for j in range(32):
                buf[b * 32 + j] = d * np.float32(i8[o + 2 + j])
    elif qt == _Q4_0:
        for b in range(cols // 32):  # block: f16 d, u8 qs[16]
            o = off + b * 18
            d = _LUT[u16[o >> 1]]
            for j in range(16):
                q = u8[o + 2 + j]
                buf[b * 32 + j] = d * np.float32(np.int32(q & 15) - 8)
                buf[b * 32 + 16 + j] = d * np.float32(np.int32(q >> 4) - 8)
    elif qt == _Q4_K:
        for b in range(cols // 256):  # block: f16 d, f16 dmin, u8 scales[12], u8 qs[128]
            o = off + b * 144
            d = _LUT[u16[o >> 1]]
            dmin = _LUT[u16[(o >> 1) + 1]]
            for c in range(4):  # 64 weights: 32 low nibbles, 32 high nibbles
                sc0, m0 = _q4k_scale_min(u8, o, 2 * c)
                sc1, m1 = _q4k_scale_min(u8, o, 2 * c + 1)
                d0, n0 = d * np.float32(sc0), dmin * np.float32(m0)
                d1, n1 = d * np.float32(sc1), dmin * np.float32(m1)
                base = b * 256 + c * 64
                qo = o + 16 + c * 32
                for j in range(32):
                    q = u8[qo + j]
                    buf[base + j] = d0 * np.float32(q & 15) - n0
                    buf[base + 32 + j] = d1 * np.float32(q >> 4) - n1
    elif qt == _Q6_K:
        for b in range(cols // 256):  # block: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
            o = off + b * 210
            d = _LUT[u16[(o >> 1) + 104]]
            for h in range(2):  # halves of 128 weights
                ql = o + 64 * h
                qh = o + 128 + 32 * h
                sc = o + 192 + 8 * h
                base = b * 256 + 128 * h
                for j in range(32):
                    hb = u8[qh + j]
                    lo0 = u8[ql + j]
                    lo1 = u8[ql + 32 + j]
                    s = j >> 4
                    buf[base + j] = d * np.float32(i8[sc + s]) * np.float32(np.int32((lo0 & 15) | ((hb & 3) << 4)) - 32)
                    buf[base + 32 + j] = d * np.float32(i8[sc + s + 2]) * np.float32(np.int32((lo1 & 15) | (((hb >> 2) & 3) << 4)) - 32)
                    buf[base + 64 + j] = d * np.float32(i8[sc + s + 4]) * np.float32(np.int32((lo0 >> 4) | (((hb >> 4) & 3) << 4)) - 32)
                    buf[base + 96 + j] = d * np.float32(i8[sc + s + 6]) * np.float32(np.int32((lo1 >> 4) | ((hb >> 6) << 4)) - 32)
    elif qt == _F32:
        o = off >> 2
        for j in range(cols):
            buf[j] = f32[o + j]
    elif qt == _F16:
        o = off >> 1
        for j in range(cols):
            buf[j] = _LUT[u16[o + j]]


@njit(inline="always", fastmath=True)
def _load_row(qt, u8, i8, u16, f32, off, cols, buf, bits):
    if qt == _BF16:
        o = off >> 1
        for j in range(cols):  # bits: uint32 view of buf
            bits[j] = np.uint32(u16[o + j]) << 16
    else:
        _dequant_row(qt, u8, i8, u16, f32, off, cols, buf)


@njit(inline="always", fastmath=True)
def _dot(a, x, cols):
    acc = np.float32(0.0)
    for j in range(cols):
        acc += a[j] * x[j]
    return acc


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _gate_up(g, u, group_expert, group_start, order, x, h, rows_per_task):
    """h[i] = silu(gate_e x[i]) * (up_e x[i]) for every pair i. x: (n, hidden); h: (n, ffn)."""
    ffn = h.shape[1]
    hidden = x.shape[1]
    tasks_per_group = (ffn + rows_per_task - 1) // rows_per_task
    n_tasks = group_expert.shape[0] * tasks_per_group
    for t in prange(n_tasks):
        k = t // tasks_per_group
        r0 = (t % tasks_per_group) * rows_per_task
        r1 = min(r0 + rows_per_task, ffn)
        e = group_expert[k]
        wg = np.empty(hidden, np.float32)
        wu = np.empty(hidden, np.float32)
        bg = wg.view(np.uint32)
        bu = wu.view(np.uint32)
        for r in range(r0, r1):
            _load_row(g[4], g[0], g[1], g[2], g[3], e * g[5] + r * g[6], hidden, wg, bg)
            _load_row(u[4], u[0], u[1], u[2], u[3], e * u[5] + r * u[6], hidden, wu, bu)
            for p in range(group_start[k], group_start[k + 1]):
                i = order[p]
                a = _dot(wg, x[i], hidden)
                b = _dot(wu, x[i], hidden)
                h[i, r] = a / (np.float32(1.0) + np.exp(-a)) * b


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _down(dn, group_expert, group_start, order, h, y, rows_per_task):
    """y[i] = down_e h[i] for every pair i. h: (n, ffn); y: (n, hidden)."""
    hidden = y.shape[1]
    ffn = h.shape[1]
    tasks_per_group = (hidden + rows_per_task - 1) // rows_per_task
    n_tasks = group_expert.shape[0] * tasks_per_group
    for t in prange(n_tasks):
        k = t // tasks_per_group
        r0 = (t % tasks_per_group) * rows_per_task
        r1 = min(r0 + rows_per_task, hidden)
        e = group_expert[k]
        w = np.empty(ffn, np.float32)
        bits = w.view(np.uint32)
        for r in range(r0, r1):
            _load_row(dn[4], dn[0], dn[1], dn[2], dn[3], e * dn[5] + r * dn[6], ffn, w, bits)
            for p in range(group_start[k], group_start[k + 1]):
                i = order[p]
                y[i, r] = _dot(w, h[i], ffn)


_EMPTY_F32 = np.zeros(1, np.float32)


def tensor_views(t: ExpertTensor) -> tuple:
    """(u8, i8, u16, f32, qtype, expert_bytes, row_bytes): the byte views the kernels read."""
    Q.row_bytes(t.qtype, t.cols, t.name or "expert tensor")
    rb = Q.row_bytes(t.qtype, t.cols)
    if t.expert_bytes != rb * t.rows:
        raise ValueError(f"{t.name or 'expert tensor'}: {t.expert_bytes} bytes per expert, expected "
                         f"{t.rows} rows x {rb} = {rb * t.rows} for {Q.QTYPES[t.qtype].name}")
    flat = np.asarray(t.data).reshape(-1)
    f32 = flat.view(np.float32) if t.qtype == Q.F32 else _EMPTY_F32
    return (flat, flat.view(np.int8), flat.view(np.uint16), f32, np.int64(t.qtype),
            np.int64(t.expert_bytes), np.int64(rb))


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
    _gate_up(g, u, ids, start, order, x, h, _rows_per_task(layer.ffn, len(ids), th))
    _down(d, ids, start, order, h, y, _rows_per_task(layer.hidden, len(ids), th))
    return y
