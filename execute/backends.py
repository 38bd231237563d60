"""Expert backends of the run loop (``execute.driver.run``): ``NumpyExperts``, the float32 numpy
reference (CPU only), and ``EngineExperts``, the expert engine (GPU arena and kernels, Numba CPU
pool); both compute ``y[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for a step's tokens."""
from __future__ import annotations

import numpy as np

from scheduler import Step

from .experts import ExecutorError
from .gguf_model import ModelWeights
from .load_plan import fast_load_env
from .xp import array_module, host as _host

__all__ = ["expert_ffn", "NumpyExperts", "EngineExperts"]


def expert_ffn(xp, activation: str, g, u):
    """The expert nonlinearity on gate and up projections (biases already added)."""
    if activation == "swiglu_oai":
        g = xp.minimum(g, 7.0)
        u = xp.clip(u, -7.0, 7.0)
        return g / (1.0 + xp.exp(-1.702 * g)) * (u + 1.0)
    return g / (1.0 + xp.exp(-g)) * u


def _cpu_only(item) -> None:
    d = item.decision
    if d.hits or d.uploads or d.streams or d.promotions:
        raise ExecutorError(f"layer {d.layer}: the policy put experts on the GPU (hits {len(d.hits)}, uploads "
                            f"{len(d.uploads)}, streams {len(d.streams)}); without a GPU only policy 'cpu' runs")


