"""Dequantize-and-multiply on the GPU for every layout of ``execute.quant`` (``gpu_quant.cu``).

``matmul(w, qtype, rows, cols, x)`` computes ``y = x @ W.T`` for a device matrix ``W`` stored as
GGUF blocks (``rows`` rows of ``quant.row_bytes`` bytes, any alignment) and device inputs ``x``
``(n, cols)`` float32. Quantized types: a lane decodes 32 weights at a time into int8 quants and
per-16 scales and offsets (``dec32``). One token (``qmatmul_q1``): a warp's 2 rows are first copied
to shared memory in the 16-byte words that cover them (``cp.async``, every copy of a tile in
flight at once), the input staged meanwhile as two int8 levels per 32 values (x within
max|x| / 65024 per value, relative error of a product ~2e-5, bound 2e-4 as the CPU pool's int8
path), then decoded there and dotted by ``dp4a``. Batches (``qmatmul_q``): up to 8 tokens per
decoded chunk. Float types: weight by weight (``qmatmul_f``). The i-quants' tables come from
``execute.iq_grids`` (the project's own copy) into global memory (:func:`tables`).

The same file holds the expert kernels of layers with a type the arena's kernels do not read
(``qmoe_gate_up``, ``qmoe_down``, ``qmoe1_gate_up``, ``qmoe1_down_combine``: :func:`kernel`),
launched by ``gpu_experts.GpuExperts`` exactly as it launches ``gpu_kernels.cu``'s ``moe_*``
kernels, so such experts stay in their stored type in the arena and over PCIe. One token: a warp
copies its rows' tiles to shared memory by coalesced 16-byte copies (the block staging the input
as ``qmatmul_q1`` does meanwhile), then a lane dots one row over a slice of its chunks, so a
warp's input reads are broadcasts and its weight reads fall on distinct bank quads; the type
dispatched once per tile to a body compiled for it; down: a warp per expert on float32 ``h``,
``ONE_DOWN_ROWS`` rows per block. ``ONE_PROBES``: the same launches with the dots left out
(``_p``), and the weight copies too (``_n``), timed by ``experiments/gpu_quant_check.py --probe``.
Batches
(``qmoe_gate_up``, ``qmoe_down``): tensor cores (``mma.m16n8k16``) on the tile's quants decoded to
exact f16 once per 64 tokens and inputs as two f16 halves, each 32 weights' sums scaled in float32
(relative error of a product ~1e-7). Their int8 twins (``BATCH_VARIANTS``, :class:`Int8Batch`;
``GENERIC_BATCH`` picks what ``gpu_experts``' generic layers run): the inputs converted once per launch
(``qx8``) to the two int8 levels of the one-token path, tiles copied by ``cp.async`` while the
weights decode to int8, ``mma`` ``.s8`` with exact int32 sums (the one-token path's error, ~2e-5);
the pipelined ones (``_q8p*``: 8 warps, ``Q8_BLOCK``'s dynamic shared memory) copy the next tile's
inputs and weight bytes while a tile is decoded and multiplied (``Q8_PDL``: by dependent launch).
``ONE_PROGRAMMATIC``: the engine's one-token launches of these kernels as ``_d``'s.
The source lies in ``gpu_quant.cu`` and the five ``gpu_quant_*.cu`` parts it includes
(:func:`source` inlines them).
"""
from __future__ import annotations

import re
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from . import iq_grids as G
from . import quant as Q

if TYPE_CHECKING:
    import cupy as cp

__all__ = ["BATCH_VARIANTS", "FLOAT_QTYPES", "GENERIC_BATCH", "Int8Batch", "Q8_BLOCK", "Q8_PDL", "Q8_ROWS", "GPU_QUANT_QTYPES", "ONE_DOWN_ROWS", "ONE_PROBES", "ONE_PROGRAMMATIC", "ONE_VARIANTS", "Experts",
           "kernel", "kernel_info", "matmul", "source", "tables"]

