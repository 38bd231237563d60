"""The dense stand-in: per-layer GPU work in F16 standing in for attention and the router (and the
output head), as fused GEMVs launched raw; what ``moelab calibrate`` times as the dense path and
what its calibration replays and ``experiments/sim_vs_real.py`` run between expert layers."""
from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["StandIn"]

# The GEMV of experiments/bench_executor.py's fused stand-in: fp16 weight rows read as uint4
# (8 weights), float32 inputs as float4, fp32 accumulation, one warp per row, RMSNorm of the input
# folded in as a per-token scale.
_ROWS_PER_BLOCK = 8  # DW * DR


class StandIn:
    """Per-layer GPU work standing in for attention and the router, in F16, as fused GEMVs launched
    raw (``gpu_experts.Launch``, three kernels per layer): RMSNorm folded into a q/k/v projection
    ``(q + 2 kv, hidden)``, the output projection ``(hidden, q)`` of its first ``q`` outputs plus
    the residual, RMSNorm folded into the router logits ``(experts, hidden)``; the head is RMSNorm
    folded into ``(vocab, hidden)`` and an argmax. Weight bytes per layer equal the simulator's
    ``ModelSpec.dense_bytes`` in F16 (no KV cache is read). No attention over past tokens: routing
    comes from the trace. Work goes on the current CuPy stream; outputs alternate between two
    buffers per shape (valid in stream order)."""

    def __init__(self, cp, num_layers: int, hidden: int, q_dim: int, kv_dim: int, num_experts: int, vocab: int,
                 seed: int):
        from .gpu_experts import Launch

        for name, v in (("hidden", hidden), ("q_dim", q_dim), ("q_dim + 2 kv_dim", q_dim + 2 * kv_dim)):
            if v % 8:
                raise ValueError(f"StandIn {name}: {v}, expected a multiple of 8")
        self.cp = cp
        self.hidden, self.q_dim, self.qkv = hidden, q_dim, q_dim + 2 * kv_dim
        g = cp.random.default_rng(seed)
        mk = lambda r, c: (g.standard_normal((r, c), dtype=cp.float32) / np.float32(np.sqrt(c))).astype(cp.float16)
        self.wqkv = [mk(self.qkv, hidden) for _ in range(num_layers)]  # (q + 2 kv, hidden)
        self.wo = [mk(hidden, q_dim) for _ in range(num_layers)]  # (hidden, q)
        self.wr = [mk(num_experts, hidden) for _ in range(num_layers)]  # (experts, hidden)
        self.whead = mk(vocab, hidden) if vocab else None  # (vocab, hidden)
        self.layer_bytes = 2 * (hidden * self.qkv + q_dim * hidden + hidden * num_experts)
        self.head_bytes = 2 * hidden * vocab
        mod = cp.RawModule(code=resources.files(__package__).joinpath("gemv_f16.cu").read_text(),
                             options=("-std=c++14",))
        self._gemv = Launch(mod.get_function("gemv_f16"), 9)
        self._eps = Launch.f32(1e-6)
        self._bufs: dict[tuple[int, int], list] = {}
        cp.cuda.runtime.deviceSynchronize()  # the weights exist before any stream reads them

    def _out(self, t: int, n: int):
        """The next (t, n) float32 output buffer (two per shape, alternating)."""
        ring = self._bufs.get((t, n))
        if ring is None:
            ring = self._bufs[(t, n)] = [0, self.cp.empty((t, n), self.cp.float32), self.cp.empty((t, n), self.cp.float32)]
        ring[0] ^= 1
        return ring[1 + ring[0]]

    def _mv(self, w, x, ldx: int, k: int, norm: bool, res=None):
        """y (T, rows of w) = s_t * w @ x[t, :k] (+ res); x (T, ldx) float32 C-contiguous on the device."""
        t, n = x.shape[0], w.shape[0]
        y = self._out(t, n)
        self._gemv((-(-n // _ROWS_PER_BLOCK), t), 128, self.cp.cuda.get_current_stream().ptr, w.data.ptr, x.data.ptr,
                   ldx, 0 if res is None else res.data.ptr, y.data.ptr, n, k, int(norm), self._eps)
        return y

    def layer(self, x, l: int):
        """(x + attention stand-in, router logits): (T, hidden), (T, experts) float32 cupy."""
        h = self.hidden
        a = self._mv(self.wqkv[l], x, h, h, True)  # (T, q + 2 kv)
        x = self._mv(self.wo[l], a, self.qkv, self.q_dim, False, res=x)  # (T, hidden)
        return x, self._mv(self.wr[l], x, h, h, True)

    def head(self, x):
        """The sampled token id (greedy), a cupy array on the current stream."""
        return self.cp.argmax(self._mv(self.whead, x, self.hidden, self.hidden, True), axis=1)

    def reference(self, x: np.ndarray, l: int) -> tuple[np.ndarray, np.ndarray]:
        """``layer`` in float64 on the host (the numerical check)."""
        f = lambda w: w.get().astype(np.float64)
        x = np.asarray(x, np.float64)
        norm = lambda v: v / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-6)
        a = norm(x) @ f(self.wqkv[l]).T
        x = x + a[:, :self.q_dim] @ f(self.wo[l]).T
        return x, norm(x) @ f(self.wr[l]).T
