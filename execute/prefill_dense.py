"""The dense path of a prefill chunk (T > 1 tokens of a block) on the GPU in few launches
(``prefill_dense.cu``), used by ``execute.model.MoeModel`` in place of its CuPy array expressions:

- RMSNorm: one launch per norm (``pd_rmsnorm``) instead of seven elementwise/reduction kernels;
- projections by F16 matrices: on tensor cores through cuBLAS (``cublasGemmEx``, f16 inputs, f32
  accumulation and output). The activations enter as two f16 halves of each row scaled by a power of
  two (``pf_split`` of ``execute.prefill``: hi = f16(x s), lo = f16(x s - hi), ~22 of float32's 24
  bits), two products summed in f32, then times 1/s (compute capability >= 8.0). Q8_0 and BF16
  matrices of at most 2^24 weights are dequantized per call and split into halves the same way, per
  weight row (q d of Q8_0 has at most 19 significant bits, which its two halves carry but for
  weights below 2^-24 of their row's largest): three products (hi.hi, lo.hi, hi.lo; the lo.lo term
  is below the halves' rounding). F32 matrices (a router) are multiplied as stored (no tile copy);
  larger Q8_0/BF16 matrices keep ``GpuDense.matmul`` (float32 tiles). The tensor cores' float32
  accumulation truncates at each step, so its error grows with K (2.5e-6 relative at K = 2048,
  4.8e-6 at 4096 on the H200, ``experiments/prefill_precision.py``): the f16 products run as
  slices of ``MOELAB_PREFILL_SPLIT_K`` (256) columns of K, one batched cuBLAS call, their partial
  products summed in float32 in slice order (``pd_sum_parts``, with the halves' scales); ``0``:
  one product over all of K;
- routing: the router logits' top-k and weights on the device in float64 (``pd_route``; softmax and
  softmax_topk gating, router bias, norm and scale as ``execute.batch_route.route_rows``), so only
  ids (int32) and weights (float64) cross to the host, in one copy into pinned memory. The ids are
  the host rule's (selection on the same float64 values, ties to the lower id); the weights agree
  with it to float64 rounding (the sums' order differs). Expert groups, selection biases, sigmoid
  gating and forced routes stay on the host; a chunk with a non-finite logit too;
- GQA attention: q/k norm + RoPE + KV append in one launch that writes q in the product's layout
  (``pd_qk_rope_kv``), the scores by one batched float32 cuBLAS product, the scale, causal/sliding
  mask, sinks and softmax in one launch (``pd_softmax``), the values by one batched product (both
  batched products called on cuBLAS directly, ``cublasGemmStridedBatchedEx`` on the cache in place).

Numerics: float32 everywhere but the projections' ~22-bit activation halves and the float64
routing; results agree with the CuPy path to float32 rounding (GPU tests). ``MOELAB_PREFILL_DENSE``
= 0 keeps the CuPy path (for comparison), 1 (the default) takes this one; another value is an error.
"""
from __future__ import annotations


import os

import numpy as np

try:
    import cupy as cp
except ImportError:  # the switch reads without CuPy; ChunkDense needs it
    cp = None

from . import quant as Q
from .experts import ExecutorError
from .xp import env_switch

__all__ = ["ChunkDense", "dense_env", "split_k_env", "warm_library"]

_CUDA_R_32F, _CUDA_R_16F = 0, 2  # cudaDataType
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1
_PTR_HOST = 0  # CUBLAS_POINTER_MODE_HOST: alpha and beta read from host memory
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)
_MAX_SPLIT_WEIGHTS = 1 << 24  # a Q8_0/BF16 matrix split per call: two f16 copies and a float32 tile
_MAX_ROUTE_EXPERTS, _MAX_ROUTE_K = 2048, 64  # pd_route's shared memory and its top arrays


def dense_env() -> bool:
    """``MOELAB_PREFILL_DENSE``: unset or 1 -> True, 0 -> False; another value is an ExecutorError."""
    return env_switch("MOELAB_PREFILL_DENSE")


_SPLIT_K = ("0", "128", "256", "512", "1024")
_MAX_PARTS_BYTES = 1 << 27  # a split product's partial products (float32); wider slices beyond