GPU_QUANT_QTYPES = tuple(sorted(Q.LAYOUTS))
FLOAT_QTYPES = (Q.F32, Q.F16, Q.BF16)  # read weight by weight (qmatmul_f); the rest by 32-weight chunks
_MODULES: dict[tuple[str, ...], cp.RawModule] = {}
# other qmoe_gate_up / qmoe_down kernels: int8 tensor cores, 64 / 32 / 16 rows a block (_q8s*: the weights' tile copied first)
# (_q8p, _q8p2, _q8px: 8 warps, the next tile's copies in flight while a tile is decoded and multiplied;
# _q8pd, _q8pxd: _q8p's and _q8px's kernels, each launch after the first by programmatic dependent launch)
BATCH_VARIANTS = ("_q8", "_q8m2", "_q8m1", "_q8s2", "_q8s1", "_q8p", "_q8p2", "_q8px", "_q8pd", "_q8pxd")
# variants that launch another's kernels by programmatic dependent launch (after the first qx8)
Q8_PDL = {"_q8pd": "_q8p", "_q8pxd": "_q8px"}
# their m-tiles (16 rows) per block of gate/up and of down (_q8px: _q8p2's gate/up, _q8p's down)
Q8_ROWS = {"_q8": (4, 4), "_q8m2": (2, 2), "_q8m1": (1, 1), "_q8s2": (2, 2), "_q8s1": (1, 1), "_q8p": (4, 4),
           "_q8p2": (2, 2), "_q8px": (2, 4), "_q8pd": (4, 4), "_q8pxd": (2, 4)}


def _q8p_bytes(mt: int) -> int:
    """Q8P<mt>::BYTES of gpu_quant_mmq.cu: two buffers (16 mt rows x WSLOT weight bytes, 2 levels x 64
    tokens x QROW input bytes, their scales and sums), the tile's quants and scales, the pass's rows."""
    return 2 * (16 * mt * 256 + 2 * 64 * 144 + 64 * 4 * 4 + 64 * 8 * 4) + 16 * mt * 144 + 4 * 16 * mt * 16 + 64 * 4


# threads and dynamic shared bytes per block of gate/up and of down, where other than (128, 0, 0)
Q8_BLOCK = {"_q8p": (256, _q8p_bytes(4), _q8p_bytes(4)), "_q8p2": (256, _q8p_bytes(2), _q8p_bytes(2)),
            "_q8px": (256, _q8p_bytes(2), _q8p_bytes(4)), "_q8pd": (256, _q8p_bytes(4), _q8p_bytes(4)),
            "_q8pxd": (256, _q8p_bytes(2), _q8p_bytes(4))}
# the batched kernels gpu_experts launches for layers the arena's kernels do not read: "" the f16
# qmoe_gate_up / qmoe_down, or an int8 variant of Q8_ROWS (Int8Batch): the fastest on the H200, every
# type alike, 1.7-1.9x the f16 kernels' (docs/perf/gpu_quant_int8_h200)
GENERIC_BATCH = "_q8m2"
# other one-token launches: _d, the same kernels by programmatic dependent launch; _w, gate/up in tiles of
# 40 KB (a Q8_0 or Q6_K row of 2048 columns in one tile; 4 blocks per SM), down as the default
ONE_VARIANTS = ("_d", "_w")
# True: gpu_experts launches generic layers' one-token kernels by programmatic dependent launch (as _d: the same
# kernels and bits, tested; _d ran 1.15-1.2x and 1.18-1.23x the plain launches on 8 experts of qwen3-30b-a3b's
# shape on the H200, docs/perf/gpu_quant_int8_h200 and docs/perf/gpu_quant_h200/100e6da)
ONE_PROGRAMMATIC = True
ONE_PROBES = ("_p", "_n")  # one-token launches without the dots (and the weight copies): timing only, no results
ONE_DOWN_ROWS = 4  # rows per block of qmoe1_down_combine as gpu_experts launches it (one wave of blocks)


