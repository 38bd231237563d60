"""The GPU dense path's weights and kernels (``dense_kernels.cu``): matrices in their stored type and
the fused launches of one decode token of a GQA block.

Matrices (:class:`Matrix`) live on the device as the file stores them, not expanded to float32:
F32, F16 and BF16 rows as they are; Q8_0 split at load into int8 quants ``(rows, cols)`` and one
float16 scale per 32 weights ``(rows, cols / 32)`` (the same bytes, 16-byte aligned rows); any other
type is converted to F16 from the loader's float32 values. A matrix whose row length is not a
multiple of 32, or longer than :data:`MAX_COLS`, is not made (the caller keeps float32).

Kernels for one token (T = 1): the GEMV (warp per row, 16-byte loads, optional fused
``x + s * add`` and RMSNorm prologue, bias / residual epilogue), q/k norm + RoPE + KV append,
decode attention (split over the keys, then a merge) and the router (GEMV and top-k in one
launch, then one asynchronous copy of ids and weights into pinned memory and one event wait).
:meth:`GpuDense.decode_block` prepares a block's launches once (:class:`DecodeBlock`: only the
position, the key range and the expert-output pointer change per token); :meth:`GpuDense.gemv`,
:meth:`~GpuDense.qk_rope_kv`, :meth:`~GpuDense.attention` and :meth:`~GpuDense.route` launch the
same kernels one call at a time. A chunk (T > 1) multiplies by float32 tiles dequantized per
product (:meth:`GpuDense.matmul`), so its numerics are the float32 path's.

CUDA graphs (:meth:`GpuDense.capture`): a block's token (attention, router, the copy of the top-k
to pinned memory) captured once as one graph and replayed per token. What changes per token is
written by the host into the block's decode record in pinned memory (position, first key, number
of keys, expert-output address); the graph's first node copies it to the device, where the kernels
read it (``dense_kernels.cu``). The host writes a record only after waiting for the block's
previous replay (its route event), so a replay never sees a half-written one. The attention's grid
is the one of the longest key range the cache holds; blocks past the token's keys exit at once,
and the merge reads only the partials written, so a replay computes the same values in the same
order as the plain launches (bit-identical results).

Everything runs on the caller's current CuPy stream, in order; the only host wait is the router's
event.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import cupy as cp
import numpy as np

from . import quant as Q
from .gpu_host import cuda_module
from .kernel_variants import decode_kernels_env, kernel_name, programmatic
from .pdl_launch import launch_programmatic

__all__ = ["GpuDense", "DecodeBlock", "Matrix", "device_matrix", "stack_matrices", "MAX_COLS", "KEPT_QTYPES"]

_WARPS = 8  # warps per block of the GEMV kernels (one output row each)
_V4_WARPS = 4  # warps per block of dense_gemv_v4 (MOELAB_DECODE_KERNELS=v4; 2 rows per warp up to 4 KB rows)
_CHUNK = 64  # keys per block of decode attention (dense_kernels.cu CHUNK)
MAX_COLS = 11776  # a GEMV stages its input (cols float32) in shared memory, under the 48 KiB default
KEPT_QTYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
_TILE_FLOATS = 1 << 24  # float32 scratch of a chunk's dequantized tile (64 MiB)
_REC = 4  # a decode record: position, first key, number of keys, expert-output address (int64)
_rt = cp.cuda.runtime


def _function(name: str):
    return cuda_module("dense_kernels.cu", "dense_kernels_v2.cu", "dense_kernels_v4.cu").get_function(name)  # v1's helpers


def _launch(func: int, grid: tuple[int, int], block: int, shared: int, stream: int, params: int,
            programmatic: bool) -> None:
    if programmatic:
        launch_programmatic(func, grid, block, shared, stream, params)
    else:
        cp.cuda.driver.launchKernel(func, grid[0], grid[1], 1, block, 1, 1, shared, stream, params, 0)


class _Kernel:
    """A kernel launched through ``cuLaunchKernel`` with a reusable argument block: every argument
    a Python int in its own 64-bit slot (pointers as addresses, 0 for null; ``int`` parameters
    read the low 32 bits, so they must be >= 0; ``float`` parameters take :func:`f32` bits).
    ``programmatic``: launched with programmatic dependent launch instead (the kernel must wait for
    its inputs itself: ``execute.pdl_launch``)."""

    def __init__(self, name: str, nargs: int, programmatic: bool = False):
        self.func = _function(name).kernel.ptr
        self.nargs = nargs
        self.programmatic = programmatic
        self._vals = np.zeros(nargs, np.uint64)
        self._params = np.array([self._vals.ctypes.data + 8 * i for i in range(nargs)], np.uint64)
        self._ptr = int(self._params.ctypes.data)

    def __call__(self, grid: tuple[int, int], block: int, shared: int, stream: int, *args: int) -> None:
        if len(args) != self.nargs:
            raise ValueError(f"kernel launch: {len(args)} arguments, expected {self.nargs}")
        self._vals[:] = args
        _launch(self.func, grid, block, shared, stream, self._ptr, self.programmatic)


class _Prepared:
    """One launch whose argument block is kept: set once, a few slots changed per call."""

    def __init__(self, kernel: _Kernel, grid: tuple[int, int], block: int, shared: int, args):
        if len(args) != kernel.nargs:
            raise ValueError(f"kernel launch: {len(args)} arguments, expected {kernel.nargs}")
        self.kernel = kernel
        self.func, self.grid, self.block, self.shared = kernel.func, grid, block, shared
        self.vals = np.array(args, np.uint64)
        self._params = np.array([self.vals.ctypes.data + 8 * i for i in range(len(args))], np.uint64)
        self.ptr = int(self._params.ctypes.data)

    def __call__(self, stream: int, grid_y: int = 0) -> None:
        _launch(self.func, (self.grid[0], grid_y or self.grid[1]), self.block, self.shared, stream, self.ptr,
                self.kernel.programmatic)

    def variant(self, slots: dict[int, int], grid_y: int = 0) -> "_Prepared":
        """A copy with the argument ``slots`` (index -> value) replaced, and the grid's y when given."""
        args = self.vals.tolist()
        for i, v in slots.items():
            args[i] = v
        return _Prepared(self.kernel, (self.grid[0], grid_y or self.grid[1]), self.block, self.shared, args)


