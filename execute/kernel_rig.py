"""The GPU side of ``execute.kernel_timing``: random weights of a ``BlockShape`` on the device,
and each variant's launches prepared as ``TokenGraph`` prepares them (``GpuDense.decode_block``,
``GpuExperts.routed_layer``), so the timed kernels are the token graph's, with its arguments."""
from __future__ import annotations

from typing import NamedTuple

import cupy as cp
import numpy as np

from scheduler.core import Capacity, Geometry

from . import quant as Q
from .experts import random_layer
from .gpu_dense import GpuDense, Matrix
from .gpu_experts import GpuExperts

__all__ = ["Plan", "Rig"]

_EPS = 1e-6
_HALT_NONE = 0x7F  # halt's bytes before a token: no block missed


class Plan(NamedTuple):
    """One variant's launches (callables of a stream address)."""

    kernels: dict  # kernel name -> its launch for every block, in block order
    block: list  # (kernel name, launch): every block's launches chained as the token graph chains them
    shapes: dict  # dense kernel name -> "(grid x, grid y)xblock smem"

    def chain(self, without: str = "") -> list:
        """The block chain's launches, those of kernel ``without`` left out."""
        return [f for name, f in self.block if name != without]


def _matrix(rng: np.random.Generator, qt: int, rows: int, cols: int) -> Matrix:
    """A random (rows, cols) matrix stored as ``gpu_dense.Matrix`` keeps type ``qt``."""
    if qt == Q.Q8_0:
        q = rng.integers(-127, 128, (rows, cols), dtype=np.int8).view(np.uint8)
        d = (rng.uniform(0.5, 1.5, (rows, cols // 32)) / (64 * np.sqrt(cols))).astype(np.float16)
        return Matrix(qt, rows, cols, cp.asarray(q), cp.asarray(d.view(np.uint16)))
    v = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
    if qt == Q.F16:
        v = v.astype(np.float16)
    elif qt == Q.BF16:
        v = (v.view(np.uint32) >> 16).astype(np.uint16)
    return Matrix(qt, rows, cols, cp.asarray(np.ascontiguousarray(v).view(np.uint8)), None)


class Rig:
    """``s.blocks`` blocks of random dense weights, KV caches holding ``s.keys`` random keys, and
    one layer of ``s.experts`` random experts, all resident."""

    def __init__(self, s, rng: np.random.Generator):
        self.s = s
        nb, hd, n, k = s.blocks, s.head_dim, s.keys, s.top_k

        def vec(*shape, base=0.0, scale=1.0):
            return cp.asarray((base + scale * rng.standard_normal(shape)).astype(np.float32))

        self.wqkv = [_matrix(rng, s.dense_qtype, s.q_dim + 2 * s.kv_dim, s.hidden) for _ in range(nb)]
        self.wo = [_matrix(rng, s.dense_qtype, s.hidden, s.q_dim) for _ in range(nb)]
        self.router = [_matrix(rng, s.router_qtype, s.experts, s.hidden) for _ in range(nb)]
        self.attn_norm = [vec(s.hidden, base=1.0, scale=0.1) for _ in range(nb)]
        self.ffn_norm = [vec(s.hidden, base=1.0, scale=0.1) for _ in range(nb)]
        self.qk_norm = [vec((s.heads + s.kv_heads) * hd, base=1.0, scale=0.1) for _ in range(nb)]
        self.k_cache = [vec(s.kv_heads, n, hd) for _ in range(nb)]
        self.v_cache = [vec(s.kv_heads, n, hd) for _ in range(nb)]
        ang = np.arange(n)[:, None] * (10000.0 ** (-np.arange(hd // 2) * 2.0 / hd))[None]
        self.cos = cp.asarray(np.concatenate([np.cos(ang), np.cos(ang)], 1).astype(np.float32))
        self.sin = cp.asarray(np.concatenate([-np.sin(ang), np.sin(ang)], 1).astype(np.float32))
        self.emb = rng.standard_normal(s.hidden).astype(np.float32)
        self.cur, self.hn, self.out = (cp.zeros((nb, s.hidden), cp.float32) for _ in range(3))
        self.routes = cp.zeros((nb, 2 * k), cp.float32)
        self.h = cp.zeros(k * s.ffn, cp.float32)
        self.halt = cp.full(1, 0x7F7F7F7F, cp.int32)
        rec = np.zeros((nb, 4), np.int64)
        rec[:, 0], rec[:, 1], rec[:, 2] = n - 1, 0, n
        rec[1:, 3] = [int(self.out[b].data.ptr) for b in range(nb - 1)]
        self.rec = cp.asarray(rec)
        self.layer = random_layer(rng, 0, s.experts, s.hidden, s.ffn, s.expert_qtype, exact=False)
        self._gx: dict[str, tuple[GpuExperts, cp.ndarray]] = {}
        self._keep = []  # GpuDense instances whose buffers the plans name

    def _experts(self, variant: str) -> tuple[GpuExperts, int]:
        """A GpuExperts holding every expert in a slot (one per variant: its launches are fixed
        on first use), and the device slot table."""
        if variant not in self._gx:
            s, lx = self.s, self.layer
            cap = Capacity.per_layer(Geometry((s.experts,), s.top_k, (lx.expert_bytes,)), s.experts)
            gx = GpuExperts([lx], cap, scratch_slots=1, pinned=False)
            gx.begin_copies()
            for e in range(s.experts):
                gx.upload(0, e, e)
            gx.wait(gx.copies_event(), "upload")
            table = cp.asarray(np.array([gx.source_ptr(0, e) for e in range(s.experts)], np.uint64))
            self._gx[variant] = (gx, table)
        gx, table = self._gx[variant]
        return gx, int(table.data.ptr)

    def plan(self) -> Plan:
        """The launches of the variant ``MOELAB_DECODE_KERNELS`` names now."""
        s, k = self.s, self.s.top_k
        gd = GpuDense(s.hidden, s.heads, s.kv_heads, s.head_dim, s.experts, k)
        gd.emb.set(self.emb)
        self._keep.append(gd)
        gx, table = self._experts(gd.kernels)
        halt = int(self.halt.data.ptr)
        kernels = {name: [] for name in ("qkv", "qk_rope_kv", "attn_partial", "attn_reduce", "wo", "router",
                                         "gate_up", "down_combine")}
        chain = [("halt", lambda st: cp.cuda.runtime.memsetAsync(halt, _HALT_NONE, 4, st))]
        x, shapes = gd.emb, {}
        for b in range(s.blocks):
            blk = gd.decode_block(x, self.cur[b], self.hn[b], self.wqkv[b], self.attn_norm[b], None, self.qk_norm[b],
                                  1, _EPS, self.cos, self.sin, self.k_cache[b], self.v_cache[b],
                                  1.0 / float(np.sqrt(s.head_dim)), None, self.wo[b], None, 1.0, self.router[b],
                                  self.ffn_norm[b], None, 0, True, 1.0, 0)
            route = int(self.routes[b].data.ptr)
            dense = blk.launches(int(self.rec.data.ptr) + 32 * b, route)
            experts = gx.routed_layer(0, route, table, halt, int(self.hn[b].data.ptr), int(self.h.data.ptr),
                                      int(self.out[b].data.ptr), k)
            for name, f in zip(kernels, list(dense) + list(experts)):
                kernels[name].append(f)
                chain.append((name, f))
            x = self.cur[b]
        for name, p in zip(kernels, dense):
            shapes[name] = f"({p.grid[0]},{p.grid[1]})x{p.block}" + (f" {p.shared}B" if p.shared else "")
        return Plan(kernels, chain, shapes)

    def outputs(self) -> list[np.ndarray]:
        """Every block's residual stream after attention and its expert output (host copies)."""
        cp.cuda.Device().synchronize()
        return [self.cur.get(), self.out.get()]

    def close(self) -> None:
        for gx, _ in self._gx.values():
            gx.close()
        self._gx.clear()
        self._keep.clear()