def split_k_env() -> int:
    """``MOELAB_PREFILL_SPLIT_K``: the K-slice of the chunk's f16 products (unset: 256; 0: one
    product over all of K); another value is an ExecutorError."""
    v = os.environ.get("MOELAB_PREFILL_SPLIT_K", "256").strip()
    if v not in _SPLIT_K:
        raise ExecutorError(f"environment variable MOELAB_PREFILL_SPLIT_K: {v!r}, expected one of {', '.join(_SPLIT_K)}")
    return int(v)


def k_slice(split: int, cols: int, t: int, rows: int) -> int:
    """The K-slice of a (t, cols) x (rows, cols)^T product: ``split`` (halved down to 64 until it
    divides cols), doubled while the partial products pass ``_MAX_PARTS_BYTES``; ``cols`` (one
    product) when ``split`` is 0 or no slice fits."""
    kc = split
    while kc >= 64 and cols % kc:
        kc //= 2
    if kc < 64 or kc >= cols:
        return cols
    while 4 * (cols // kc) * t * rows > _MAX_PARTS_BYTES and cols % (2 * kc) == 0 and 2 * kc < cols:
        kc *= 2
    return kc if 4 * (cols // kc) * t * rows <= _MAX_PARTS_BYTES else cols


def _kernel(name: str):
    from .gpu_host import cuda_module

    return cuda_module("prefill_dense.cu").get_function(name)


def warm_library(info, t: int, cache_len: int) -> None:
    """The library side of a chunk's first run for a GQA model of ``info``'s shapes on ``t`` tokens
    (a KV cache of ``cache_len`` positions), on zeros on a private stream: cuBLAS's products of the
    projections' shapes (f16, in K-slices as :meth:`ChunkDense._gemm_ptr`) and of the router's and attention's
    (float32; batched as :meth:`ChunkDense._bgemm`) and the CuPy element-wise kernels around them,
    so that their first uses (cuBLAS's set-up, kernel loads) are paid on the thread that calls this,
    e.g. while the main thread loads weights (``execute.first_token.GpuInit``). Nothing is kept; the
    results are discarded. The chunk path's own kernels (``prefill_dense.cu``) are not touched."""
    nh, nkv, hd, hidden = int(info.num_heads), max(int(info.num_kv_heads), 1), int(info.head_dim), int(info.hidden)
    t = max(int(t), 2)
    n = max(int(cache_len), t)
    experts = max(max(info.num_experts), 1)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        split = split_k_env()
        for rows, cols in ((nh * hd + 2 * nkv * hd, hidden), (hidden, nh * hd)):
            w, a = cp.zeros((rows, cols), cp.float16), cp.zeros((t, cols), cp.float16)
            kc = k_slice(split, cols, t, rows)
            y = cp.empty((cols // kc, t, rows), cp.float32)
            for beta in (_ZERO, _ONE):
                ChunkDense._gemm_ptr(w.data.ptr, rows, cols, a.data.ptr, t, y.data.ptr, beta, kc)
        x = cp.zeros((t, hidden), cp.float32)
        # the array first: CuPy's operator, not numpy's dispatch to __array_ufunc__
        x = x + (x @ cp.zeros((experts, hidden), cp.float32).T)[:, :1] * np.float32(1.0)
        g = max(nh // nkv, 1)
        q = cp.zeros((nkv, t, g, hd), cp.float32)
        kc = cp.zeros((nkv, n, hd), cp.float32)  # the cache's layout: the first t of n positions
        sc = cp.empty((nkv, t * g, t), cp.float32)
        ChunkDense._bgemm(_OP_T, t, t * g, hd, kc.data.ptr, hd, n * hd, q.data.ptr, hd, t * g * hd, sc.data.ptr, t,
                          t * g * t, nkv)
        o = cp.empty((nkv, t, g, hd), cp.float32)
        ChunkDense._bgemm(_OP_N, hd, t * g, t, kc.data.ptr, hd, n * hd, sc.data.ptr, t, t * g * t, o.data.ptr, hd,
                          t * g * hd, nkv)
        o = o.transpose(1, 0, 2, 3).reshape(t, nh * hd)
        _f32c(o.astype(cp.float64))
    s.synchronize()
    cp.get_default_memory_pool().free_all_blocks(stream=s)


def _f32c(a):
    return a if a.dtype == cp.float32 and a.flags.c_contiguous else cp.ascontiguousarray(a, cp.float32)


class ChunkDense:
    """Launches of the chunk's dense path (module docstring); every call runs on the current stream."""

    def __init__(self):
        self._rms = _kernel("pd_rmsnorm")
        self._scale = _kernel("pd_scale_rows")
        self._scale2 = _kernel("pd_scale_rows_cols")
        self._route = _kernel("pd_route")
        self._qk = _kernel("pd_qk_rope_kv")
        self._softmax = _kernel("pd_softmax")
        self._sum_parts = _kernel("pd_sum_parts")
        self.split_k = split_k_env()
        self._split = None  # pf_split shares its module with mma.sync kernels (compute capability 8.0)
        if int(cp.cuda.Device().compute_capability) >= 80:
            from .prefill import _kernel as pf_kernel

            self._split = pf_kernel("pf_split")
        from .gpu_host import Launch

        # the frequent launches by address (cuLaunchKernel; no per-argument conversion)
        self._l_rms, self._l_scale = Launch(self._rms, 6), Launch(self._scale, 4)
        self._l_split = Launch(self._split, 6) if self._split is not None else None
        self._work: dict[tuple[str, int], cp.ndarray] = {}  # (name, stream): the activation halves, reused
        self._pinned, self._pinned_size = None, 0
        self._route_buf = None
        self._done = cp.cuda.Event(disable_timing=True)

    # RMSNorm ---------------------------------------------------------------------------------------
    def rms(self, x, w, eps: float):
        """``x * (1 / sqrt(mean(x^2, -1) + eps)) * w`` with ``w`` broadcast over x's leading dims
        (``w.shape`` a suffix of ``x.shape``), float32; None when the shapes do not fit."""
        if w is None or x.ndim < w.ndim or x.shape[x.ndim - w.ndim:] != w.shape or x.size == 0:
            return None
        cols = int(x.shape[-1])
        x, w = _f32c(x), _f32c(w)
        out = cp.empty(x.shape, cp.float32)
        rows = x.size // cols
        self._l_rms((rows, 1), min(256, 32 * -(-cols // 32)), cp.cuda.get_current_stream().ptr, x.data.ptr,
                    w.data.ptr, w.size // cols, cols, self._l_rms.f32(eps), out.data.ptr)
        return out

    # projections -------------------------------------------------------------------------------------
    def _halves(self, v):
        """(hi, lo, 1/s) of the rows of ``v`` (rows, cols) float32 (``pf_split``)."""
        r, c = (int(n) for n in v.shape)
        hi, lo = cp.empty((r, c), cp.uint16), cp.empty((r, c), cp.uint16)
        inv = cp.empty(r, cp.float32)
        self._split((r,), (256,), (v, np.uint64(0), np.int32(c), hi, lo, inv))
        return hi, lo, inv

    def _work_buf(self, name: str, n: int, dtype, stream: int) -> int:
        """The address of a work buffer of at least ``n`` elements for ``stream`` (kept and reused in
        that stream's order; grown when short)."""
        a = self._work.get((name, stream))
        if a is None or a.size < n:
            a = self._work[name, stream] = cp.empty(max(n, 2 * (0 if a is None else a.size)), dtype)
        return int(a.data.ptr)

    def matmul(self, x, m, gd=None):
        """``x (T, cols)`` times Matrix ``m`` transposed -> ``(T, rows)`` float32, or None where the
        caller's path stays (module docstring): F16 on tensor cores with the activation halves; Q8_0
        and BF16 (with ``gd``, a GpuDense, and at most 2^24 weights) the same with the weights
        dequantized once per call and split into halves too (per row by a power of two), three
        products (hi hi, lo hi, hi lo); F32 as stored."""
        if m.qt == Q.F32:
            return _f32c(x) @ m.w.view(cp.float32).reshape(m.rows, m.cols).T
        if self._split is None or not (m.qt == Q.F16 or (m.qt in (Q.Q8_0, Q.BF16) and gd is not None
                                                         and m.rows * m.cols <= _MAX_SPLIT_WEIGHTS)):
            return None
        x = _f32c(x)
        t, n, c = int(x.shape[0]), m.rows, m.cols
        y = cp.empty((t, n), cp.float32)
        grid = (min(-(-y.size // 256), 4096),)
        sp = cp.cuda.get_current_stream().ptr
        kc = k_slice(self.split_k, c, t, n)
        part = y.data.ptr if kc == c else self._work_buf("part", (c // kc) * t * n, cp.float32, sp)
        if m.qt == Q.F16:  # the halves in work buffers of this stream, by address
            hi, lo = self._work_buf("hi", t * c, cp.uint16, sp), self._work_buf("lo", t * c, cp.uint16, sp)
            inv = self._work_buf("inv", t, cp.float32, sp)
            self._l_split((t, 1), 256, sp, x.data.ptr, 0, c, hi, lo, inv)
            self._gemm_ptr(m.w.data.ptr, n, c, hi, t, part, _ZERO, kc)
            self._gemm_ptr(m.w.data.ptr, n, c, lo, t, part, _ONE, kc)
            if kc == c:
                self._l_scale((grid[0], 1), 256, sp, y.data.ptr, inv, y.size, n)
            else:
                self._sum_parts(grid, (256,), (np.uint64(part), np.int32(c // kc), np.int64(y.size), np.int32(n),
                                               np.uint64(inv), np.uint64(0), y))
            return y
        xh, xl, xi = self._halves(x)
        tile = cp.empty((m.rows, m.cols), cp.float32)
        gd.dequant(m, 0, m.rows, tile)
        wh, wl, wi = self._halves(tile)
        del tile
        for w_, a_, beta in ((wh, xh, _ZERO), (wh, xl, _ONE), (wl, xh, _ONE)):
            self._gemm_ptr(w_.data.ptr, n, c, a_.data.ptr, t, part, beta, kc)
        if kc == c:
            self._scale2(grid, (256,), (y, xi, wi, np.int64(y.size), np.int32(n)))
        else:
            self._sum_parts(grid, (256,), (np.uint64(part), np.int32(c // kc), np.int64(y.size), np.int32(n), xi, wi, y))
        return y

    @staticmethod
    def _gemm_ptr(w: int, rows: int, cols: int, a: int, t: int, y: int, beta: np.ndarray, kc: int = 0) -> None:
        """y (t, rows) = a (t, cols) f16 . w (rows, cols) f16 transposed + beta y, f32 accumulation (device
        addresses); with ``kc`` < cols, K in slices of kc: y holds cols / kc partial products
        (t, rows), one after another (one batched call)."""
        from cupy_backends.cuda.libs import cublas

        kc = kc or cols
        h = cp.cuda.device.get_cublas_handle()
        cublas.setStream(h, cp.cuda.get_current_stream().ptr)
        mode = cublas.getPointerMode(h)
        if mode != _PTR_HOST:
            cublas.setPointerMode(h, _PTR_HOST)
        try:  # column-major: y^T (rows, t) = m (cols, rows)^T . a^T (cols, t), per slice of cols
            if kc == cols:
                cublas.gemmEx(h, _OP_T, _OP_N, rows, t, cols, _ONE.ctypes.data, w, _CUDA_R_16F, cols,
                              a, _CUDA_R_16F, cols, beta.ctypes.data, y, _CUDA_R_32F, rows, _COMPUTE_32F, _GEMM_DEFAULT)
            else:
                cublas.gemmStridedBatchedEx(h, _OP_T, _OP_N, rows, t, kc, _ONE.ctypes.data, w, _CUDA_R_16F, cols, kc,
                                            a, _CUDA_R_16F, cols, kc, beta.ctypes.data, y, _CUDA_R_32F, rows, t * rows,
                                            cols // kc, _COMPUTE_32F, _GEMM_DEFAULT)
        finally:
            if mode != _PTR_HOST:
                cublas.setPointerMode(h, mode)

    @staticmethod
    def _bgemm(op_a: int, m: int, n: int, k: int, a: int, lda: int, stride_a: int, b: int, ldb: int, stride_b: int,
               c: int, ldc: int, stride_c: int, batch: int) -> None:
        """``batch`` float32 products in cuBLAS's column-major terms, C (m, n) = op_a(A) B (B not
        transposed; addresses and strides in elements of 4 bytes): row-major ``c[i] = b[i] . a[i]^T``
        (op T) or ``b[i] . a[i]`` (op N), as CuPy's batched matmul, without its dispatch."""
        from cupy_backends.cuda.libs import cublas

        h = cp.cuda.device.get_cublas_handle()
        cublas.setStream(h, cp.cuda.get_current_stream().ptr)
        mode = cublas.getPointerMode(h)
        if mode != _PTR_HOST:
            cublas.setPointerMode(h, _PTR_HOST)
        try:
            cublas.gemmStridedBatchedEx(h, op_a, _OP_N, m, n, k, _ONE.ctypes.data, a, _CUDA_R_32F, lda, stride_a,
                                        b, _CUDA_R_32F, ldb, stride_b, _ZERO.ctypes.data, c, _CUDA_R_32F, ldc,
                                        stride_c, batch, _COMPUTE_32F, _GEMM_DEFAULT)
        finally:
            if mode != _PTR_HOST:
                cublas.setPointerMode(h, mode)

    # routing ---------------------------------------------------------------------------------------
    @staticmethod
    def routes(info, exp_probs_b) -> bool:
        """Whether :meth:`route` takes this model's routing (module docstring)."""
        return (info.expert_groups <= 1 and info.gating in ("softmax", "softmax_topk") and exp_probs_b is None
                and 1 <= info.top_k <= _MAX_ROUTE_K)

    def route_to(self, logits, bias, info, ids, wts, bad) -> bool:
        """Launch ``pd_route`` on router ``logits`` ``(T, E)`` (device float32) plus ``bias`` (device
        float32 or None) into device memory at ``ids`` (T k int32), ``wts`` (T k float64) and ``bad``
        (an int32 set to 1 on a non-finite logit; the caller zeroes it): no copy, no wait. False (and
        nothing launched) when the kernel does not take E or k."""
        t, e = (int(v) for v in logits.shape)
        k = int(info.top_k)
        if e > _MAX_ROUTE_EXPERTS or k > e:
            return False
        self._route((t,), (128,), (_f32c(logits), bias if bias is not None else np.uint64(0), np.int32(e), np.int32(k),
                                   np.int32(0 if info.gating == "softmax" else 1), np.int32(bool(info.norm_topk)),
                                   np.float64(info.expert_weights_scale or 0.0), np.uint64(ids), np.uint64(wts),
                                   np.uint64(bad)),
                    shared_mem=8 * e + 8 * 32 + 4 * 32)
        return True

    def route(self, logits, bias, info):
        """Ids ``(T, k)`` int64 and weights ``(T, k)`` float64 of router ``logits`` ``(T, E)`` (device,
        float32) plus ``bias`` (device float32 or None), after one copy to pinned memory and one wait;
        None when a logit is not finite (the caller routes on the host)."""
        t = int(logits.shape[0])
        k = int(info.top_k)
        wb, ib = 8 * t * k, 4 * t * k  # weights (float64) first: 8-byte aligned
        nbytes = wb + ib + 4
        if self._route_buf is None or self._route_buf.size < nbytes:  # reused: each call waits for its copy
            self._route_buf = cp.empty(max(nbytes, 1 << 16), cp.uint8)
        buf = self._route_buf[:nbytes]
        ptr = buf.data.ptr
        cp.cuda.runtime.memsetAsync(ptr + wb + ib, 0, 4, cp.cuda.get_current_stream().ptr)
        if not self.route_to(logits, bias, info, ptr + wb, ptr, ptr + wb + ib):
            return None
        if self._pinned_size < nbytes:
            self._pinned_size = max(nbytes, 1 << 16)
            self._pinned = cp.cuda.alloc_pinned_memory(self._pinned_size)
        host = np.frombuffer(self._pinned, np.uint8, nbytes)
        s = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(self._pinned.ptr, ptr, nbytes, cp.cuda.runtime.memcpyDeviceToHost, s.ptr)
        self._done.record(s)
        self._done.synchronize()
        if host[wb + ib:].view(np.int32)[0]:
            return None
        w = host[:wb].view(np.float64).reshape(t, k).copy()
        ids_h = host[wb:wb + ib].view(np.int32).reshape(t, k).astype(np.int64)
        return ids_h, w

    # attention -------------------------------------------------------------------------------------
    def attention(self, model, l: int, x):
        """GQA attention of block ``l`` for ``x (T, hidden)`` at ``model.pos`` as ``MoeModel._attention``
        computes it (KV cache written); None when this path does not take the model (MLA, head_dim
        odd or over 1024, a q/k norm without the fused weight) or the chunk (over 65535 tokens)."""
        w, t = model.layers[l], int(x.shape[0])
        if not self.takes_attention(model, l, t):
            return None
        qkv = model._proj(x, w["wqkv"])  # (T, q + 2 kv)
        if w["bqkv"] is not None:
            qkv = qkv + w["bqkv"]
        o = self.attend(model, l, self.qk_rope_kv(model, l, qkv), t)
        y = model._proj(o, w["wo"])
        return y if w["bo"] is None else y + w["bo"]

    @staticmethod
    def takes_attention(model, l: int, t: int) -> bool:
        """Whether :meth:`attention` takes block ``l`` of ``model`` for a chunk of ``t`` tokens."""
        info, w = model.info, model.layers[l]
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        mode = {"none": 0, "head": 1, "full": 2}.get(model.spec.qk_norm)
        return not (model.mla or mode is None or hd % 2 or hd > 1024 or nkv < 1 or nh % nkv or t > 65535
                    or (mode and w.get("qk_weight") is None))

    def qk_rope_kv(self, model, l: int, qkv):
        """q/k norm + RoPE of ``qkv (T, q + 2 kv)`` at ``model.pos``, k and v appended to block ``l``'s
        cache; -> q ``(kv_heads, T, group, head_dim)`` float32 (``pd_qk_rope_kv``)."""
        info, w, pos = model.info, model.layers[l], model.pos
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        mode = {"none": 0, "head": 1, "full": 2}[model.spec.qk_norm]
        qkv = _f32c(qkv)
        t, g = int(qkv.shape[0]), nh // nkv
        kc, vc = model.k_cache[l], model.v_cache[l]
        q = cp.empty((nkv, t, g, hd), cp.float32)
        self._qk((nh + 2 * nkv, t), (32 * -(-hd // 32),),
                 (qkv, np.int32(t), np.int32(nh), np.int32(nkv), np.int32(hd),
                  w["qk_weight"] if mode else np.uint64(0), np.int32(mode), np.float32(info.rms_eps),
                  model.rope_cos, model.rope_sin, np.int32(pos), q, kc, vc, np.int32(int(kc.shape[1]))))
        return q

    def attend(self, model, l: int, q, t: int):
        """Softmax attention of ``q (kv_heads, T, group, head_dim)`` (float32, contiguous) at
        ``model.pos`` over block ``l``'s cached keys and values up to ``pos + T``; -> ``(T, heads
        head_dim)`` float32: scores by one batched float32 product, ``pd_softmax``, values by another."""
        info, w, pos = model.info, model.layers[l], model.pos
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        g = nh // nkv
        kc, vc = model.k_cache[l], model.v_cache[l]
        n = int(kc.shape[1])
        swa = info.is_swa(l)
        lo = max(0, pos + 1 - info.sliding_window) if swa else 0
        nk = pos + t - lo
        s = cp.empty((nkv, t * g, nk), cp.float32)  # (kv, T g, keys) = q . keys^T per kv head
        self._bgemm(_OP_T, nk, t * g, hd, kc.data.ptr + 4 * lo * hd, hd, n * hd, q.data.ptr, hd, t * g * hd,
                    s.data.ptr, nk, t * g * nk, nkv)
        sinks = w["sinks"]
        self._softmax((nkv * t * g,), (128,),
                      (s, np.int32(t), np.int32(g), np.int32(pos + t - lo), np.int32(lo), np.int32(pos),
                       np.int32(info.sliding_window if swa else 0), np.float32(model.kq_scale),
                       _f32c(sinks) if sinks is not None else np.uint64(0)))
        o = cp.empty((nkv, t, g, hd), cp.float32)  # (kv, T g, hd) = s . values per kv head
        self._bgemm(_OP_N, hd, t * g, nk, vc.data.ptr + 4 * lo * hd, hd, n * hd, s.data.ptr, nk, t * g * nk,
                    o.data.ptr, hd, t * g * hd, nkv)
        return o.transpose(1, 0, 2, 3).reshape(t, nh * hd)