class DecodeBlock:
    """The prepared launches of one block for one token (see :meth:`GpuDense.decode_block`):
    :meth:`attend` (RMSNorm + QKV, q/k norm + RoPE + KV append, attention, output projection +
    residual) and :meth:`route` (router GEMV + top-k, the copy to the host, the wait); :meth:`run`
    does both, by replaying the block's CUDA graph once :meth:`GpuDense.capture` has made it
    (``graph`` not None). Only the expert-output pointer, the position and the key range change
    between calls."""

    def __init__(self, gd: "GpuDense", cur, qkv, qk, part, reduce, wo, router, max_splits: int):
        self.gd, self.cur = gd, cur  # cur: the block's residual stream after attention
        self.qkv, self.qk, self.part, self.reduce, self.wo, self.router = qkv, qk, part, reduce, wo, router
        self._rec_mem = cp.cuda.alloc_pinned_memory(8 * _REC)
        self.rec = np.frombuffer(self._rec_mem, np.int64, _REC)  # the host's decode record
        self.rec_dev = cp.zeros(_REC, cp.int64)  # the graph's copy of it
        r = int(self.rec_dev.data.ptr)
        self.max_splits = max_splits
        self._graphed = self.launches(r)
        self.graph = None
        self._exec = 0

    def launches(self, rec: int, route: int = 0) -> tuple:
        """The block's launches reading decode record ``rec`` (a device address) instead of their
        plain arguments, as a graph replays them; with ``route``, the router writes its ids and
        weights there (``2 * top_k`` floats) instead of the shared buffer."""
        ms = self.max_splits
        router = self.router if not route else self.router.variant({16: route})
        return (self.qkv.variant({16: rec}), self.qk.variant({14: rec}), self.part.variant({11: rec}, ms),
                self.reduce.variant({3: ms, 6: rec}), self.wo, router)

    def attend(self, stream: int, add_ptr: int, pos: int, lo: int, n_keys: int) -> None:
        """``add_ptr``: the previous block's expert output (0 for the first block)."""
        self.qkv.vals[6] = add_ptr
        self.qkv(stream)
        self.qk.vals[9] = pos
        self.qk(stream)
        splits = -(-n_keys // _CHUNK)
        self.part.vals[7], self.part.vals[8] = lo, n_keys
        self.part(stream, splits)
        self.reduce.vals[3] = splits
        self.reduce(stream)
        self.wo(stream)

    def route(self, stream: int) -> tuple[np.ndarray, np.ndarray]:
        self.router(stream)
        return self.gd.fetch_route(stream)

    def issue(self, stream: int, add_ptr: int, pos: int, lo: int, n_keys: int) -> None:
        """Queue the block's token (:meth:`attend`, the router, the top-k's copy to pinned memory):
        the decode record written and one graph launch when captured. The record may be rewritten
        only once the previous replay has finished (its route waited for) or with the same values."""
        if self._exec == 0:
            self.attend(stream, add_ptr, pos, lo, n_keys)
            self.router(stream)
            self.gd.copy_route(stream)
            return
        r = self.rec
        r[0], r[1], r[2], r[3] = pos, lo, n_keys, add_ptr
        _rt.graphLaunch(self._exec, stream)

    def run(self, stream: int, add_ptr: int, pos: int, lo: int, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`issue`, then wait for the route: ids ``(1, k)`` int64 and weights ``(1, k)`` float32."""
        self.issue(stream, add_ptr, pos, lo, n_keys)
        return self.gd.wait_route(stream)

    def record(self, stream: int) -> None:
        """Issue the graph's work on ``stream`` (a capturing one): the record's copy, the launches
        reading it, the top-k's copy to pinned memory."""
        _rt.memcpyAsync(self.rec_dev.data.ptr, self._rec_mem.ptr, 8 * _REC, _rt.memcpyHostToDevice, stream)
        for launch in self._graphed:
            launch(stream)
        self.gd.copy_route(stream)

    def set_graph(self, graph) -> None:
        """Replay ``graph`` (CuPy's, from :meth:`record`'s capture) from now on; None: the plain launches."""
        ge = 0 if graph is None else int(getattr(graph, "graphExec", 0) or 0)
        if graph is not None and ge == 0:
            raise RuntimeError("this CuPy's Graph does not expose graphExec")
        self.graph, self._exec = graph, ge


def _end_quietly(stream) -> None:
    """End a capture that failed (its graph, and any error ending it, are dropped)."""
    try:
        stream.end_capture()
    except Exception:  # noqa: BLE001 - the capture's own error is the one raised
        pass


def f32(x: float) -> int:
    """The bits of ``x`` as a float32, for a ``float`` kernel parameter."""
    return int(np.float32(x).view(np.uint32))


def _ptr(a) -> int:
    return 0 if a is None else int(a.data.ptr)


class Matrix(NamedTuple):
    """A ``(rows, cols)`` matrix on the device in its stored type ``qt`` (see the module docstring):
    ``w`` the rows (uint8), ``d`` the Q8_0 scales (uint16, else None)."""

    qt: int
    rows: int
    cols: int
    w: cp.ndarray
    d: cp.ndarray | None

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes) + (0 if self.d is None else int(self.d.nbytes))


def _convertible(cols: int) -> bool:
    return cols % 32 == 0 and cols <= MAX_COLS


def device_matrix(stored: tuple[np.ndarray, int] | None, values: np.ndarray, perm: np.ndarray | None = None) -> Matrix | None:
    """``values`` ``(rows, cols)`` (the loader's float32) on the device in its stored type
    (``stored``: rows as uint8 and qtype, or None), rows reordered by ``perm``; None when the
    row length does not suit the kernels."""
    return stack_matrices([(stored, values, perm)])


def stack_matrices(parts, staged=None) -> Matrix | None:
    """Matrices ``(stored, values, perm)`` stacked by rows into one (as ``device_matrix``); when
    their stored types differ, or one is not kept, all of them go to F16. With ``staged`` (an
    ``execute.gpu_upload.Staged`` on the current stream) stored rows are copied straight into
    their place on the device and a Q8_0 matrix is split there: the same bytes, no host copy but
    a permutation's gather."""
    cols = {int(v.shape[1]) for _, v, _ in parts}
    if len(cols) != 1 or not _convertible(next(iter(cols))):
        return None
    (c,) = cols
    qts = {None if s is None else s[1] for s, _, _ in parts}
    raws = []
    if len(qts) == 1 and next(iter(qts)) in KEPT_QTYPES:
        qt = next(iter(qts))
        for (raw, _), v, p in parts:
            raws.append(raw if p is None or _identity(p, raw.shape[0]) else raw[p])
        if staged is not None:
            return _staged_matrix(qt, raws, c, staged)
        raw = np.concatenate(raws) if len(raws) > 1 else np.ascontiguousarray(raws[0])
    else:
        qt = Q.F16
        vals = [v if p is None else v[p] for _, v, p in parts]
        raw = np.ascontiguousarray(np.concatenate(vals).astype(np.float16)).view(np.uint8)
    rows = raw.shape[0]
    if qt == Q.Q8_0:  # blocks of f16 d | 32 int8 -> quants (rows, cols) and scales (rows, cols / 32)
        blk = raw.reshape(rows, c // 32, 34)
        d = cp.asarray(np.ascontiguousarray(blk[:, :, :2]).view(np.uint16).reshape(rows, c // 32))
        w = cp.asarray(np.ascontiguousarray(blk[:, :, 2:]).reshape(rows, c))
        return Matrix(qt, rows, c, w, d)
    return Matrix(qt, rows, c, cp.asarray(np.ascontiguousarray(raw)), None)


def _identity(perm, rows: int) -> bool:
    perm = np.asarray(perm)
    return perm.shape == (rows,) and bool((perm == np.arange(rows)).all())


def _staged_matrix(qt: int, raws: list[np.ndarray], c: int, staged) -> Matrix:
    """Stored rows ``raws`` (uint8 ``(rows_i, row_bytes)`` each) stacked on the device through
    ``staged``; Q8_0 split into quants and scales by two device copies on the current stream."""
    rows, rb = sum(int(r.shape[0]) for r in raws), int(raws[0].shape[1])
    raw = cp.empty((rows, rb), cp.uint8)
    r0 = 0
    for r in raws:
        staged.put(raw.data.ptr + r0 * rb, r)
        r0 += int(r.shape[0])
    if qt != Q.Q8_0:
        return Matrix(qt, rows, c, raw, None)
    blk = raw.reshape(rows, c // 32, 34)
    d = cp.ascontiguousarray(blk[:, :, :2]).view(cp.uint16).reshape(rows, c // 32)
    return Matrix(qt, rows, c, cp.ascontiguousarray(blk[:, :, 2:]).reshape(rows, c), d)


class GpuDense:
    """Kernels and work buffers of the dense path for one model geometry.

    ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``experts`` (router rows) and ``top_k`` (at
    most 32) size the buffers; one instance serves every block (they run one after another)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int):
        if not 1 <= top_k <= 32:
            raise ValueError(f"GpuDense top_k: {top_k}, expected 1..32 (the router kernel's limit)")
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.top_k = top_k
        v = self.kernels = decode_kernels_env()  # v1, v2 or v3: see execute.kernel_variants
        pdl = programmatic(v)  # only kernels that wait for their inputs themselves (the v2 ones)
        self._gemv = _Kernel(kernel_name("dense_gemv", v), 17, pdl)
        self._router = _Kernel(kernel_name("router_topk", v), 17, pdl)
        self._qk = _Kernel(kernel_name("qk_rope_kv", v), 15, pdl)
        self._part = _Kernel(kernel_name("attn_partial", v), 12, pdl)
        self._reduce = _Kernel(kernel_name("attn_reduce", v), 7, pdl)
        self._dequant = _Kernel("dequant_rows", 7)
        qd = heads * head_dim
        self.qkv = cp.empty(qd + 2 * kv_heads * head_dim, cp.float32)
        self.q = cp.empty(qd, cp.float32)
        self.o = cp.empty(qd, cp.float32)
        self.emb = cp.empty(hidden, cp.float32)  # a token's (scaled) embedding: the first block's residual
        self.x = [cp.empty(hidden, cp.float32) for _ in range(2)]  # residual stream, alternating
        self.hn = [cp.empty(hidden, cp.float32) for _ in range(2)]  # a block's normed MoE input, alternating
        self.logits = cp.empty(max(experts, 1), cp.float32)
        self._part_buf = cp.empty(0, cp.float32)
        self._block_part = cp.empty(0, cp.float32)  # the prepared blocks' attention partials
        self._tile = None
        self._counter = cp.zeros(1, cp.int32)
        self._route_dev = cp.empty(2 * max(top_k, 1), cp.float32)
        self._pinned = cp.cuda.alloc_pinned_memory(8 * max(top_k, 1))
        self._route_host = np.frombuffer(self._pinned, np.float32, 2 * max(top_k, 1))
        self._routed = cp.cuda.Event(disable_timing=True)
        self._capture_stream = None
        self.captures = 0  # calls of capture that made graphs

    def _gemv_shape(self, m: Matrix) -> tuple[tuple[int, int], int]:
        """Grid and block of a GEMV launch: one row per warp of 8; v4: 2 rows per warp of 4 when a
        stored row holds at most 4 KB (a qkv or wo GEMV in one wave of blocks)."""
        if self.kernels != "v4":
            return (-(-m.rows // _WARPS), 1), 32 * _WARPS
        row_bytes = m.cols * {Q.Q8_0: 1, Q.F32: 4}.get(m.qt, 2)
        rpw = 2 if row_bytes <= 4096 else 1
        return (-(-m.rows // (_V4_WARPS * rpw)), 1), 32 * _V4_WARPS

    def _router_grid(self, m: Matrix) -> tuple[int, int]:
        """The router's grid: one row per warp; v4: one row per block."""
        return (m.rows if self.kernels == "v4" else -(-m.rows // _WARPS), 1)

    def decode_block(self, x, x_out, hn, wqkv: Matrix, attn_norm, bqkv, qk_weight, qk_mode: int, eps: float, cos, sin,
                     k_cache, v_cache, kq_scale: float, sinks, wo: Matrix, bo, rs: float, router: Matrix, ffn_norm,
                     router_bias, gating: int, norm_topk: bool, w_scale: float, max_keys: int = 0) -> DecodeBlock:
        """Prepared launches of one block reading its residual input from ``x`` (plus ``rs`` times the
        expert output given to ``attend``, written to ``x_out``, which then is the residual; x_out
        None: no expert output, ``x`` is the residual) and writing the normed MoE input to ``hn``.
        ``max_keys``: the most keys a token attends to (a sliding window; 0: the cache's length),
        which sizes a graph's attention grid. Valid while the caches, RoPE tables and buffers named
        here live."""
        nh, nkv, hd, k = self.heads, self.kv_heads, self.head_dim, self.top_k
        cur = x if x_out is None else x_out
        n = int(k_cache.shape[1])
        max_splits = -(-min(n, max_keys or n) // _CHUNK)
        need = nh * -(-n // _CHUNK) * (hd + 2)
        if self._block_part.size < need:
            self._block_part = cp.empty(need, cp.float32)
        part_buf = self._block_part
        qkv = _Prepared(self._gemv, *self._gemv_shape(wqkv), 4 * wqkv.cols,
                        (_ptr(wqkv.w), _ptr(wqkv.d), wqkv.qt, wqkv.rows, wqkv.cols, _ptr(x), 0, f32(rs), _ptr(x_out),
                         _ptr(attn_norm), f32(eps), 0, _ptr(bqkv), 0, f32(1.0), _ptr(self.qkv), 0))
        qk = _Prepared(self._qk, (nh + 2 * nkv, 1), 32 * -(-hd // 32), 0,
                       (_ptr(self.qkv), nh, nkv, hd, _ptr(qk_weight), qk_mode, f32(eps), _ptr(cos), _ptr(sin), 0,
                        _ptr(self.q), _ptr(k_cache), _ptr(v_cache), n, 0))
        part = _Prepared(self._part, (nh, 1), 128, 0, (_ptr(self.q), _ptr(k_cache), _ptr(v_cache), nh, nkv, hd, n, 0, 1,
                                                       f32(kq_scale), _ptr(part_buf), 0))
        reduce = _Prepared(self._reduce, (nh, 1), hd, 0, (_ptr(part_buf), nh, hd, 1, _ptr(sinks), _ptr(self.o), 0))
        wo_l = _Prepared(self._gemv, *self._gemv_shape(wo), 4 * wo.cols,
                         (_ptr(wo.w), _ptr(wo.d), wo.qt, wo.rows, wo.cols, _ptr(self.o), 0, 0, 0, 0, 0, 0, _ptr(bo),
                          _ptr(cur), f32(rs), _ptr(cur), 0))
        rt = _Prepared(self._router, self._router_grid(router), 32 * _WARPS, 4 * max(router.cols, router.rows),
                       (_ptr(router.w), _ptr(router.d), router.qt, router.rows, router.cols, _ptr(cur), _ptr(ffn_norm),
                        f32(eps), _ptr(hn), _ptr(router_bias), _ptr(self.logits), k, gating, int(norm_topk),
                        f32(w_scale), _ptr(self._counter), _ptr(self._route_dev)))
        return DecodeBlock(self, cur, qkv, qk, part, reduce, wo_l, rt, max_splits)

    def capture(self, blocks: Sequence[DecodeBlock]) -> None:
        """Capture each block's token as a CUDA graph (on a private stream; nothing runs) and have
        :meth:`DecodeBlock.run` replay it. On any error no block keeps a graph and the error is
        raised (the caller runs the plain launches)."""
        if self._capture_stream is None:
            self._capture_stream = cp.cuda.Stream(non_blocking=True)
        cs = self._capture_stream
        try:
            with cs:
                for b in blocks:
                    cs.begin_capture()
                    try:
                        b.record(cs.ptr)
                    except BaseException:
                        _end_quietly(cs)
                        raise
                    b.set_graph(cs.end_capture())
        except BaseException:
            for b in blocks:
                b.set_graph(None)
            raise
        self.captures += 1

    def decode_head(self, x, m: Matrix, norm, eps: float, rs: float, logit_scale: float) -> _Prepared:
        """The head's prepared GEMV: logits = m . rmsnorm(x + rs * add) / logit_scale; the caller sets
        slot 6 (add) and slot 15 (the logits) before each launch."""
        return _Prepared(self._gemv, *self._gemv_shape(m), 4 * m.cols,
                         (_ptr(m.w), _ptr(m.d), m.qt, m.rows, m.cols, _ptr(x), 0, f32(rs), 0, _ptr(norm), f32(eps), 0, 0,
                          0, f32(1.0 / logit_scale), 0, 0))

    def copy_route(self, stream: int) -> None:
        """Queue the copy of the router kernel's ids and weights into pinned memory."""
        _rt.memcpyAsync(self._pinned.ptr, self._route_dev.data.ptr, 8 * self.top_k, _rt.memcpyDeviceToHost, stream)

    def wait_route(self, stream: int) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the work queued on ``stream`` (the copy of :meth:`copy_route` included) and
        return the ids ``(1, k)`` int64 and weights ``(1, k)`` float32 (copies)."""
        k = self.top_k
        _rt.eventRecord(self._routed.ptr, stream)
        self._routed.synchronize()
        h = self._route_host
        return h[:k].view(np.int32).astype(np.int64)[None], h[k:2 * k].copy()[None]

    def fetch_route(self, stream: int) -> tuple[np.ndarray, np.ndarray]:
        """Copy the router kernel's ids and weights to the host and wait for them (copies)."""
        self.copy_route(stream)
        return self.wait_route(stream)

    @staticmethod
    def stream() -> int:
        return cp.cuda.get_current_stream().ptr

    # one token -------------------------------------------------------------------------------------
    def gemv(self, m: Matrix, x, y, *, add=None, add_scale: float = 0.0, x_out=None, norm=None, eps: float = 0.0,
             xn_out=None, bias=None, resid=None, out_scale: float = 1.0) -> None:
        """``y[r] = resid[r] + out_scale * (m[r] . v + bias[r])`` with ``v = x + add_scale * add``
        (written to ``x_out``), RMS-normed by ``norm`` when given (written to ``xn_out``); every
        optional operand may be None. ``resid`` may be ``y``; ``x_out`` must not be ``x``."""
        self._gemv(*self._gemv_shape(m), 4 * m.cols, self.stream(),
                   _ptr(m.w), _ptr(m.d), m.qt, m.rows, m.cols, _ptr(x), _ptr(add), f32(add_scale), _ptr(x_out),
                   _ptr(norm), f32(eps), _ptr(xn_out), _ptr(bias), _ptr(resid), f32(out_scale), _ptr(y), 0)

    def route(self, m: Matrix, x, norm, eps: float, xn_out, bias, gating: int, norm_topk: bool,
              scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Router logits of ``rmsnorm(x) * norm`` (the normed input to ``xn_out``) plus ``bias``, and
        their top-k on the device (``gating`` 0 softmax, 1 softmax_topk; ties: lower id); returns
        host ids ``(1, k)`` int64 and weights ``(1, k)`` float32 (copies) after one event wait."""
        k, s = self.top_k, self.stream()
        self._router(self._router_grid(m), 32 * _WARPS, 4 * max(m.cols, m.rows), s,
                     _ptr(m.w), _ptr(m.d), m.qt, m.rows, m.cols, _ptr(x), _ptr(norm), f32(eps), _ptr(xn_out),
                     _ptr(bias), _ptr(self.logits), k, gating, int(norm_topk), f32(scale), _ptr(self._counter),
                     _ptr(self._route_dev))
        return self.fetch_route(s)

    def qk_rope_kv(self, norm_w, mode: int, eps: float, cos, sin, pos: int, k_cache, v_cache) -> None:
        """From ``qkv``: q/k norm (``mode`` 0 none, 1 per head, 2 over all of q and of k; weights
        ``(heads + kv_heads) * head_dim``), NeoX RoPE at ``pos`` into ``q`` and the K cache, V
        appended to the V cache (caches ``(kv_heads, n, head_dim)``)."""
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        self._qk((nh + 2 * nkv, 1), 32 * -(-hd // 32), 0, self.stream(), _ptr(self.qkv), nh, nkv, hd, _ptr(norm_w), mode, f32(eps),
                 _ptr(cos), _ptr(sin), pos, _ptr(self.q), _ptr(k_cache), _ptr(v_cache), int(k_cache.shape[1]), 0)

    def attention(self, k_cache, v_cache, lo: int, n_keys: int, scale: float, sinks) -> None:
        """``o`` = softmax(q . keys * scale) . values over cache positions ``lo .. lo + n_keys - 1``
        (with each head's sink logit in the denominator when ``sinks`` is given)."""
        nh, hd = self.heads, self.head_dim
        splits = -(-n_keys // _CHUNK)
        need = nh * splits * (hd + 2)
        if self._part_buf.size < need:
            self._part_buf = cp.empty(max(need, 2 * self._part_buf.size), cp.float32)
        s = self.stream()
        self._part((nh, splits), 128, 0, s, _ptr(self.q), _ptr(k_cache), _ptr(v_cache), nh, self.kv_heads, hd,
                   int(k_cache.shape[1]), lo, n_keys, f32(scale), _ptr(self._part_buf), 0)
        self._reduce((nh, 1), hd, 0, s, _ptr(self._part_buf), nh, hd, splits, _ptr(sinks), _ptr(self.o), 0)

    # chunks ---------------------------------------------------------------------------------------
    def dequant(self, m: Matrix, r0: int, rows: int, out) -> None:
        """``out`` (rows, cols) float32 = rows ``r0 .. r0 + rows - 1`` of ``m``."""
        n = rows * m.cols
        self._dequant((min(-(-n // 256), 4096), 1), 256, 0, self.stream(), _ptr(m.w), _ptr(m.d), m.qt, r0, rows,
                      m.cols, _ptr(out))

    def matmul(self, x, m: Matrix):
        """``x (T, cols)`` times ``m`` transposed -> ``(T, rows)`` float32: one token by the GEMV
        kernel, a chunk by float32 tiles of ``m`` dequantized into a reused scratch buffer."""
        x = cp.ascontiguousarray(x, cp.float32)
        t = x.shape[0]
        y = cp.empty((t, m.rows), cp.float32)
        if t == 1:
            self.gemv(m, x, y)
            return y
        if self._tile is None:
            self._tile = cp.empty(_TILE_FLOATS, cp.float32)
        step = max(1, min(m.rows, _TILE_FLOATS // m.cols))
        for r0 in range(0, m.rows, step):
            n = min(step, m.rows - r0)
            tile = self._tile[: n * m.cols].reshape(n, m.cols)
            self.dequant(m, r0, n, tile)
            y[:, r0:r0 + n] = x @ tile.T
        return y
