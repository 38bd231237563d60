"""Dequantize-and-multiply on the GPU for every layout of ``execute.quant`` (``gpu_quant.cu``).

``matmul(w, qtype, rows, cols, x)`` computes ``y = x @ W.T`` for a device matrix ``W`` stored as
GGUF blocks (``rows`` rows of ``quant.row_bytes`` bytes, any alignment) and device inputs ``x``
``(n, cols)`` float32: one warp per row, each lane decoding one weight of each 32-weight chunk
and using it for up to 8 tokens at a time. It covers the types the expert arena's kernels
(``gpu_kernels.cu``) do not read, K, legacy and i-quants alike, as a correct reference path: the
weights are decoded one by one, not at the memory bandwidth the arena's kernels reach. The
i-quants' tables come from ``execute.iq_grids`` (the project's own copy) into constant memory.

The same file holds the expert kernels of layers with such a type (``qmoe_gate_up``,
``qmoe_down``, ``qmoe1_gate_up``, ``qmoe1_down_combine``: :func:`kernel`), launched by
``gpu_experts.GpuExperts`` exactly as it launches ``gpu_kernels.cu``'s ``moe_*`` kernels, so such
experts stay in their stored type in the arena and over PCIe.
"""
from __future__ import annotations

from importlib import resources

import cupy as cp
import numpy as np

from . import iq_grids as G
from . import quant as Q

__all__ = ["GPU_QUANT_QTYPES", "kernel", "matmul"]

GPU_QUANT_QTYPES = tuple(sorted(Q.LAYOUTS))
_MODULE: cp.RawModule | None = None


def _module() -> cp.RawModule:
    """gpu_quant.cu compiled once per process, its tables uploaded."""
    global _MODULE
    if _MODULE is None:
        src = resources.files(__package__).joinpath("gpu_quant.cu").read_text()
        mod = cp.RawModule(code=src, options=("-std=c++14",))
        tables = {"g_iq2xxs": G.grid("IQ2_XXS").astype(np.uint8), "g_iq2xs": G.grid("IQ2_XS").astype(np.uint8),
                  "g_iq2s": G.grid("IQ2_S").astype(np.uint8), "g_iq3xxs": G.grid("IQ3_XXS").astype(np.uint8),
                  "g_iq3s": G.grid("IQ3_S").astype(np.uint8), "g_iq1s": G.grid("IQ1_S").astype(np.int8),
                  "g_ksigns": G.KSIGNS, "g_iq4nl": G.IQ4_NL_VALUES}
        blocks = np.zeros((64, 2), np.int32)  # g_block: (weights, bytes) of a block, by type id
        for t, q in Q.LAYOUTS.items():
            blocks[t] = (q.block_weights, q.block_bytes)
        tables["g_block"] = blocks
        for name, arr in tables.items():  # sizes as declared in gpu_quant.cu
            flat = np.ascontiguousarray(arr).reshape(-1)
            cp.ndarray(flat.shape, flat.dtype, mod.get_global(name)).set(flat)
        _MODULE = mod
    return _MODULE


def kernel(name: str) -> cp.RawKernel:
    """A kernel of gpu_quant.cu (compiled, tables uploaded, on first use)."""
    return _module().get_function(name)


def matmul(w: cp.ndarray, qtype: int, rows: int, cols: int, x: cp.ndarray, out: cp.ndarray | None = None,
           stream: cp.cuda.Stream | None = None) -> cp.ndarray:
    """``x @ W.T``: ``w`` the device bytes of ``rows`` rows of ``qtype`` blocks, ``x`` device
    float32 ``(n, cols)``; float32 ``(n, rows)`` (into ``out`` when given), queued on ``stream``."""
    q = Q.quant_type(qtype, "gpu_quant.matmul", Q.LAYOUTS)
    rb = Q.row_bytes(qtype, cols, "gpu_quant.matmul", Q.LAYOUTS)
    if w.dtype != cp.uint8 or w.size != rows * rb:
        raise ValueError(f"gpu_quant.matmul: w has {w.size} {w.dtype} elements, expected {rows * rb} uint8")
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"gpu_quant.matmul: x has shape {x.shape}, expected (n, {cols})")
    n = x.shape[0]
    y = cp.empty((n, rows), cp.float32) if out is None else out
    if y.shape != (n, rows) or y.dtype != cp.float32 or not y.flags.c_contiguous:
        raise ValueError(f"gpu_quant.matmul: out must be C-contiguous float32 ({n}, {rows})")
    kernel = _module().get_function("qmatmul")
    args = (w, np.int32(qtype), np.int32(q.block_weights), np.int32(q.block_bytes), np.int32(rows), np.int32(cols),
            np.int64(rb), x, np.int32(n), y)
    with stream or cp.cuda.get_current_stream():
        kernel(((rows + 3) // 4,), (128,), args)
    return y
