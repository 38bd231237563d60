"""``moelab calibrate``: measure this machine as moelab's executor uses it; write a hardware file.

The file is in the simulator's format (``scheduler/hardware.py``: ``moelab simulate --hardware
FILE``). Every number is measured here, from the executor's own code paths, repeated: the JSON keeps
the median as the field and every sample's median, 10th and 90th percentile and count under
``"_calibration"`` (which the simulator ignores), with a ``sources`` line per field.

What is measured (GPU timings use CUDA events with the stream held by a spin kernel while the work
is queued, so they are GPU time alone; host timings are the Python thread's wall time of calls
made back to back, warm, as in a replay; layers with CPU experts are timed one at a time, since in
a replay too the thread waits for the pool before each):

- link: pinned host->device copies by size (fit: latency + bytes / GB/s), pageable by size, and
  expert uploads through ``GpuExperts.upload`` (three copies each), back to back;
- GPU: device copy GB/s, fp16 matmul TFLOP/s, one expert batch as the engine queues it (packed
  metadata copy + ``GpuExperts.run_groups``) of 1..16 experts (fit: fixed + experts x bytes /
  GB/s), the combine, the dense stand-in (``StandIn``: fused F16 GEMVs for the attention
  projections and the router, launched raw, like ``experiments/sim_vs_real.py`` runs it) at four
  widths (fit: fixed + bytes / GB/s), the router read-back;
- host: a kernel launch, issuing the dense stand-in and the head, one call each of the engine's
  per-layer primitives (``layer_meta``, ``run_groups``, ``combine_meta``), ``ExpertEngine.run_layer``
  for hits-only and upload layers (whole and by phase: plan, queue, combine; fit per expert),
  queueing one upload, and layers with one hit and 1..8 CPU experts split by ``cpu_layer_parts``
  (the engine's phase counters and the ``CpuJob`` stamps: submit, hand-off, queue while the pool
  runs, pool start, pool end -> caller, combine), the scheduler's planning per layer step for
  each policy, the engine's polling interval;
- host, in a replay (``engine_replay``; these host-lane fields replace the one-call figures above):
  a 64-token synthetic trace of its own seed (not the one ``experiments/sim_vs_real.py`` checks
  against) decoded through ``replay_engine`` under lru and hybrid (96/256) with 20% of the experts
  cached, every layer's ``run_layer`` phases, decision sizes and CPU job stamps logged and reduced
  by ``replay_host_fields``: the host thread is as fast as it is in a replay, between layers that
  share the machine with the CPU pool, not as in an isolated call;
- CPU pool (``CpuExpertPool`` via the engine, cold experts): time per call of 1..8 experts (fit:
  task + experts x bytes / GB/s), other quant types and thread counts (not with ``--quick``), and
  the host memory read bandwidth.

``--cpu-only`` (no GPU needed): measures the CPU pool, memory bandwidth, planning and polling, and
writes them over the GPU and link fields of ``--base FILE`` (a hardware JSON), without executor
host-lane costs. Whatever kernels ``execute/cpu_experts.py`` has at run time are what is measured.
"""
from __future__ import annotations

import argparse
import gc
from importlib import resources
import json
import os
import platform
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from scheduler.args import ArgumentParser
from scheduler.core import Capacity, Decision, Geometry, Step, Token
from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from scheduler.files import OutputPathError, atomic_write, check_output
from scheduler.policies import make_policy

from . import quant as Q
from .experts import LayerExperts, random_layer

__all__ = ["main", "stats", "fit_line", "hardware_json", "write_json", "build_layers", "StandIn",
           "measure_plan_s", "measure_poll_s", "measure_cpu_mem_gbps", "measure_cpu_pool", "synth_tokens",
           "replay_engine", "replay_host_fields", "replay_pool_fit", "replay_between_fields", "apply_between",
           "calibration_replay", "calibration_runs", "decision_totals", "stats_delta", "unlogged_host_fields",
           "replay_summary", "apply_replay"]

PLAN_POLICIES = ("cpu", "gpu", "lru", "freq-lru", "static", "hybrid", "hybrid-cost")
SPIN_S = 0.004  # how long the spin kernel holds a stream while work is queued behind it


# statistics ------------------------------------------------------------------------------------
def stats(samples) -> dict:
    """Median, 10th/90th percentiles and count of ``samples`` (ValueError when empty)."""
    a = np.asarray(list(samples), np.float64)
    if a.size == 0:
        raise ValueError("stats: no samples")
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(a.size)}


def fit_line(x, y) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns (a, b). Needs two distinct x."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or len(np.unique(x)) < 2:
        raise ValueError(f"fit_line: need matching x, y with two distinct x (got {x.tolist()})")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def fit_table(table: dict) -> tuple[float, float]:
    """Fit ``median = a + b x`` over a {x: stats} table."""
    xs = sorted(table, key=float)
    return fit_line([float(x) for x in xs], [table[x]["median"] for x in xs])


# CPU-side measurements (no GPU) ----------------------------------------------------------------
def build_layers(rng: np.random.Generator, num_layers: int, num_experts: int, hidden: int, ffn: int,
                 qtype: int = Q.Q8_0, distinct: int = 4) -> list[LayerExperts]:
    """Random experts in host RAM: ``distinct`` random layers, the rest copies in their own memory."""
    layers = []
    for l in range(num_layers):
        if l < distinct:
            layers.append(random_layer(rng, l, num_experts, hidden, ffn, qtype, exact=False))
        else:
            src = layers[l % distinct]
            layers.append(LayerExperts(l, *(replace(t, data=t.data.copy(), name=t.name.replace(
                f"blk.{l % distinct}.", f"blk.{l}.")) for t in (src.gate, src.up, src.down))))
    return layers


def synth_tokens(num_layers: int, num_experts: int, top_k: int, num_tokens: int, seed: int):
    """Scheduler tokens of a synthetic trace (the qwen3-30b-a3b preset's parameters) and the trace."""
    from traces import synth

    preset = synth.PRESETS.get("qwen3-30b-a3b")
    params = preset.params if preset is not None else synth.SynthParams()
    trace = synth.generate(num_layers, num_experts, top_k, num_tokens, params, np.random.default_rng(seed))
    return tuple(trace.tokens()), trace


def measure_plan_s(geometry: Geometry, slots: int, tokens, policies=PLAN_POLICIES, reps: int = 3,
                   cost_model=None) -> dict:
    """Scheduler time per layer step (``drive`` alone, no backend) for each policy: {name: stats}.

    ``hybrid-cost`` prices its decisions with ``cost_model`` (default: qwen3-30b-a3b's on the
    h200-xeon16 preset, its layers repeated to ``geometry``'s count: the planning work is what is
    timed here, not the quality of its split)."""
    if "hybrid-cost" in policies and cost_model is None:
        from scheduler.costs import Costs
        from scheduler.hardware import load_hardware
        from scheduler.models import load_model

        full = Costs(load_model("qwen3-30b-a3b"), load_hardware("h200-xeon16")).cost_model()
        cost_model = full.of_layers([l % len(full.upload_s) for l in range(geometry.num_layers)])
    out = {}
    for name in policies:
        samples = []
        for _ in range(reps):
            cap = Capacity.per_layer(geometry, geometry.max_experts if name == "gpu" else slots)
            pol = make_policy(name, geometry, cap, tokens=tokens, cost_model=cost_model)  # static: the tokens' counts
            steps = 0
            t0 = time.perf_counter()
            for item in drive(pol, tokens):
                if type(item) is RunLayer:
                    steps += 1
            samples.append((time.perf_counter() - t0) / max(steps, 1))
        out[name] = stats(samples)
    return out


def measure_poll_s(reps: int = 200) -> dict:
    """Actual duration of the engine's polling sleep (``time.sleep(20e-6)`` in ``GpuExperts.wait``)."""
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        time.sleep(20e-6)
        samples.append(time.perf_counter() - t0)
    return stats(samples)


