"""``pf_mm2`` (``prefill_mm2.cu``): the batched prefill's expert product with its Q8_0 weights and its
activations copied into shared memory by ``cp.async`` (4-byte copies of the stored blocks, 16-byte
copies of the activation halves), two stages deep, instead of one byte per thread per weight.

It takes ``pf_mm``'s arguments, grid and block (``execute.prefill``) and gives the same values: the
same ``mma.sync`` sequence per output fragment and the same float32 block-scale accumulation (the
quants are turned into f16 exactly in registers). It applies to a layer whose gate, up and down are
Q8_0 with hidden and ffn multiples of 64 (every copy source then 4-byte aligned); other layers keep
``pf_mm``.

``MOELAB_PREFILL_MM``: ``2`` (the default) selects ``pf_mm2`` where it applies, ``1`` keeps ``pf_mm``
everywhere (for comparison); another value is an error. ``BatchedExperts`` asks :func:`kernel_for`
per layer.
"""
from __future__ import annotations

import os

from . import quant as Q
from .experts import ExecutorError

__all__ = ["mm_env", "m16_env", "applies", "kernel", "kernel_for", "tile_rows_ab"]



def mm_env() -> int:
    """``MOELAB_PREFILL_MM``: unset or 2 -> 2, 1 -> 1; another value is an ExecutorError."""
    v = os.environ.get("MOELAB_PREFILL_MM", "2")
    if v not in ("1", "2"):
        raise ExecutorError(f"MOELAB_PREFILL_MM={v!r}: expected 1 (pf_mm) or 2 (pf_mm2 on Q8_0 layers)")
    return int(v)


def m16_env() -> bool:
    """``MOELAB_PREFILL_M16``: 1 -> True (a device chunk's pf_mm2 layers in tiles of 16 pair rows,
    ``pf_mm2_m16``), 0 or unset -> False; another value is an ExecutorError naming the variable."""
    v = os.environ.get("MOELAB_PREFILL_M16", "0").strip()
    if v not in ("0", "1"):
        raise ExecutorError(f"environment variable MOELAB_PREFILL_M16: {v!r}, expected 0 or 1")
    return v == "1"


def applies(lx) -> bool:
    """Whether ``pf_mm2`` reads layer ``lx``'s experts: gate, up and down Q8_0, hidden and ffn
    multiples of 64 (the rest as ``prefill.supported``: SiLU, no biases)."""
    return (lx is not None and lx.gate.qtype == lx.up.qtype == lx.down.qtype == Q.Q8_0
            and lx.hidden % 64 == 0 and lx.ffn % 64 == 0 and lx.activation == "silu" and not lx.has_bias)


def kernel(name: str = "pf_mm2"):
    """The compiled ``pf_mm2`` (or ``pf_mm2_m16``, tiles of 16 rows) as a CuPy RawKernel function
    (the module compiled once per process)."""
    from .gpu_host import cuda_module

    return cuda_module("prefill_mm2.cu").get_function(name)


def kernel_for(lx) -> str:
    """The product kernel a layer's prefill steps use: ``"pf_mm2"`` when :func:`applies` and
    ``MOELAB_PREFILL_MM`` is 2 (the default), else ``"pf_mm"``."""
    return "pf_mm2" if mm_env() == 2 and applies(lx) else "pf_mm"