def tables() -> dict[str, np.ndarray]:
    """The i-quant tables of gpu_quant.cu by global name, as the bytes it reads (grid rows as words;
    IQ1 grid values g as the bytes 8 g + 1 and 8 g - 1, one table per delta sign)."""
    iq1 = G.grid("IQ1_S").astype(np.int16) * 8
    return {"g_iq2xxs": G.grid("IQ2_XXS").astype(np.uint8), "g_iq2xs": G.grid("IQ2_XS").astype(np.uint8),
            "g_iq2s": G.grid("IQ2_S").astype(np.uint8), "g_iq3xxs": G.grid("IQ3_XXS").astype(np.uint8),
            "g_iq3s": G.grid("IQ3_S").astype(np.uint8), "g_iq1p": (iq1 + 1).astype(np.int8),
            "g_iq1n": (iq1 - 1).astype(np.int8), "g_iq4nl": G.IQ4_NL_VALUES, "g_ksigns": G.KSIGNS}


def source() -> str:
    """gpu_quant.cu with its parts (``#include "gpu_quant_*.cu"`` lines) inlined: the text NVRTC
    compiles (and CuPy's cache keys on)."""
    root = resources.files(__package__)
    return re.sub(r'^#include "(gpu_quant_\w+\.cu)"$', lambda m: root.joinpath(m.group(1)).read_text(),
                  root.joinpath("gpu_quant.cu").read_text(), flags=re.M)


def _module(defines: tuple[str, ...] = ()) -> cp.RawModule:
    """gpu_quant.cu compiled once per process and set of ``-D`` ``defines`` (about a minute the
    first time; CuPy caches it), its tables uploaded."""
    mod = _MODULES.get(defines)
    if mod is None:
        import cupy as cp

        mod = cp.RawModule(code=source(), options=("-std=c++14", *(f"-D{d}" for d in defines)))
        blocks = np.zeros((64, 2), np.int32)  # g_block: (weights, bytes) of a block, by type id
        for t, q in Q.LAYOUTS.items():
            blocks[t] = (q.block_weights, q.block_bytes)
        for name, arr in {**tables(), "g_block": blocks}.items():  # sizes as declared in gpu_quant.cu
            flat = np.ascontiguousarray(arr).reshape(-1)
            cp.ndarray(flat.shape, flat.dtype, mod.get_global(name)).set(flat)
        _MODULES[defines] = mod
    return mod


def kernel(name: str, defines: tuple[str, ...] = ()) -> cp.RawKernel:
    """A kernel of gpu_quant.cu (compiled, tables uploaded, on first use); ``defines`` (``-D``
    flags, e.g. ``GQ_ONLY=12``: a module that reads that type alone) give another module."""
    return _module(defines).get_function(name)


def kernel_info(name: str, block: int, defines: tuple[str, ...] = (), shared_bytes: int = 0) -> dict[str, int]:
    """Registers, local (stack) bytes per thread, static shared bytes, and resident blocks per SM
    of ``block`` threads with ``shared_bytes`` of dynamic shared memory (the driver's occupancy) of a
    gpu_quant.cu kernel."""
    import ctypes

    k = kernel(name, defines)
    a = k.attributes
    n = ctypes.c_int(-1)
    ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(k.kernel.ptr), ctypes.c_int(block), ctypes.c_size_t(shared_bytes))
    return {"regs": a["num_regs"], "local_bytes": a["local_size_bytes"], "smem_bytes": a["shared_size_bytes"],
            "blocks_per_sm": n.value}


