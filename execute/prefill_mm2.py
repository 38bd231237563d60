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

__all__ = ["mm_env", "applies", "kernel", "kernel_for"]



def mm_env() -> int:
    """``MOELAB_PREFILL_MM``: unset or 2 -> 2, 1 -> 1; another value is an ExecutorError."""
    v = os.environ.get("MOELAB_PREFILL_MM", "2")
    if v not in ("1", "2"):
        raise ExecutorError(f"MOELAB_PREFILL_MM={v!r}: expected 1 (pf_mm) or 2 (pf_mm2 on Q8_0 layers)")
    return int(v)


def applies(lx) -> bool:
    """Whether ``pf_mm2`` reads layer ``lx``'s experts: gate, up and down Q8_0, hidden and ffn
    multiples of 64 (the rest as ``prefill.supported``: SiLU, no biases)."""
    return (lx is not None and lx.gate.qtype == lx.up.qtype == lx.down.qtype == Q.Q8_0
            and lx.hidden % 64 == 0 and lx.ffn % 64 == 0 and lx.activation == "silu" and not lx.has_bias)


def kernel():
    """The compiled ``pf_mm2`` (a CuPy RawKernel function, compiled once per process)."""
    from .gpu_host import cuda_module

    return cuda_module("prefill_mm2.cu").get_function("pf_mm2")


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
