"""Which one-token (decode) kernels the GPU path launches: ``MOELAB_DECODE_KERNELS``.

``v1``: ``dense_gemv``, ``qk_rope_kv``, ``attn_partial``, ``attn_reduce``,
``router_topk``, ``moe1r_gate_up``, ``moe1r_down_combine``. ``v2``: their ``*_v2`` twins
(``dense_kernels_v2.cu``, ``gpu_kernels.cu``), which take the same arguments and launch shapes and
issue a batch of weight (or key) loads before their first use (``qk_rope_kv_v2`` and
``attn_reduce_v2`` are their twins' code, waiting for their inputs first); the GEMVs, the router's
logits and the expert kernels sum in the same order as v1 (the same ids), the router's softmax
sums and the attention's online softmax (updated once per eight keys) round otherwise. ``v3``: the
v2 kernels, the dense ones (all but the two expert kernels) launched with programmatic dependent
launch (``execute.pdl_launch``), so each starts its blocks and prefetches its weights while the
kernel before it drains. ``v4`` (the default; on the H200, one qwen3-30b-a3b block in one graph:
v1 136 us, v3 91, v4 66, ``experiments/bench_decode_kernels.py``): v3 with the ``*_v4`` kernels where
there is one (:data:`V4_KERNELS`), launched so that each is one wave of blocks with its weights in
flight: the GEMV 2 rows per warp of 4 (rows up to 4 KB), every row's loads issued before the wait;
the router one row per block, its top k by ranks; the attention's keys prefetched into L2 before
its wait, 16 per warp in one round (hd <= 128); Q8_0 expert rows staged in shared memory by
16-byte asynchronous copies, down 4 rows per block; the two expert kernels launched with
programmatic dependent launch too (down copies its rows while gate/up drains). The GEMV and expert
sums are v1's, in v1's order; the router's logits are summed over a block (they round otherwise).
Read when launches are prepared (``GpuDense``'s construction, the token graph's first expert
launches). No cupy here: CPU code and tests import it.
"""
from __future__ import annotations

import os

from .experts import ExecutorError

__all__ = ["DECODE_KERNELS", "V4_KERNELS", "decode_kernels_env", "kernel_name", "programmatic"]

DECODE_KERNELS = ("v1", "v2", "v3", "v4")
V4_KERNELS = ("dense_gemv", "attn_partial", "router_topk", "moe1r_gate_up", "moe1r_down_combine")  # else v2's


def decode_kernels_env() -> str:
    """``MOELAB_DECODE_KERNELS``: ``v1``, ``v2``, ``v3`` or ``v4`` (unset or empty); anything else is an error."""
    v = os.environ.get("MOELAB_DECODE_KERNELS", "").strip() or "v4"
    if v not in DECODE_KERNELS:
        raise ExecutorError(f"environment variable MOELAB_DECODE_KERNELS: {v!r}, expected v1, v2, v3 or v4")
    return v


def kernel_name(base: str, variant: str) -> str:
    """The name of ``base``'s kernel in ``variant`` (``v1``: ``base``; ``v2``, ``v3``: ``base_v2``;
    ``v4``: ``base_v4`` for :data:`V4_KERNELS`, else ``base_v2``)."""
    if variant not in DECODE_KERNELS:
        raise ValueError(f"kernel variant {variant!r}, expected one of {DECODE_KERNELS}")
    if variant == "v4" and base in V4_KERNELS:
        return base + "_v4"
    return base if variant == "v1" else base + "_v2"


def programmatic(variant: str) -> bool:
    """Whether ``variant`` launches its dense one-token kernels with programmatic dependent launch
    (v4: its expert kernels too, ``GpuExperts.routed_layer``)."""
    if variant not in DECODE_KERNELS:
        raise ValueError(f"kernel variant {variant!r}, expected one of {DECODE_KERNELS}")
    return variant in ("v3", "v4")