class NumpyExperts:
    """Reference expert backend: dequantizes each expert (``gguf_io.dequantize``) and runs it in
    float32 numpy, with the architecture's activation and expert biases. CPU-only: a decision that
    puts experts on the GPU is an error."""

    def __init__(self, weights: ModelWeights):
        self.experts = weights.experts
        self.bias = [l.expert_bias or {} for l in weights.layers]
        self.activation = weights.info.spec.activation

    def _expert(self, t, e: int) -> np.ndarray:
        from .gguf_io import dequantize

        return dequantize(t.data[e], t.qtype).reshape(t.rows, t.cols)

    def _pair(self, layer, b: dict, e: int, x: np.ndarray) -> np.ndarray:
        """Expert ``e`` on ``x`` (hidden,) or (n, hidden), with its biases when the model has them."""
        g, u = x @ self._expert(layer.gate, e).T, x @ self._expert(layer.up, e).T
        if b:
            g, u = g + b["gate"][e], u + b["up"][e]
        d = expert_ffn(np, self.activation, g, u) @ self._expert(layer.down, e).T
        return d + b["down"][e] if b else d

    def run_layer(self, item, x, ids: np.ndarray, weights: np.ndarray):
        """``y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` (summed in j order) for the
        step's tokens: x ``(T, hidden)``, ids and weights ``(T, k)``; -> ``(T, hidden)``."""
        _cpu_only(item)
        return self.compute(item.step, x, ids, weights)

    def compute(self, step: Step, x, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """``run_layer``'s result without looking at the decision."""
        l = step.layer
        layer, b = self.experts[l], self.bias[l]
        xh = _host(x).astype(np.float32)
        ids = np.asarray(ids)
        missing = set(np.unique(ids).tolist()) - set(step.experts)
        if missing:
            raise ExecutorError(f"layer {l}: routed experts {sorted(missing)} are not in the step")
        w = np.asarray(weights, np.float32)
        if len(ids) == 1:  # decode: one vector per expert
            y = np.zeros(layer.hidden, np.float32)
            for e, v in zip(ids[0].tolist(), w[0]):
                y += v * self._pair(layer, b, e, xh[0])
            return y[None]
        pairs = np.zeros((*ids.shape, layer.hidden), np.float32)  # (T, k, hidden)
        for e in step.experts:
            rows, cols = np.nonzero(ids == e)
            pairs[rows, cols] = self._pair(layer, b, e, xh[rows])
        y = np.zeros((len(ids), layer.hidden), np.float32)
        for j in range(ids.shape[1]):
            y += w[:, j:j + 1] * pairs[:, j]
        return y

    def start_background(self, moves) -> None:
        if moves:
            raise ExecutorError("background copies need a GPU; without a GPU only policy 'cpu' runs")

    def await_background(self, moves) -> None:
        pass

    def close(self) -> None:
        pass


class EngineExperts:
    """The expert engine (``execute.engine.ExpertEngine``: GPU arena and kernels, Numba CPU pool) as
    a ``run`` backend; a step of T tokens is run as its (expert, token) pairs."""

    def __init__(self, weights: ModelWeights, capacity, threads: int, use_gpu: bool, timeout_s: float = 60.0,
                 pinned: bool = True):
        info = weights.info
        partial = [l.layer for l in weights.experts if l is not None and info.expert_bias and not l.has_bias]
        if partial:
            raise ExecutorError(f"{info.path}: blocks {partial} lack some of the gate/up/down expert biases; the "
                                "expert kernels (CPU and GPU) need all three (the numpy backend likewise)")
        if use_gpu:
            array_module(True)  # a clear error when cupy is missing
        from threadpoolctl import threadpool_limits

        from .engine import ExpertEngine

        # MOELAB_FAST_LOAD: the host expert weights are registered on a background thread from here
        # on (the engine's import of the CPU pool meanwhile), the placement given by start_prepare
        self._gpu = None
        if use_gpu and pinned and fast_load_env():
            from .gpu_experts import GpuExperts

            self._gpu = GpuExperts(weights.experts, capacity, pinned=True, timeout_s=timeout_s, defer_pin=True)
            self._gpu.start_load()
        try:
            self.engine = ExpertEngine(weights.experts, capacity, threads, use_gpu, timeout_s, pinned=pinned,
                                       gpu=self._gpu)
        except BaseException:
            if self._gpu is not None:
                self._gpu.close()
            raise
        self.batched = None  # multi-token steps on tensor cores (execute.prefill), GPU only
        if use_gpu:
            from .prefill import BatchedExperts, prefill_env

            self.batched = BatchedExperts(self.engine) if prefill_env() else None
        self._first = next((l for l in weights.experts if l is not None), None)
        # numpy's BLAS threads spin-wait after each dense product and starve the Numba pool's
        # thread team (a 2-core layer call went from 0.5 ms to 19 ms); one-token products gain
        # nothing from BLAS threads, so they are limited to one while this backend lives (chunks
        # of prefill lose some dense speed on the host by this; on a GPU the dense path is cupy).
        self._blas = threadpool_limits(limits=1, user_api="blas")

    def start_prepare(self, policy) -> None:
        """Have the background load (``MOELAB_FAST_LOAD``: the host expert weights being page-locked)
        upload the experts the policy placed at construction as well; :meth:`prepare` waits for it
        (without this call, or the switch, ``prepare`` uploads them itself)."""
        if self._gpu is not None:
            self._gpu.start_load(dict(policy.cache.slot))

    def prepare(self, policy) -> None:
        """Compile the CPU kernels (first use) and upload the experts the policy placed at
        construction (profile pre-population, or all of them for ``gpu``); ``prepare_s`` then holds
        the seconds of each (``numba_warmup_s``, ``expert_upload_s``). When every expert is placed
        on the GPU no step can have a CPU pair (hits only), so the CPU kernels are not compiled (a
        cold Numba cache takes minutes; the pool would still compile on a first call)."""
        import time

        placed = dict(policy.cache.slot)
        every = sum(l.num_experts for l in self.engine.layers if l is not None)
        t0 = time.perf_counter()
        if self._first is not None and len(placed) < every:
            self.engine.pool.warmup(self._first, [l for l in self.engine.layers if l is not None])
        t1 = time.perf_counter()
        if self.engine.gpu is not None:
            self.engine.gpu.settle()  # a background load finished (or the weights registered) here
        self.engine.load_residents(placed)
        if self.engine.gpu is not None:
            self.engine.gpu.filled.clear()  # load_residents consumed those of this placement
        self.prepare_s = {"numba_warmup_s": t1 - t0, "expert_upload_s": time.perf_counter() - t1}

    def begin_layer(self, layer: int, x, ids: np.ndarray) -> None:
        """Start the block's resident experts before the policy plans its step (the engine's early
        start: one token, GPU only; the decisions are unchanged)."""
        self.engine.begin_layer(layer, x, ids)

    def run_layer(self, item, x, ids: np.ndarray, weights: np.ndarray):
        """The step's (expert, token) pairs on the engine: x ``(T, hidden)``, ids and weights
        ``(T, k)``; -> ``(T, hidden)`` on x's side."""
        b = self.batched
        if b is not None and b.takes(item.decision, ids):
            y = b.run_layer(item.decision, x, ids, weights)
        else:
            y = self.engine.run_layer(item, x, ids, weights)
        if self.engine.gpu is not None:
            # the dense path's stream (the caller's) waits on the device for the expert work, so
            # the next block is queued at once; its router's read-back is the host's one wait
            self.engine.dense_after_experts()
        return y

    def on_compute(self):
        """A context running the caller's work (the dense path) on the engine's compute stream
        (``ExpertEngine.on_compute``: no events between the two streams a step)."""
        return self.engine.on_compute()

    def settle_layer(self, item) -> None:
        """A step a token graph computed (``run``): the engine follows its decision's residency."""
        self.engine.settle_layer(item)

    def token_graph(self, model, graph_cpu: bool | None = None):
        """A ``TokenGraph`` running ``model``'s decode tokens with this engine's experts, or None
        (no GPU, a model off the fused path or with shared experts, or ``MOELAB_TOKEN_GRAPH=0``);
        ``graph_cpu``: its misses on the CPU pool (None: ``MOELAB_GRAPH_CPU``)."""
        eng = self.engine
        if eng.gpu is None or not getattr(model, "fast", False) or eng.table_dev is None:
            return None
        from .token_graph import TokenGraph, token_graph_env

        if not token_graph_env() or any(w["shared"] is not None for w in model.layers):
            return None
        if any(l is None or l.hidden != model.info.hidden for l in eng.layers) or eng.gpu.generic_layers:
            return None
        if not any(t is not None and t[2] > 0 for t in eng.gpu.slot_tables):  # no expert can be resident
            return None
        return TokenGraph(model, eng, graph_cpu)

    def device_chunk(self, model):
        """A ``DeviceChunk`` running ``model``'s prefill chunks with every block queued at once and
        the experts grouped on the device (``execute.prefill_device``), or None (no tensor-core
        path, a model it does not take, or ``MOELAB_PREFILL_DEVICE=0``)."""
        if self.batched is None:
            return None
        from .prefill_device import DeviceChunk, device_env

        return DeviceChunk.build(model, self.engine, self.batched) if device_env() else None

    def start_background(self, moves) -> None:
        self.engine.start_background(moves)

    def await_background(self, moves) -> None:
        self.engine.await_background(moves)

    def close(self) -> None:
        self.engine.close()
        if self._gpu is not None:  # built here and handed to the engine, which leaves it open
            self._gpu.close()
        self._blas.restore_original_limits()