def matmul(w: cp.ndarray, qtype: int, rows: int, cols: int, x: cp.ndarray, out: cp.ndarray | None = None,
           stream: cp.cuda.Stream | None = None) -> cp.ndarray:
    """``x @ W.T``: ``w`` the device bytes of ``rows`` rows of ``qtype`` blocks, ``x`` device
    float32 ``(n, cols)``; float32 ``(n, rows)`` (into ``out`` when given), queued on ``stream``."""
    import cupy as cp

    Q.quant_type(qtype, "gpu_quant.matmul", Q.LAYOUTS)
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
    args = (w, np.int32(qtype), np.int32(rows), np.int32(cols), np.int64(rb), x, np.int32(n), y)
    if n == 0 or rows == 0:
        return y
    with stream or cp.cuda.get_current_stream():
        if qtype in FLOAT_QTYPES:
            _module().get_function("qmatmul_f")(((rows + 3) // 4,), (128,), args)
        elif n == 1:
            _module().get_function("qmatmul_q1")(((rows + 7) // 8, 1), (128,), args)
        else:
            _module().get_function("qmatmul_q")(((rows + 7) // 8, (n + 7) // 8), (128,), args)
    return y



class Int8Batch:
    """The batched expert launches of an int8 variant (``Q8_ROWS``): ``qx8`` of x, ``qmoe_gate_up``,
    ``qx8`` of h, ``qmoe_down`` (the variant's), as ``gpu_experts.GpuExperts`` launches the batched
    kernels: a call queues them on stream ``s`` over ``groups`` groups (``base``, ``gstart``,
    ``order``, ``xrow``: the device metadata), ``x`` ``nx`` rows of ``hidden`` float32, ``h`` ``nh``
    rows of ``ffn`` (pair ids index them), ``y`` the pairs' outputs (device addresses), ``consts`` the
    layer's (hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias). The
    planes of x and h live in a work buffer of :meth:`plane_bytes` it holds (grown in stream order)."""

    def __init__(self, variant: str, defines: tuple[str, ...] = ()):
        from .gpu_host import Launch

        if variant not in Q8_ROWS:
            raise ValueError(f"gpu_quant.Int8Batch: variant {variant!r}, expected one of {tuple(Q8_ROWS)}")
        self.mt = Q8_ROWS[variant]
        self.threads, *self.shared_bytes = Q8_BLOCK.get(variant, (128, 0, 0))
        self.programmatic, variant = variant in Q8_PDL, Q8_PDL.get(variant, variant)  # (variant: whose kernels)
        self._kx = Launch(kernel("qx8", defines), 5)
        self._kh = Launch(kernel("qx8", defines), 5, programmatic=self.programmatic)
        self._k1 = Launch(kernel("qmoe_gate_up" + variant, defines), 18)
        self._k2 = Launch(kernel("qmoe_down" + variant, defines), 13)
        if self.shared_bytes[0]:  # above the 48 KB a kernel gets unasked
            import cupy as cp

            for k, nbytes in zip((self._k1, self._k2), self.shared_bytes):  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                cp.cuda.driver.funcSetAttribute(k.func, 8, nbytes)
        self._buf = None

    @staticmethod
    def plane_bytes(nx: int, hidden: int, nh: int, ffn: int) -> int:
        """Bytes of the work buffer for ``nx`` rows of x and ``nh`` of h (qx8's planes of both)."""
        return -(-nx * hidden * 19 // 8 // 256) * 256 + nh * ffn * 19 // 8

    def __call__(self, s: int, groups: int, base: int, gstart: int, order: int, xrow: int, x: int, nx: int, h: int,
                 nh: int, y: int, consts: tuple) -> None:
        import cupy as cp

        hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = consts
        nbytes = self.plane_bytes(nx, hidden, nh, ffn)
        if self._buf is None or self._buf.size < nbytes:
            with cp.cuda.ExternalStream(s):  # the old buffer returns to the pool in this stream's order
                self._buf = cp.empty(max(nbytes, 0 if self._buf is None else 2 * self._buf.size), cp.uint8)
        (mt, md), planes = self.mt, self._buf.data.ptr
        x8 = planes
        h8 = planes + -(-nx * hidden * 19 // 8 // 256) * 256
        self._kx((-(-nx * hidden // 512), 1), 128, s, x, hidden, nx, hidden, x8)
        self._go(self._k1, self.shared_bytes[0], (-(-ffn // (8 * mt)), groups), s, base, gstart, order, xrow, x8, nx, h,
                 ffn, hidden, 2 * mt, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias)
        self._kh((-(-nh * ffn // 512), 1), 128, s, h, ffn, nh, ffn, h8)
        self._go(self._k2, self.shared_bytes[1], (-(-hidden // (16 * md)), groups), s, base, gstart, order, h8, nh, y, ffn,
                 hidden, 4 * md, off_d, qt_d, rb_d, bias)

    def _go(self, k, shared_bytes: int, grid: tuple[int, int], s: int, *args: int) -> None:
        """``k``'s launch at the variant's threads with ``shared_bytes`` of dynamic shared memory
        (``gpu_host.Launch`` passes none)."""
        if not shared_bytes:
            return k(grid, self.threads, s, *args)
        import cupy as cp

        from .pdl_launch import launch_programmatic

        if len(args) != k.nargs:
            raise ValueError(f"kernel launch: {len(args)} arguments, expected {k.nargs}")
        k._pack(k._view, 0, *args)  # Launch's argument block, as its own call fills it
        if self.programmatic:
            launch_programmatic(k.func, grid, self.threads, shared_bytes, s, k._params_ptr)
        else:
            cp.cuda.driver.launchKernel(k.func, grid[0], grid[1], 1, self.threads, 1, 1, shared_bytes, s, k._params_ptr, 0)


class Experts:
    """The ``qmoe_*`` expert kernels launched as ``gpu_experts.GpuExperts`` launches them (4 warps of
    2 rows per block; one-token down: ``ONE_DOWN_ROWS`` rows per block, a warp per expert), for benchmarks and tests
    (``variant``: one of ``BATCH_VARIANTS``, the other batched kernels, of ``ONE_VARIANTS``, the
    other one-token kernels, or ``ONE_PROBES``, timing probes; ``defines``: the module's ``-D``
    flags; ``down_rows``: the one-token down launch's rows per block, else ``ONE_DOWN_ROWS``).

    ``w``: device uint8 ``(E, expert_bytes)``, each expert gate | up | down (no biases; types
    ``qtypes``, ``ffn`` x ``hidden`` / ``hidden`` x ``ffn`` rows of ``quant.row_bytes``). With
    ``weights`` (``E`` floats, E <= 32): the one-token path, ``call(x)`` of ``x`` (1, hidden) gives
    (1, hidden) = sum_e weights[e] * expert_e(x). Without: every one of ``tokens`` tokens through every
    expert (the grouped path, ``E`` groups of ``tokens`` pairs), ``(E * tokens, hidden)`` expert-major.
    Buffers and launches are made here; a call only launches (on the current stream)."""

    def __init__(self, w: cp.ndarray, qtypes: tuple[int, int, int], ffn: int, hidden: int, tokens: int = 1,
                 weights: np.ndarray | None = None, variant: str = "", defines: tuple[str, ...] = (),
                 down_rows: int | None = None):
        import cupy as cp

        from .gpu_host import Launch

        names = ("gate", "up", "down")
        rb = [Q.row_bytes(t, c, f"gpu_quant.Experts {n}", Q.LAYOUTS) for t, c, n in zip(qtypes, (hidden, hidden, ffn), names)]
        if set(qtypes) & set(FLOAT_QTYPES):
            raise ValueError(f"gpu_quant.Experts: qtypes {qtypes}: the qmoe kernels read quantized types only")
        off_u, off_d = ffn * rb[0], ffn * (rb[0] + rb[1])
        self.expert_bytes = off_d + hidden * rb[2]
        if w.dtype != cp.uint8 or w.ndim != 2 or w.shape[1] != self.expert_bytes:
            raise ValueError(f"gpu_quant.Experts: w has shape {w.shape} {w.dtype}, expected (E, {self.expert_bytes}) uint8")
        num_e = w.shape[0]
        self.w, self.hidden, self.tokens = w, hidden, tokens
        bases = np.uint64(w.data.ptr) + np.uint64(self.expert_bytes) * np.arange(num_e, dtype=np.uint64)
        gu = (ffn, hidden, 2, 0, qtypes[0], rb[0], off_u, qtypes[1], rb[1], 0, 0)
        if weights is not None:
            if len(weights) != num_e or num_e > 32 or tokens != 1:
                raise ValueError(f"gpu_quant.Experts: the one-token path takes 1 token and E <= 32 weights, got {len(weights)}")
            self._ex = np.zeros(16 * 32, np.uint8)  # Experts1: base[32] u64, weight[32] f32, pick[32] i32
            self._ex[:8 * num_e] = bases.view(np.uint8)
            self._ex[256:256 + 4 * num_e] = np.asarray(weights, np.float32).view(np.uint8)
            self._ex[384:384 + 4 * num_e] = np.arange(num_e, dtype=np.int32).view(np.uint8)
            self.h, self.out = cp.empty((num_e, ffn), cp.float32), cp.empty((1, hidden), cp.float32)
            if variant and variant not in (*ONE_VARIANTS, *ONE_PROBES):
                raise ValueError(f"gpu_quant.Experts: one-token variant {variant!r}, "
                                 f"expected one of {(*ONE_VARIANTS, *ONE_PROBES)}")
            pdl, suffix = variant == "_d", "" if variant == "_d" else variant
            k1 = Launch(kernel("qmoe1_gate_up" + suffix, defines), 13, self._ex, programmatic=pdl)
            k2 = Launch(kernel("qmoe1_down_combine" + ("" if variant == "_w" else suffix), defines), 10, self._ex,
                        programmatic=pdl)
            rpb = down_rows or ONE_DOWN_ROWS
            if not 1 <= rpb <= 32:
                raise ValueError(f"gpu_quant.Experts: down_rows {rpb}, expected 1..32")
            self._calls = [lambda s, x: k1((-(-ffn // 8), num_e), 128, s, x, self.h.data.ptr, *gu),
                           lambda s, x: k2((-(-hidden // rpb), 1), 32 * num_e, s, self.h.data.ptr, self.out.data.ptr,
                                           num_e, ffn, hidden, rpb, off_d, qtypes[2], rb[2], 0)]
            return
        self._meta = [cp.asarray(bases), cp.arange(0, (num_e + 1) * tokens, tokens, dtype=cp.int32),
                      cp.arange(num_e * tokens, dtype=cp.int32)]
        self._meta.append(self._meta[2] % tokens)  # x row of each pair
        base, gstart, order, xrow = (a.data.ptr for a in self._meta)
        self.h = cp.empty((num_e * tokens, ffn), cp.float32)
        self.out = cp.empty((num_e * tokens, hidden), cp.float32)
        if variant and variant not in BATCH_VARIANTS:
            raise ValueError(f"gpu_quant.Experts: variant {variant!r}, expected one of {BATCH_VARIANTS}")
        if variant in Q8_ROWS:  # inputs to int8 planes once per launch (qx8), then the int8 tensor-core kernels
            q8, npair = Int8Batch(variant, defines), num_e * tokens
            consts = (hidden, ffn, 0, qtypes[0], rb[0], off_u, qtypes[1], rb[1], off_d, qtypes[2], rb[2], 0, 0)
            self._calls = [lambda s, x: q8(s, num_e, base, gstart, order, xrow, x, tokens, self.h.data.ptr, npair,
                                           self.out.data.ptr, consts)]
            return
        k1, k2 = Launch(kernel("qmoe_gate_up" + variant, defines), 18), Launch(kernel("qmoe_down" + variant, defines), 12)
        self._calls = [lambda s, x: k1((-(-ffn // 8), num_e), 128, s, base, gstart, order, xrow, x, hidden, self.h.data.ptr, *gu),
                       lambda s, x: k2((-(-hidden // 8), num_e), 128, s, base, gstart, order, self.h.data.ptr,
                                       self.out.data.ptr, ffn, hidden, 2, off_d, qtypes[2], rb[2], 0)]

    def __call__(self, x: cp.ndarray) -> cp.ndarray:
        """The output buffer (reused by the next call) for device float32 ``x`` (tokens, hidden)."""
        import cupy as cp

        if x.dtype != cp.float32 or x.shape != (self.tokens, self.hidden) or not x.flags.c_contiguous:
            raise ValueError(f"gpu_quant.Experts: x must be C-contiguous float32 ({self.tokens}, {self.hidden})")
        s = cp.cuda.get_current_stream().ptr
        for call in self._calls:
            call(s, x.data.ptr)
        return self.out