def measure_cpu_mem_gbps(threads: int, nbytes: int = 1 << 30, reps: int = 5) -> dict:
    """Host memory read GB/s with a Numba parallel sum over ``nbytes`` of float32 (``threads`` threads)."""
    import numba

    parallel_sum = _parallel_sum()
    a = np.ones(nbytes // 4, np.float32)
    old = numba.get_num_threads()
    numba.set_num_threads(threads)
    try:
        parallel_sum(a[:1024])
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            parallel_sum(a)
            samples.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    finally:
        numba.set_num_threads(old)
    return stats(samples)


_SUM = []


def _parallel_sum():
    """A Numba ``prange`` sum of a float32 array (compiled on first use)."""
    if not _SUM:
        from numba import njit, prange

        @njit(parallel=True, fastmath=True)
        def parallel_sum(a):  # a: (n,) float32
            s = np.float32(0.0)
            for i in prange(a.size):
                s += a[i]
            return s

        _SUM.append(parallel_sum)
    return _SUM[0]


def measure_cpu_pool(layers: list[LayerExperts], threads: int, counts=(1, 2, 3, 4, 6, 8), reps: int = 5,
                     seed: int = 0) -> dict:
    """``CpuExpertPool`` compute time per call of n cold experts (one token each): {n: stats}, the
    wall time of submit -> result beyond the compute (the two thread hand-offs), and its parts:
    submit -> worker start and worker end -> caller resumes (``CpuJob`` stamps)."""
    from .cpu_experts import CpuExpertPool

    rng = np.random.default_rng(seed)
    hidden = layers[0].hidden
    out, handoff, start, ret = {}, [], [], []
    with CpuExpertPool(threads, timeout_s=120) as pool:
        pool.warmup(layers[0])
        for n in counts:
            samples = []
            for r in range(reps + 1):
                lx = layers[int(rng.integers(len(layers)))]
                experts = rng.choice(lx.num_experts, n, replace=False)
                x = rng.standard_normal((n, hidden)).astype(np.float32)
                t0 = time.perf_counter()
                job = pool.submit(lx, experts, x)
                job.result()
                wall = time.perf_counter() - t0
                if r:  # the first of each size is a warm-up
                    samples.append(job.compute_s)
                    handoff.append(wall - job.compute_s)
                    start.append(job.started_s - job.submitted_s)
                    ret.append(job.collected_s - job.finished_s)
            out[n] = stats(samples)
    return {"compute_s": out, "handoff_s": stats(handoff), "start_s": stats(start), "return_s": stats(ret)}


# the dense stand-in (GPU) ----------------------------------------------------------------------
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


# GPU measurements ------------------------------------------------------------------------------
_SPIN_SRC = r"""
extern "C" __global__ void moelab_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class GpuTimer:
    """GPU time of queued work (events, stream held by a spin kernel) and host time of queueing it."""

    def __init__(self, cp):
        self.cp = cp
        self.spin_kernel = cp.RawKernel(_SPIN_SRC, "moelab_spin")

    def spin(self, stream, seconds: float = SPIN_S) -> None:
        with stream:
            self.spin_kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))

    def gpu(self, stream, fn, reps: int, hold=None) -> dict:
        """GPU seconds of ``fn()`` on ``stream`` (``hold``: the stream to spin, default ``stream``)."""
        cp = self.cp
        samples = []
        for r in range(reps + 1):
            self.spin(hold or stream)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            if hold is not None and hold is not stream:
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(hold)
                stream.wait_event(ev)
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            if r:
                samples.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        return stats(samples)

    def host(self, stream, fn, reps: int) -> dict:
        """Host seconds per call of ``fn()`` (async work), ``reps + 1`` calls back to back behind one
        spin (nothing blocks), the first a warm-up: the thread stays busy, as in a replay. (Timing
        each call after a synchronisation instead measured it cold: about twice as long on the H200
        box.)"""
        samples = []
        self.spin(stream)
        for r in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r:
                samples.append(dt)
        stream.synchronize()
        return stats(samples)


def _gpu_basics(cp, timer: GpuTimer, reps: int) -> dict:
    s = cp.cuda.Stream(non_blocking=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    free, total = cp.cuda.runtime.memGetInfo()
    n = 1 << 30
    src, dst = cp.empty(n, cp.uint8), cp.empty(n, cp.uint8)
    d2d = timer.gpu(s, lambda: dst.data.copy_from_device_async(src.data, n, s), reps)
    del src, dst
    a = cp.ones((8192, 8192), cp.float16)
    with s:
        mm = timer.gpu(s, lambda: cp.matmul(a, a), reps)
    del a
    tiny = cp.ones(1, cp.float32)
    with s:
        launch = timer.host(s, lambda: [tiny * 2 for _ in range(50)], reps)
    launch = {k: (v / 50 if k != "n" else v) for k, v in launch.items()}
    return {"gpu_name": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "gpu_mem_bytes": int(total), "d2d_gbps": 2 * n / d2d["median"] / 1e9, "d2d_s": d2d,
            "matmul_tflops": 2 * 8192 ** 3 / mm["median"] / 1e12, "matmul_s": mm, "launch_s": launch}


def _link(cp, timer: GpuTimer, reps: int) -> dict:
    sizes = [1 << 16, 1 << 20, 5 << 20, 16 << 20, 64 << 20]
    s = cp.cuda.Stream(non_blocking=True)
    hold = cp.cuda.Stream(non_blocking=True)
    dev = cp.empty(max(sizes) * 4, cp.uint8)
    out = {"pinned": {}, "pageable": {}}
    for kind in ("pinned", "pageable"):
        host = np.ones(max(sizes) * 4, np.uint8)
        if kind == "pinned":
            cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
        try:
            for size in sizes:
                if kind == "pageable" and size < (1 << 20):
                    continue

                def copies(size=size):
                    for i in range(4):
                        cp.cuda.runtime.memcpyAsync(dev.data.ptr + i * size, host.ctypes.data + i * size, size,
                                                    cp.cuda.runtime.memcpyHostToDevice, s.ptr)
                st = timer.gpu(s, copies, reps, hold=hold) if kind == "pinned" else _wall(s, copies, reps)
                out[kind][size] = {k: (v / 4 if k != "n" else v) for k, v in st.items()}
        finally:
            if kind == "pinned":
                cp.cuda.runtime.hostUnregister(host.ctypes.data)
    a, b = fit_table({k: v for k, v in out["pinned"].items() if k >= (1 << 20)})
    out["pinned_fit"] = {"latency_s": max(a, 0.0), "gbps": 1 / b / 1e9}
    big = max(out["pageable"])
    out["pageable_gbps"] = big / out["pageable"][big]["median"] / 1e9
    return out


def _wall(stream, fn, reps: int) -> dict:
    """Wall seconds of ``fn()`` until ``stream`` is done (pageable copies block the host anyway)."""
    samples = []
    for r in range(reps + 1):
        stream.synchronize()
        t0 = time.perf_counter()
        fn()
        stream.synchronize()
        if r:
            samples.append(time.perf_counter() - t0)
    return stats(samples)


def _meta(gx, n: int):
    """Kernel metadata of ``n`` resident experts of layer 0 (slots 0..n-1), one token each, as the
    engine sends it."""
    return gx.layer_meta([gx.source_ptr(0, s) for s in range(n)], list(range(n + 1)), [0] * n, list(range(n)),
                         [1.0 / n] * n, n)


def _experts_gpu(cp, timer: GpuTimer, gx, layers, reps: int) -> dict:
    """Expert uploads, GPU expert batches (metadata copy + kernels, as the engine queues them) and
    the combine, through ``GpuExperts``; host time of each per-layer call."""
    hidden = layers[0].hidden
    with gx.compute:
        x1 = gx.as_input(cp.asarray(np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32)))
    out = {"upload": {}, "upload_host": {}, "batch": {}, "calls_host": {}}
    L = len(layers)
    for n in (1, 2, 4, 8):
        def up(n=n):
            gx.begin_copies()
            for i in range(n):
                gx.upload(i % L, 16 + i, 16 + i)
        samples = []
        for r in range(reps + 1):
            # the copy stream waits for last_read, recorded after a spin on the compute stream
            timer.spin(gx.compute)
            gx.last_read.record(gx.compute)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            gx.begin_copies()
            a.record(gx.copy)
            up()
            b.record(gx.copy)
            b.synchronize()
            if r:
                samples.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        out["upload"][n] = stats(samples)
        out["upload_host"][n] = timer.host(gx.compute, up, reps)
    gx.pair_outputs(0, 16)  # work buffers for up to 16 pairs
    for n in (1, 2, 4, 8, 12, 16):
        out["batch"][n] = timer.gpu(gx.compute, lambda n=n: gx.run_groups(0, _meta(gx, n), 0, n, x1, n), reps)
    meta8 = _meta(gx, 8)
    y8 = gx.pair_outputs(0, 8)
    out["combine"] = timer.gpu(gx.compute, lambda: gx.combine_meta(meta8, y8), reps)
    calls = {"layer_meta": lambda: _meta(gx, 8), "expert_call": lambda: gx.run_groups(0, meta8, 0, 8, x1, 8),
             "combine": lambda: gx.combine_meta(meta8, y8)}
    for name, fn in calls.items():
        out["calls_host"][name] = timer.host(gx.compute, fn, reps)
    gx.wait(gx.all_done_event(), "calibration kernels")
    return out


def _dense(cp, timer: GpuTimer, gx, args, reps: int) -> dict:
    """The stand-in at four widths (GPU time), its host issue time (layer and head), the read-back
    and its error against a float64 reference."""
    out = {"gpu": {}, "bytes": {}}
    with gx.compute:
        x = cp.ones((1, args.hidden), cp.float32)
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    for f in (0.25, 0.5, 1.0, 2.0):
        sd = StandIn(cp, 1, args.hidden, max(32, int(q * f)), max(32, int(kv * f)), args.experts, 0, args.seed)
        with gx.compute:
            out["gpu"][f] = timer.gpu(gx.compute, lambda: sd.layer(x, 0), reps)
        out["bytes"][f] = sd.layer_bytes
    sd = StandIn(cp, 1, args.hidden, q, kv, args.experts, args.vocab, args.seed)
    with gx.compute:
        out["host"] = timer.host(gx.compute, lambda: sd.layer(x, 0), reps)
        out["head_host"] = timer.host(gx.compute, lambda: sd.head(x), reps)
        out["head_gpu"] = timer.gpu(gx.compute, lambda: sd.head(x), reps)
        xr = cp.asarray(np.random.default_rng(1).standard_normal((1, args.hidden)).astype(np.float32))
        y, logits = sd.layer(xr, 0)
        ry, rl = sd.reference(xr.get(), 0)
        out["rel_err"] = max(float(np.linalg.norm(y.get() - ry) / np.linalg.norm(ry)),
                             float(np.linalg.norm(logits.get() - rl) / np.linalg.norm(rl)))
    out["head_bytes"] = sd.head_bytes
    samples = []
    for r in range(reps * 4 + 1):
        gx.compute.synchronize()
        t0 = time.perf_counter()
        logits.get(stream=gx.compute)
        if r:
            samples.append(time.perf_counter() - t0)
    out["readback"] = stats(samples)
    a, b = fit_line([out["bytes"][f] for f in out["gpu"]], [v["median"] for v in out["gpu"].values()])
    out["fit"] = {"fixed_s": max(a, 0.0), "gbps": 1 / b / 1e9}
    return out


_PHASES = ("host_plan_s", "input_wait_s", "host_queue_s", "host_combine_s", "cpu_compute_s")


def cpu_layer_parts(t_call: float, t_ret: float, d: dict, job) -> dict:
    """One layer with CPU experts split into the engine's phases (seconds), from the host clock
    around ``run_layer`` (``t_call``, ``t_ret``), its ``LayerStats`` deltas ``d`` and the CPU job's
    stamps: plan (before anything is queued), submit (input fetch and row gather up to the submit),
    handoff (the submit's rest and the GIL hand-off), queue (GPU work queued while the pool runs),
    start (submit -> the pool starts), compute, ret (pool done -> caller resumes), combine (rows'
    upload and combine queued)."""
    t1 = t_call + d["host_plan_s"]
    return {"plan": d["host_plan_s"], "submit": job.submitted_s - t1,
            "handoff": t1 + d["input_wait_s"] - job.submitted_s, "queue": d["host_queue_s"],
            "start": job.started_s - job.submitted_s, "compute": job.finished_s - job.started_s,
            "ret": job.collected_s - job.finished_s, "combine": t_ret - job.collected_s}


def _engine(cp, timer: GpuTimer, engine, layers, reps: int, seed: int) -> dict:
    """Host time of ``ExpertEngine.run_layer`` by phase: hits-only and upload layers (whole, plan,
    queue, combine), and layers with one hit and 1..8 CPU experts (``cpu_layer_parts``)."""
    rng = np.random.default_rng(seed)
    hidden, L = layers[0].hidden, len(layers)
    with engine.gpu.compute:
        x = cp.asarray(rng.standard_normal((1, hidden)).astype(np.float32))
    engine.load_residents({(l, e): e for l in range(L) for e in range(16)})
    tok = Token(0, 0, 0, "decode", ())
    st = engine.stats
    snap = lambda: {k: getattr(st, k) for k in _PHASES}

    def item(l, hits=(), uploads=(), cpu=()):
        experts = tuple(hits) + tuple(uploads) + tuple(cpu)
        step = Step(l, experts)
        d = Decision(step, tuple(hits), tuple(uploads), tuple(16 + i for i in range(len(uploads))), (), tuple(cpu))
        ids = np.asarray(experts, np.int64)[None, :]
        return RunLayer(tok, step, d), ids, np.full(ids.shape, 1.0 / len(experts), np.float32)

    def gpu_only(make) -> dict:
        """Layers back to back without waiting for the GPU (fewer than the 16 metadata buffers, so
        the host never waits for one): warm, as in a replay, where only the short router
        read-back separates them."""
        parts = {"whole": [], "plan": [], "queue": [], "combine": []}
        engine.synchronize()
        for r in range(reps + 1):
            it, ids, w = make(r)
            s0 = snap()
            t0 = time.perf_counter()
            engine.run_layer(it, x, ids, w)
            dt = time.perf_counter() - t0
            s1 = snap()
            if r:
                for k, ph in (("whole", None), ("plan", "host_plan_s"), ("queue", "host_queue_s"),
                              ("combine", "host_combine_s")):
                    parts[k].append(dt if ph is None else s1[ph] - s0[ph])
        engine.synchronize()
        return {k: stats(v) for k, v in parts.items()}

    out = {"hits": {}, "uploads": {}, "cpu_layer": {}}
    for n in (1, 2, 4, 8):
        out["hits"][n] = gpu_only(lambda r, n=n: item(r % L, hits=range(n)))
        out["uploads"][n] = gpu_only(lambda r, n=n: item(r % L, uploads=range(16, 16 + n)))
    engine.pool.warmup(layers[0])
    jobs = []
    submit = engine.pool.submit

    def capture(*a, **k):
        jobs.append(submit(*a, **k))
        return jobs[-1]

    engine.pool.submit = capture  # the engine's CPU jobs, for their stamps
    try:
        for n in (1, 2, 4, 8):
            parts: dict[str, list] = {}
            for r in range(reps + 1):
                l = int(rng.integers(L))
                cpu = tuple(int(e) for e in rng.choice(np.arange(16, layers[l].num_experts), n, replace=False))
                it, ids, w = item(l, hits=(0,), cpu=cpu)
                engine.synchronize()
                s0 = snap()
                t0 = time.perf_counter()
                engine.run_layer(it, x, ids, w)
                t1 = time.perf_counter()
                s1 = snap()
                engine.synchronize()
                if r:
                    d = {k: s1[k] - s0[k] for k in _PHASES}
                    for k, v in cpu_layer_parts(t0, t1, d, jobs[-1]).items():
                        parts.setdefault(k, []).append(v)
            out["cpu_layer"][n] = {k: stats(v) for k, v in parts.items()}
    finally:
        del engine.pool.submit
    return out


def replay_engine(cp, engine, policy, tokens, dense, x0, layer_log: list | None = None) -> tuple[list, list, list]:
    """Decode ``tokens`` through ``engine`` under ``policy`` as a replay does: per layer the dense
    stand-in, the router logits read back, ``run_layer`` (equal router weights); per token the
    head and its sampled id read back. No garbage collection inside (collected before).

    Returns (scheduler items, wall seconds per token, the CPU jobs). With ``layer_log`` (a list), appends per
    layer the decision's sizes (``n_gpu``, ``n_up``: uploads + streams, ``n_cpu``), the host time
    of the dense issue (``dense_s``), the engine's phase deltas (``_PHASES``), for a layer with
    CPU experts its ``cpu_layer_parts`` (``parts``), and the host's time between layers: in the
    driver producing this step (``sched_s``: the policy's plan and commit, the previous step's
    completions), reading the router logits back (``read_s``, including any wait for the GPU)
    and, after another layer of the same token, from that layer's ``run_layer`` return to this
    one's call (``gap_s``; the logging itself left out)."""
    gx = engine.gpu
    k = policy.geometry.top_k
    w = np.full((1, k), 1.0 / k, np.float32)
    st = engine.stats
    snap = lambda: {p: getattr(st, p) for p in _PHASES}
    jobs = []
    submit = engine.pool.submit

    def capture(*a, **kw):  # the engine's CPU jobs, for their stamps
        jobs.append(submit(*a, **kw))
        return jobs[-1]

    engine.pool.submit = capture
    items, times = [], []
    x = x0
    gc.collect()
    gc.disable()  # a collection inside a timed token is noise no model describes
    try:
        with gx.compute:
            t_prev = time.perf_counter()
            t_body = t_prev  # end of the previous item's handling: the driver's time starts there
            t_layer = None  # the previous layer's run_layer return (logging left out), same token only
            for item in drive(policy, tokens):
                t_item = time.perf_counter()
                items.append(item)
                kind = type(item)
                if kind is RunLayer:
                    t_d = time.perf_counter()
                    x, logits = dense.layer(x, item.step.layer)
                    t_r = time.perf_counter()
                    logits.get(stream=gx.compute)  # the router's read-back
                    t_g = time.perf_counter()
                    ids = np.asarray(item.step.experts, np.int64)[None, :]
                    if layer_log is None:
                        x = engine.run_layer(item, x, ids, w[:, :ids.shape[1]])
                        continue
                    t_call = time.perf_counter()
                    n_jobs, s0, t0 = len(jobs), snap(), time.perf_counter()
                    x = engine.run_layer(item, x, ids, w[:, :ids.shape[1]])
                    t1, s1, d = time.perf_counter(), snap(), item.decision
                    rec = {"dense_s": t_r - t_d, "sched_s": t_item - t_body, "read_s": t_g - t_r,
                           "n_gpu": len(d.hits) + len(d.uploads) + len(d.streams),
                           "n_up": len(d.uploads) + len(d.streams), "n_cpu": len(d.cpu),
                           **{p: s1[p] - s0[p] for p in _PHASES}}
                    if t_layer is not None:
                        rec["gap_s"] = t_call - t_layer
                    if len(jobs) > n_jobs:
                        rec["parts"] = cpu_layer_parts(t0, t1, rec, jobs[-1])
                    layer_log.append(rec)
                    t_body = t_layer = time.perf_counter()  # from here: the logging is not counted
                    continue
                t_layer = None
                if kind is StartBackground:
                    engine.start_background(item.moves)
                elif kind is AwaitBackground:
                    engine.await_background(item.moves)
                elif kind is EndToken:
                    dense.head(x).get(stream=gx.compute)  # the sampled id's read-back
                    t = time.perf_counter()
                    times.append(t - t_prev)
                    t_prev = t
                    x = x0
                t_body = time.perf_counter()
    finally:
        gc.enable()
        del engine.pool.submit
    return items, times, jobs


def replay_host_fields(records: list[dict]) -> dict:
    """The executor's host-lane fields (``scheduler.hardware.EXECUTOR_KEYS``) from a replay's
    per-layer records (``replay_engine``'s ``layer_log``, in replay order).

    GPU-only layers: the plan's growth per copy of the previous record (copies in flight) by
    least squares, its level and the combine as medians; queue = fixed + per further GPU expert +
    once per layer with copies (the copy round) + per copy (least squares). Layers with CPU
    experts (``parts``): their plan beyond a GPU-only layer's and the submit count as
    ``host_cpu_submit_s``; hand-off, pool start, pool end -> caller and combine medians; the
    queue less the per-expert and copy terms. Raises ValueError when the records lack either
    kind of layer."""
    prev = [0] + [r["n_up"] for r in records[:-1]]
    gpu = [(r, u) for r, u in zip(records, prev) if r["n_cpu"] == 0 and r["n_gpu"] > 0]
    cpu = [(r, u) for r, u in zip(records, prev) if "parts" in r]
    if len(gpu) < 8 or len(cpu) < 8:
        raise ValueError(f"replay_host_fields: {len(gpu)} GPU-only and {len(cpu)} CPU layers, expected >= 8 of each")
    med = lambda v: float(np.median(v))
    lsq = lambda rows, y: np.linalg.lstsq(np.array(rows, np.float64), np.array(y), rcond=None)[0]
    plan_copy = max(float(lsq([[1.0, u] for _, u in gpu], [r["host_plan_s"] for r, _ in gpu])[1]), 0.0)
    q_fixed, q_expert, q_round, q_copy = (max(float(c), 0.0) for c in lsq(
        [[1.0, r["n_gpu"] - 1, r["n_up"] > 0, r["n_up"]] for r, _ in gpu], [r["host_queue_s"] for r, _ in gpu]))
    plan = med([r["host_plan_s"] - plan_copy * u for r, u in gpu])
    combine = med([r["host_combine_s"] for r, _ in gpu])
    part = lambda k: med([r["parts"][k] for r, _ in cpu])
    mixed = [r for r, _ in cpu if r["n_gpu"]]
    copies = lambda r: q_expert * (r["n_gpu"] - 1) + q_round * (r["n_up"] > 0) + q_copy * r["n_up"]
    cpu_queue = med([r["parts"]["queue"] - copies(r) for r in mixed]) if mixed else q_fixed
    cpu_plan = med([r["parts"]["plan"] - plan_copy * u for r, u in cpu])
    return {"host_dense_s": med([r["dense_s"] for r in records]),
            "host_layer_plan_s": plan, "host_layer_combine_s": combine, "host_plan_copy_s": plan_copy,
            "host_gpu_layer_s": plan + q_fixed + combine, "host_gpu_expert_s": q_expert,
            "host_copy_round_s": q_round, "host_copy_s": q_copy,
            "host_cpu_submit_s": max(cpu_plan - plan + part("submit"), 0.0),
            "host_cpu_handoff_s": max(part("handoff"), 0.0), "host_cpu_queue_s": max(cpu_queue, 0.0),
            "host_cpu_combine_s": max(part("combine"), 0.0), "cpu_start_s": max(part("start"), 0.0),
            "cpu_return_s": max(part("ret"), 0.0)}


POOL_MIN_CALLS = 8  # calls of one expert count needed before that count gets its own factor


def replay_pool_fit(records: list[dict]) -> dict:
    """The CPU pool's cost per call as a replay sees it (between layers, after idling while the
    GPU-only layers run): least squares of each CPU layer's compute time (job start -> end) on
    its expert count -> {"task_s", "expert_s", "by_count": {n: stats + mean}, "factor": {n: mean
    / (task_s + n x expert_s)}} with a factor for each count of at least ``POOL_MIN_CALLS`` calls
    (the mean, as the fit: a run's tokens/s follows the sum of its calls' times)."""
    cpu = [r for r in records if "parts" in r]
    counts = sorted({r["n_cpu"] for r in cpu})
    if len(counts) < 2:
        raise ValueError(f"replay_pool_fit: CPU layers with expert counts {counts}, expected two or more counts")
    a = np.array([[1.0, r["n_cpu"]] for r in cpu])
    task, per = np.linalg.lstsq(a, np.array([r["parts"]["compute"] for r in cpu]), rcond=None)[0]
    task = max(float(task), 0.0)
    by, factor = {}, {}
    for n in counts:
        v = [r["parts"]["compute"] for r in cpu if r["n_cpu"] == n]
        by[n] = {**stats(v), "mean": float(np.mean(v))}
        fit = task + n * float(per)
        if len(v) >= POOL_MIN_CALLS and fit > 0:
            factor[n] = min(max(by[n]["mean"] / fit, 0.25), 4.0)
    return {"task_s": task, "expert_s": float(per), "by_count": by, "factor": factor}


BETWEEN_MIN_LAYERS = 8  # layers with a gap_s needed before the between-layer fields are taken


def replay_between_fields(records: list[dict]) -> dict | None:
    """The host's time between layers in a replay (``replay_engine``'s ``sched_s``, ``read_s``,
    ``gap_s``) -> {"host_dense_s": median of gap - driver - read-back (the dense issue and the
    loop's own work), "readback_s": median read-back of layers after a layer without copies (the
    GPU has little queued), "sched_s": {policy: median driver time per step} for records tagged
    with a ``policy``}; None for records without ``gap_s`` (recorded before it existed) or with
    fewer than ``BETWEEN_MIN_LAYERS`` of them."""
    gap = [r for r in records if "gap_s" in r]
    if len(gap) < BETWEEN_MIN_LAYERS:
        return None
    prev = [None] + records[:-1]
    quiet = [r["read_s"] for r, q in zip(records, prev) if "gap_s" in r and q is not None and q["n_up"] == 0]
    sched: dict[str, list] = {}
    for r in records:
        if "policy" in r:
            sched.setdefault(r["policy"], []).append(r["sched_s"])
    return {"host_dense_s": max(float(np.median([r["gap_s"] - r["sched_s"] - r["read_s"] for r in gap])), 0.0),
            "readback_s": float(np.median(quiet or [r["read_s"] for r in gap])),
            "sched_s": {p: float(np.median(v)) for p, v in sched.items()}}


def apply_between(executor: dict, between: dict, src: dict | None = None) -> dict:
    """``executor`` (a hardware file's block) with the between-layer host costs of
    ``replay_between_fields``: ``host_dense_s``, ``readback_s``, and ``plan_s`` of each replayed
    policy as the driver's median time per step there; the other policies' ``plan_s`` move by the
    mean difference (replay - file) over the replayed ones (the driver's own work, common to all)."""
    ex = dict(executor, host_dense_s=between["host_dense_s"], readback_s=between["readback_s"])
    plan = dict(ex.get("plan_s", {}))
    known = {p: v for p, v in between["sched_s"].items() if p in plan}
    shift = float(np.mean([v - plan[p] for p, v in known.items()])) if known else 0.0
    ex["plan_s"] = {p: between["sched_s"].get(p, max(v + shift, 0.0)) for p, v in plan.items()}
    for p, v in between["sched_s"].items():
        ex["plan_s"].setdefault(p, v)
    if src is not None:
        src["executor.between"] = ("measured: host time between layers in the calibration replay (replay_engine: "
                                   "driver per step -> plan_s of the replayed policies, others shifted by their mean "
                                   "difference; read-back after copy-free layers -> readback_s; the rest of the gap "
                                   "between run_layer calls -> host_dense_s)")
    return ex


REPLAY_CONFIGS = (("lru", {}), ("hybrid", {"adaptive": True, "miss_frac_256": 96}))
HYBRID_96 = {"adaptive": True, "miss_frac_256": 96}
# the unlogged calibration runs: (policy, options, cache as a divisor of the experts per layer)
RUN_CONFIGS = (("lru", {}, 5), ("lru", {}, 2), ("hybrid", HYBRID_96, 5))
RUN_PHASES = ("host_plan_s", "host_queue_s", "host_combine_s", "input_wait_s", "cpu_wait_s")


def _replay_setup(cp, gx, layers, args, dense):
    """(geometry, the calibration trace's tokens, dense stand-in, layer input) for the calibration replays."""
    L, E = len(layers), layers[0].num_experts
    geo = Geometry((E,) * L, args.top_k, (layers[0].expert_bytes,) * L)
    tokens, _ = synth_tokens(L, E, args.top_k, 64, args.seed + 31)
    if dense is None:
        dense = StandIn(cp, L, args.hidden, args.heads * args.head_dim, args.kv_heads * args.head_dim, E,
                        args.vocab, args.seed)
    with gx.compute:
        x0 = cp.asarray(np.random.default_rng(args.seed + 5).standard_normal((1, args.hidden)).astype(np.float32))
    return geo, tokens, dense, x0


def calibration_replay(cp, gx, layers, args, dense=None) -> list[dict]:
    """Per-layer records (``replay_engine``'s ``layer_log``) of the calibration workload: a
    64-token synthetic trace of its own seed (``args.seed + 31``) replayed under lru and hybrid
    (miss fraction 96/256) with a cache of 20% of the experts, after 16 unlogged tokens each."""
    from .engine import ExpertEngine

    geo, tokens, dense, x0 = _replay_setup(cp, gx, layers, args, dense)
    records: list[dict] = []
    for name, opts in REPLAY_CONFIGS:
        cap = Capacity.per_layer(geo, max(args.top_k, geo.max_experts // 5))
        pol = make_policy(name, geo, cap, **opts)
        engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
        try:
            engine.load_residents(pol.cache.slot)
            replay_engine(cp, engine, pol, tokens[:16], dense, x0)  # warm: the policy's cache fills
            n0 = len(records)
            replay_engine(cp, engine, pol, tokens[16:], dense, x0, records)
            for r in records[n0:]:
                r["policy"] = name
            engine.synchronize()
        finally:
            engine.close()
    return records


def decision_totals(items) -> dict:
    """Totals over the ``RunLayer`` items of a replay: ``uploads`` (uploads + streams),
    ``copy_layers`` (layers with any), ``cpu_layers`` (layers with CPU experts), ``cpu_experts``,
    ``gpu_experts`` (hits + uploads + streams) and ``gpu_layers`` (layers with any)."""
    out = dict.fromkeys(("layers", "uploads", "copy_layers", "cpu_layers", "cpu_experts", "gpu_experts",
                         "gpu_layers"), 0)
    for item in items:
        if type(item) is not RunLayer:
            continue
        d = item.decision
        nu, nc = len(d.uploads) + len(d.streams), len(d.cpu)
        ng = len(d.hits) + nu
        out["layers"] += 1
        out["uploads"] += nu
        out["copy_layers"] += nu > 0
        out["cpu_layers"] += nc > 0
        out["cpu_experts"] += nc
        out["gpu_experts"] += ng
        out["gpu_layers"] += ng > 0
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """``{"steps", "host_s": {phase: seconds}}`` between two snapshots of the engine's counters
    (``{"steps", *RUN_PHASES}``), as ``experiments/sim_vs_real.py`` records its checked runs."""
    return {"steps": after["steps"] - before["steps"], "host_s": {p: after[p] - before[p] for p in RUN_PHASES}}


def calibration_runs(cp, gx, layers, args, dense=None) -> list[dict]:
    """Aggregates of UNLOGGED replays of the calibration trace (``RUN_CONFIGS``: lru at a fifth and
    at half of the experts, hybrid 96/256 at a fifth), each after 16 warm-up tokens: per run the
    engine's phase totals and steps (``stats_delta``), the decisions' ``decision_totals`` and the
    wall seconds per token (``token_s``). Per-layer logging slows the engine's own phases at a high
    hit rate, and the checked replays are unlogged: these runs time the same way."""
    from .engine import ExpertEngine

    geo, tokens, dense, x0 = _replay_setup(cp, gx, layers, args, dense)
    snap = lambda st: {"steps": st.steps, **{p: getattr(st, p) for p in RUN_PHASES}}
    out = []
    for name, opts, div in RUN_CONFIGS:
        slots = max(args.top_k, geo.max_experts // div)
        cap = Capacity.per_layer(geo, slots)
        pol = make_policy(name, geo, cap, **opts)
        engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
        try:
            engine.load_residents(pol.cache.slot)
            replay_engine(cp, engine, pol, tokens[:16], dense, x0)  # warm: the policy's cache fills
            s0 = snap(engine.stats)
            items, times, _ = replay_engine(cp, engine, pol, tokens[16:], dense, x0)
            out.append({"policy": name, "slots": slots, **opts, **stats_delta(s0, snap(engine.stats)),
                        **decision_totals(items), "token_s": times})
        finally:
            engine.close()
    return out


def _lsq(rows, y) -> np.ndarray | None:
    """Least squares of ``y`` on ``rows``; None when the columns are not independent (too few configs)."""
    a = np.array(rows, np.float64)
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return np.linalg.lstsq(a, np.array(y, np.float64), rcond=None)[0]


def unlogged_host_fields(runs: list[dict], fields: dict) -> dict | None:
    """The GPU-only-layer host-lane fields from unlogged calibration runs (``calibration_runs``),
    over the logged fit ``fields`` (``replay_host_fields``) -> {"fields": the replaced fields,
    "fit": per phase its coefficients, "runs": count}; None without runs, or when the runs do not
    determine the fit (fewer than three configs of independent counts).

    Per phase, least squares over runs of (phase total / steps) on per-step counts, one column per
    model field it sets, so that three configs (any number of rounds) determine it:
    plan on [1, uploads, CPU layers] -> ``host_layer_plan_s``, ``host_plan_copy_s`` (per copy: a
    step's copies equal the next step's copies of the previous layer, up to one layer per run);
    queue less the logged ``host_gpu_expert_s`` per further GPU expert on [1, copy cost, CPU
    layers], copy cost = (``host_copy_round_s`` x layers with copies + ``host_copy_s`` x copies) of
    the logged fit, whose coefficient scales both (the logged replay gives the split between a
    copy round and a copy; [1, uploads, CPU layers] where both are 0) -> the GPU-only queue level,
    ``host_copy_round_s``, ``host_copy_s``; combine on [1, CPU layers] -> ``host_layer_combine_s``.
    The CPU-layer column absorbs those layers' own parts, which stay the logged fit's:
    ``host_cpu_submit_s`` takes the change of ``host_layer_plan_s`` so that a CPU layer's plan is
    charged as logged (the terms both kinds of layer share, per copy, per previous copy and per
    further GPU expert, are the unlogged fit's in CPU layers too). Coefficients below 0 are taken as 0, except a queue level below 0 (the
    runs' GPU-only layers all hold about top-k experts, so level and per-expert term are not
    separable in them): then ``host_gpu_expert_s`` takes the deficit over the GPU-only runs' mean
    further experts per layer, so that their queue is charged as fit."""
    runs = [r for r in runs or () if r.get("steps")]
    if not runs:
        return None
    per = lambda r, k: r[k] / r["steps"]
    rnd, cp_ = fields["host_copy_round_s"], fields["host_copy_s"]
    cost = ((lambda r: (rnd * r["copy_layers"] + cp_ * r["uploads"]) / r["steps"]) if rnd + cp_ > 0
            else (lambda r: per(r, "uploads")))
    further = lambda r: fields["host_gpu_expert_s"] * (r["gpu_experts"] - r["gpu_layers"]) / r["steps"]
    plan = _lsq([[1.0, per(r, "uploads"), per(r, "cpu_layers")] for r in runs],
                [r["host_s"]["host_plan_s"] / r["steps"] for r in runs])
    queue = _lsq([[1.0, cost(r), per(r, "cpu_layers")] for r in runs],
                 [(r["host_s"]["host_queue_s"] / r["steps"]) - further(r) for r in runs])
    comb = _lsq([[1.0, per(r, "cpu_layers")] for r in runs],
                [r["host_s"]["host_combine_s"] / r["steps"] for r in runs])
    if plan is None or queue is None or comb is None:
        return None
    p, pc, scale, c = (max(float(v), 0.0) for v in (plan[0], plan[1], queue[1], comb[0]))
    copy_round, copy = (scale * rnd, scale * cp_) if rnd + cp_ > 0 else (0.0, scale)
    out = {"host_layer_plan_s": p, "host_plan_copy_s": pc, "host_layer_combine_s": c,
           "host_copy_round_s": copy_round, "host_copy_s": copy,
           "host_cpu_submit_s": max(fields["host_cpu_submit_s"] + fields["host_layer_plan_s"] - p, 0.0)}
    q = float(queue[0])
    if q < 0:  # the logged per-expert term over-charges: the deficit goes to it, at the GPU-only runs' expert count
        gpu_only = [r for r in runs if not r["cpu_layers"]] or runs
        n = sum(r["gpu_experts"] - r["gpu_layers"] for r in gpu_only) / max(sum(r["gpu_layers"] for r in gpu_only), 1)
        out["host_gpu_expert_s"] = max(fields["host_gpu_expert_s"] + q / n, 0.0) if n > 0 else fields["host_gpu_expert_s"]
        q = 0.0
    out["host_gpu_layer_s"] = p + q + c
    fit = {"plan": [float(v) for v in plan], "queue": [float(v) for v in queue], "combine": [float(v) for v in comb]}
    return {"fields": out, "fit": fit, "runs": len(runs)}


def replay_summary(records: list[dict], runs: list[dict] | None = None) -> dict:
    """``engine_replay`` of the measurements: host-lane fields, the pool's fit, (for records with
    ``gap_s``) the between-layer host costs from ``records`` and (with unlogged ``runs`` that
    determine it) ``unlogged_host_fields``."""
    out = {"configs": [n for n, _ in REPLAY_CONFIGS], "layers": len(records),
           "cpu_layers": sum("parts" in r for r in records), "fields": replay_host_fields(records),
           "pool": replay_pool_fit(records)}
    between = replay_between_fields(records)
    if between is not None:
        out["between"] = between
    unlogged = unlogged_host_fields(runs, out["fields"])
    if unlogged is not None:
        out["unlogged"] = unlogged
    return out


def apply_replay(hw: dict, summary: dict, expert_bytes: int, threads: int, src: dict | None = None) -> dict:
    """``hw`` (a hardware file's dict) with the host-lane fields and the CPU pool's cost (fit and
    per-count factors) taken from a calibration replay's ``replay_summary`` (``src``: its sources
    lines, updated)."""
    hw = dict(hw)
    hw["executor"] = {**hw.get("executor", {}), **summary["fields"]}
    if summary.get("unlogged"):  # GPU-only layers as unlogged replays run them
        hw["executor"].update(summary["unlogged"]["fields"])
        if src is not None:
            src["executor.unlogged"] = ("measured: GPU-only-layer plan, queue (level, copy round, copy) and combine "
                                        "from unlogged calibration runs (calibration_runs: engine phase totals per "
                                        "step fit on copies and CPU layers per step; unlogged_host_fields)")
    if summary.get("between"):
        hw["executor"] = apply_between(hw["executor"], summary["between"], src)
    pool = summary["pool"]
    if pool["expert_s"] > 0:  # the pool as a replay sees it, over the back-to-back calls
        hw.update(cpu_task_s=min(pool["task_s"], 0.5), cpu_thread_gbps=expert_bytes / pool["expert_s"] / 1e9 / threads)
        hw["cpu_call_factor"] = {str(n): f for n, f in pool.get("factor", {}).items()}
        if src is not None:
            src["cpu_thread_gbps"] = ("measured: CPU pool time per expert in the calibration replay (engine_replay: "
                                      "compute time of each CPU layer's job, fit over its expert count), / threads")
            src["cpu_task_s"] = "measured: intercept of the same fit"
            src["cpu_call_factor"] = (f"measured: per expert count with >= {POOL_MIN_CALLS} calls in the calibration "
                                      "replay, the mean call time / the same fit's (counts not listed: the fit)")
    return hw


# the hardware file -----------------------------------------------------------------------------
def hardware_json(m: dict, name: str, base: dict | None = None) -> dict:
    """The hardware file (simulator format) from a measurement dict ``m`` (see ``measure_all``).

    ``m`` keys used: ``threads``, ``expert_bytes``, ``cpu_mem``, ``cpu_pool`` (compute_s table),
    ``plan_s``, ``poll_s``, ``cpu_quant`` (optional {type: GB/s}); with a GPU also ``gpu``,
    ``link``, ``experts``, ``dense``, ``engine``. Without ``gpu`` the GPU and link fields come from
    ``base`` and no executor costs are written."""
    eb = m["expert_bytes"]
    T = int(m["threads"])
    med = lambda st: st["median"]
    table = m["cpu_pool"]["compute_s"]
    task, per = fit_table(table)
    if not per > 0:  # noise above the per-expert cost (tiny experts): the largest call's mean per expert
        most = max(table, key=float)
        task, per = 0.0, table[most]["median"] / float(most)
    cpu_rate = eb / per / 1e9
    mem = max(med(m["cpu_mem"]), cpu_rate)
    eff = {"Q8_0": 1.0}
    b_eff = (base or {}).get("cpu_quant_efficiency", {})
    for q, v in b_eff.items():  # types not measured here keep the base file's ratios to Q8_0
        if b_eff.get("Q8_0"):
            eff[q] = min(4.0, max(1e-3, v / b_eff["Q8_0"]))
    for q, gbps in (m.get("cpu_quant") or {}).items():
        eff[q] = min(4.0, max(1e-3, gbps / cpu_rate))
    src = {
        "cpu_threads": f"the engine's CPU pool threads (--threads {T})",
        "cpu_mem_gbps": "measured: Numba parallel read of 1 GiB (median; at least the pool's Q8_0 rate)",
        "cpu_thread_gbps": "measured: CpuExpertPool Q8_0 time per expert, slope over 1..8 cold experts per call "
                           "(the 8-expert call's mean per expert where noise makes the slope <= 0), / threads",
        "cpu_task_s": "measured: CpuExpertPool intercept of the same fit",
        "cpu_quant_efficiency": "measured: pool GB/s of each type / Q8_0's (8 experts per call)",
    }
    hw = dict(base or {})
    hw.pop("_about", None)
    hw.pop("_calibration", None)
    hw.pop("executor", None)
    hw.pop("cpu_call_factor", None)  # the base's pool factors belong to the base's pool fit
    hw.update(name=name, cpu_name=m.get("cpu_name", platform.processor() or platform.machine()), cpu_threads=T,
              cpu_mem_gbps=mem, cpu_thread_gbps=cpu_rate / T, cpu_task_s=min(max(task, 0.0), 0.5),
              cpu_quant_efficiency=eff)
    if "gpu" in m:
        hw.update(_gpu_fields(m, eb, src))
        if "engine_replay" in m:  # host lane and pool as a replay runs them, over the one-call figures
            hw = apply_replay(hw, m["engine_replay"], eb, T, src)
    elif not base:
        raise ValueError("hardware_json: no GPU measurements and no base hardware file for the GPU fields")
    hw["sources"] = {**(base or {}).get("sources", {}), **src}
    hw["_about"] = (f"measured by moelab calibrate on {m.get('host', socket.gethostname())} at {m.get('date', '')}"
                    + (" (CPU side only; GPU and link fields from the base file)" if "gpu" not in m else ""))
    hw["_calibration"] = m
    return hw


def _gpu_fields(m: dict, eb: int, src: dict) -> dict:
    med = lambda st: st["median"]
    g, link, ex, dn, en = m["gpu"], m["link"], m["experts"], m["dense"], m["engine"]
    gbps = g["d2d_gbps"]  # read + write traffic of a device copy: what a GEMV's weight reads can reach
    up_a, up_b = fit_table(ex["upload"])  # per expert, back to back
    pcie = link["pinned_fit"]["gbps"]
    lat = max(up_b - eb / (pcie * 1e9), 0.0)
    batch_a, batch_b = fit_table(ex["batch"])
    whole = {n: v["whole"] for n, v in en["hits"].items()}
    hits_a, hits_b = fit_table(whole)
    upl_a, upl_b = fit_table({n: v["whole"] for n, v in en["uploads"].items()})
    cpu = lambda part: float(np.median([med(v[part]) for v in en["cpu_layer"].values()]))
    plan = {p: med(v) for p, v in m["plan_s"].items()}
    one = en["hits"][min(en["hits"], key=float)]
    executor = {
        "host_dense_s": med(dn["host"]), "dense_fixed_s": dn["fit"]["fixed_s"], "readback_s": med(dn["readback"]),
        "host_head_s": med(dn["head_host"]),
        "host_gpu_layer_s": max(hits_a + hits_b, 0.0), "host_gpu_expert_s": max(hits_b, 0.0),
        "host_layer_plan_s": med(one["plan"]), "host_layer_combine_s": med(one["combine"]),
        "host_copy_s": max(upl_b - hits_b, 0.0),
        "host_cpu_submit_s": max(cpu("submit"), 0.0), "host_cpu_handoff_s": max(cpu("handoff"), 0.0),
        "host_cpu_queue_s": max(cpu("queue"), 0.0), "host_cpu_combine_s": max(cpu("combine"), 0.0),
        "cpu_start_s": max(cpu("start"), 0.0), "cpu_return_s": max(cpu("ret"), 0.0),
        "gpu_batch_s": max(batch_a, 0.0), "combine_s": med(ex["combine"]), "wait_poll_s": med(m["poll_s"]),
        "plan_s": plan,
    }
    src.update({
        "gpu_mem_bytes": "measured: cudaMemGetInfo total", "gpu_mem_gbps": "measured: 1 GiB device-to-device copy, (read + write) bytes / s",
        "gpu_tflops": "measured: fp16 8192^3 cupy.matmul", "launch_s": "measured: host time of a one-element cupy kernel",
        "pcie_h2d_gbps": "measured: pinned copies of 1-64 MiB, slope of the fit over size",
        "pageable_gbps": "measured: pageable 64 MiB copies", "copy_latency_s": "measured: GpuExperts.upload per expert "
        "(three copies) back to back, slope minus bytes / pcie_h2d_gbps",
        "gpu_quant_efficiency": "measured: Q8_0 = GpuExperts.run slope per expert over 1..16 experts; F16 = the dense "
        "stand-in's slope over four widths; both / gpu_mem_gbps",
        "executor": "measured: see _calibration; host-lane fields from a replay of a synthetic trace of its own seed "
                    "under lru and hybrid (engine_replay: run_layer phases per layer, CPU job stamps, the stand-in's "
                    "issue), the rest from one-call figures (engine), the fused dense stand-in and spin-held CUDA events",
    })
    return {
        "gpu_name": g["gpu_name"], "gpu_mem_bytes": g["gpu_mem_bytes"], "gpu_mem_gbps": gbps,
        "gpu_tflops": g["matmul_tflops"], "launch_s": med(g["launch_s"]), "pcie_h2d_gbps": pcie,
        "pageable_gbps": link["pageable_gbps"], "copy_latency_s": lat,
        "gpu_quant_efficiency": {"Q8_0": min(4.0, eb / batch_b / 1e9 / gbps),
                                 "F16": min(4.0, dn["fit"]["gbps"] / gbps)},
        "executor": executor,
    }


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (temp file, then rename), mode 0o666 less the umask."""
    atomic_write(path, json.dumps(data, indent=1, default=_jsonable))


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# the whole run ---------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} logical CPUs"
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Stages:
    """The measurement stages as a progress bar on stderr: ``stage(name)`` ends the previous one."""

    def __init__(self, total: int, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="stage", desc="calibrate", disable=quiet, file=sys.stderr,
                        dynamic_ncols=True)
        self.started = False

    def __call__(self, name: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_postfix_str(name)


def measure_all(args, layers=None, gx=None, partial: dict | None = None) -> dict:
    """Every measurement (see the module docstring); reuses ``layers``/``gx`` when given. Results
    go into ``partial`` (a dict, also returned) as they come. Stages are shown on stderr unless
    ``args.quiet``."""
    total = (layers is None) + 3 + (not args.quick) + (0 if args.cpu_only else 7)
    stage = _Stages(total, getattr(args, "quiet", False))
    try:
        m = _measure(args, stage, layers, gx, partial)
        stage("done")
        return m
    finally:
        stage.bar.close()


def _measure(args, stage, layers, gx, partial) -> dict:
    reps = 5 if args.quick else 11
    rng = np.random.default_rng(args.seed)
    if layers is None:
        stage(f"building {args.layers} x {args.experts} Q8_0 experts")
        layers = build_layers(rng, args.layers, args.experts, args.hidden, args.ffn)
    eb = layers[0].expert_bytes
    geo = Geometry((args.experts,) * len(layers), args.top_k, (eb,) * len(layers))
    m = partial if partial is not None else {}
    m.update({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": socket.gethostname(), "threads": args.threads,
         "expert_bytes": eb, "quick": bool(args.quick), "cpu_name": cpu_model(),
         "shape": {k: getattr(args, k) for k in ("layers", "experts", "hidden", "ffn", "top_k", "heads", "kv_heads",
                                                  "head_dim", "vocab")}})
    stage("scheduler planning per policy")
    tokens, _ = synth_tokens(len(layers), args.experts, args.top_k, 48, args.seed + 11)
    m["plan_s"] = measure_plan_s(geo, max(args.top_k, args.experts // 4), tokens)
    m["poll_s"] = measure_poll_s()
    stage("host memory bandwidth")
    m["cpu_mem"] = measure_cpu_mem_gbps(args.threads, 1 << 30 if not args.small else 1 << 24)
    stage("CPU pool")
    m["cpu_pool"] = measure_cpu_pool(layers, args.threads, reps=reps, seed=args.seed)
    if not args.quick:
        stage("CPU pool: quant types and thread counts")
        m["cpu_quant"], m["cpu_threads_q8"] = _cpu_types(args, layers, rng)
    if args.cpu_only:
        return m
    import cupy as cp

    from .engine import ExpertEngine
    from .gpu_experts import GpuExperts

    timer = GpuTimer(cp)
    stage("GPU basics")
    m["gpu"] = _gpu_basics(cp, timer, reps)
    stage("link")
    m["link"] = _link(cp, timer, reps)
    cap = Capacity.per_layer(geo, 32)
    own = gx is None
    if own:
        gx = GpuExperts(layers, cap, scratch_slots=16, pinned=True, timeout_s=60)
    engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
    try:
        stage("expert uploads and batches")
        gx.begin_copies()
        for e in range(16):
            gx.upload(0, e, e)
        gx.wait(gx.copies_event())
        m["experts"] = _experts_gpu(cp, timer, gx, layers, reps)
        stage("dense stand-in")
        m["dense"] = _dense(cp, timer, gx, args, reps)
        stage("engine host costs")
        m["engine"] = _engine(cp, timer, engine, layers, reps, args.seed)
        engine.synchronize()
        engine.pool.close()
        stage("engine host costs in a replay")
        records = calibration_replay(cp, gx, layers, args)
        stage("engine host costs in unlogged replays")
        m["calibration_runs"] = calibration_runs(cp, gx, layers, args)
        m["engine_replay"] = replay_summary(records, m["calibration_runs"])
    finally:
        engine.synchronize()
        engine.pool.close()
        if own:
            gx.close()
    return m


def _cpu_types(args, layers, rng) -> tuple[dict, dict]:
    from .cpu_experts import CpuExpertPool

    def rate(lx_list, threads):
        with CpuExpertPool(threads, timeout_s=120) as pool:
            pool.warmup(lx_list[0])
            ts = []
            for r in range(6):
                lx = lx_list[r % len(lx_list)]
                experts = rng.choice(lx.num_experts, 8, replace=False)
                job = pool.submit(lx, experts, rng.standard_normal((8, lx.hidden)).astype(np.float32))
                job.result()
                ts.append(job.compute_s)
        return 8 * lx_list[0].expert_bytes / float(np.median(ts[1:])) / 1e9

    quant = {}
    for qt in (Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.MXFP4, Q.F16):
        name = Q.QTYPES[qt].name
        lx = random_layer(rng, 0, 64, args.hidden, args.ffn, qt, exact=False)
        quant[name] = rate([lx], args.threads)
        del lx
    threads = {t: rate(layers, t) for t in sorted({4, 8, 12, args.threads}) if t <= args.threads}
    return quant, threads


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The model-shape flags shared with experiments/sim_vs_real.py (Qwen3-30B-A3B's by default)."""
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)


def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="moelab calibrate", description="Measure this machine as moelab's executor "
                                 "uses it and write a hardware file for moelab simulate --hardware.")
    ap.add_argument("--out", default="calibrated.json", help="hardware JSON to write (default calibrated.json)")
    ap.add_argument("--name", default=None, help="the hardware's name (default calibrated-<host>)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; Q8_0 and the pool's thread count only")
    ap.add_argument("--cpu-only", action="store_true", help="no GPU: CPU pool, memory and planning over --base's fields")
    ap.add_argument("--base", default=None,
                    help="hardware preset name or JSON file whose GPU and link fields --cpu-only keeps")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="CPU pool threads")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of random experts (cold-cache rotation)")
    add_shape_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    ap.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # tests: a 16 MiB memory read
    return ap


def main(argv=None) -> int:
    """``moelab calibrate``: measure, then write the hardware JSON (exit 2 on bad arguments)."""
    args = _parser().parse_args(argv)
    if args.cpu_only and not args.base:
        print("moelab calibrate: --cpu-only needs --base PRESET|FILE (a hardware preset or JSON for the GPU and "
              "link fields)", file=sys.stderr)
        return 2
    try:
        check_output(args.out, "--out")
    except OutputPathError as e:
        print(f"moelab calibrate: {e}", file=sys.stderr)
        return 2
    for flag in ("layers", "experts", "hidden", "ffn", "top_k", "heads", "kv_heads", "head_dim", "vocab"):
        if getattr(args, flag) < 1:
            print(f"moelab calibrate: --{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 1", file=sys.stderr)
            return 2
    if args.top_k > args.experts:
        print(f"moelab calibrate: --top-k {args.top_k}: expected <= --experts {args.experts}", file=sys.stderr)
        return 2
    base = None
    if args.base:
        try:
            base = json.loads(_base_path(args.base).read_text())
            if not isinstance(base, dict):
                raise ValueError("expected a JSON object")
        except (OSError, ValueError) as e:
            print(f"moelab calibrate: --base {args.base}: not a hardware preset or readable hardware JSON ({e})",
                  file=sys.stderr)
            return 2
    if not args.cpu_only:
        problem = _gpu_problem()
        if problem:
            print(f"moelab calibrate: no usable CUDA GPU ({problem}); without one, measure the CPU side only: "
                  f"moelab calibrate --cpu-only --base PRESET|FILE (e.g. --base rtx4060-laptop)", file=sys.stderr)
            return 2
    import numba

    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
        print(f"moelab calibrate: --threads {args.threads}, expected 1..{numba.config.NUMBA_NUM_THREADS}",
              file=sys.stderr)
        return 2
    m = {}
    try:
        m = measure_all(args, partial=m)
    except BaseException as exc:
        partial = Path(str(args.out) + ".partial.json")
        if m:  # what was measured before the failure, for the record (not a hardware file)
            write_json(partial, m)
        if isinstance(exc, KeyboardInterrupt):
            kept = f"what was measured is in {partial} (not a hardware file)" if m else "nothing was written"
            print(f"\nmoelab calibrate: interrupted; {kept}", file=sys.stderr)
            return 130
        raise
    hw = hardware_json(m, args.name or f"calibrated-{socket.gethostname()}", base if args.cpu_only else None)
    write_json(Path(args.out), hw)
    if not args.quiet:
        print(f"wrote {args.out}: hardware {hw['name']}", file=sys.stderr)
    _print_summary(hw)
    return 0


def _base_path(base: str) -> Path:
    """``--base``: a JSON file, or the name of a bundled hardware preset."""
    from scheduler.hardware import HARDWARE_DIR

    p = Path(base)
    if not p.exists() and not p.suffix and (HARDWARE_DIR / f"{base}.json").is_file():
        return HARDWARE_DIR / f"{base}.json"
    return p


def _gpu_problem() -> str | None:
    """Why the GPU measurements cannot run here (no CuPy, no device), or None; checked first."""
    try:
        from .gpu_experts import gpu_available
    except Exception as e:  # CuPy missing, or its CUDA libraries
        return f"{type(e).__name__}: {e}"
    return None if gpu_available() else "CuPy sees no CUDA device"


def _print_summary(hw: dict) -> None:
    keys = ("gpu_mem_gbps", "pcie_h2d_gbps", "copy_latency_s", "launch_s", "cpu_threads", "cpu_thread_gbps",
            "cpu_task_s", "cpu_mem_gbps")
    for k in keys:
        if k in hw:
            print(f"{k:<18} {hw[k]:.4g}")
    for k, v in hw.get("executor", {}).items():
        if k == "plan_s":
            print("plan_s             " + ", ".join(f"{p} {s * 1e6:.1f} us" for p, s in v.items()))
        else:
            print(f"{k:<18} {v * 1e6:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