def launch(f, base, tiles, a, K: int, nout: int, off_a: int, off_b: int, row_bytes: int, mode: int, out,
           qt: int = Q.Q8_0) -> None:
    """One launch of ``pf_mm`` or ``pf_mm2`` (``f``, a CuPy function) on the current stream as
    ``BatchedExperts`` makes it: ``base`` (G,) uint64 expert addresses, ``tiles`` (rows, n, group) int32
    device arrays, ``a`` the (hi, lo, inv) activations of ``pf_split``; ``out`` (rows, nout) float32."""
    import numpy as np

    cols = 64 if mode == 0 else 128
    f((-(-nout // cols), int(tiles[0].size)), (128,),
      (base, *tiles, *a, np.int32(K), np.int32(nout), np.int64(off_a), np.int64(off_b), np.int64(row_bytes),
       np.int32(qt), np.int32(mode), out))


def tile_rows_ab(tokens: int = 256, experts: int = 128, top_k: int = 8, hidden: int = 2048, ffn: int = 768,
                 reps: int = 20, seed: int = 0) -> dict:
    """``pf_mm2`` in tiles of 32 pair rows against ``pf_mm2_m16`` in tiles of 16 on one layer of random
    Q8_0 experts, ``tokens`` tokens routed to ``top_k`` distinct experts each (uniform): each product's
    device time (median of ``reps`` interleaved launches, CUDA events, ms), the tiles launched, and
    whether the two give the same bits (they should: a row's products do not depend on its tile)."""
    import cupy as cp
    import numpy as np

    from .batch_route import group_pairs
    from .experts import random_layer
    from .prefill import _kernel

    rng = np.random.default_rng(seed)
    lx = random_layer(rng, 0, experts, hidden, ffn, Q.Q8_0, exact=False)
    off_g, off_u, off_d = lx.device_offsets()
    slot = -(-lx.expert_bytes // 256) * 256
    arena = cp.zeros(experts * slot, cp.uint8)
    for x in range(experts):
        arena[x * slot: x * slot + lx.expert_bytes] = cp.asarray(
            np.concatenate([lx.gate.data[x], lx.up.data[x], lx.down.data[x]]).view(np.uint8).reshape(-1))
    base = cp.asarray(np.array([arena.data.ptr + x * slot for x in range(experts)], np.uint64))
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    split = _kernel("pf_split")
    fs = {32: kernel(), 16: kernel("pf_mm2_m16")}

    def halves(v):
        n, c = v.shape
        hi, lo, inv = cp.empty((n, c), cp.uint16), cp.empty((n, c), cp.uint16), cp.empty(n, cp.float32)
        split((n,), (256,), (cp.asarray(v), np.uint64(0), np.int32(c), hi, lo, inv))
        return hi, lo, inv

    rows = tokens * top_k
    tiles, a = {}, {}
    for bm in fs:
        tok, _, t = group_pairs(ids, experts, bm)
        tiles[bm] = tuple(cp.asarray(np.ascontiguousarray(r)) for r in t)
        a[bm] = halves(x[tok])
    outs, times = {}, {(bm, m): [] for bm in fs for m in (0, 1)}
    ev = [cp.cuda.Event(), cp.cuda.Event()]
    for r in range(reps + 1):
        for bm, f in fs.items():
            h = cp.empty((rows, ffn), cp.float32)
            ev[0].record()
            launch(f, base, tiles[bm], a[bm], hidden, ffn, off_g, off_u, Q.row_bytes(Q.Q8_0, hidden), 0, h)
            ev[1].record()
            ev[1].synchronize()
            t_gu = cp.cuda.get_elapsed_time(ev[0], ev[1])
            b = halves(h)
            y = cp.empty((rows, hidden), cp.float32)
            ev[0].record()
            launch(f, base, tiles[bm], b, ffn, hidden, off_d, 0, Q.row_bytes(Q.Q8_0, ffn), 1, y)
            ev[1].record()
            ev[1].synchronize()
            if r:  # the first round is the warm-up
                times[bm, 0].append(t_gu)
                times[bm, 1].append(cp.cuda.get_elapsed_time(ev[0], ev[1]))
            outs[bm] = (h.get(), y.get())
    same = all(np.array_equal(outs[32][i], outs[16][i]) for i in (0, 1))
    return {"tokens": tokens, "experts": experts, "top_k": top_k, "hidden": hidden, "ffn": ffn, "reps": reps,
            "tiles_used": {bm: int((t[1].get() > 0).sum()) for bm, t in tiles.items()},
            "gate_up_ms": {bm: float(np.median(times[bm, 0])) for bm in fs},
            "down_ms": {bm: float(np.median(times[bm, 1])) for bm in fs}, "identical": bool(same)}
