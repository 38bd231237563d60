"""The executor benchmark's parts (``experiments/bench_executor.py``): policies side by side on the
real expert engine, each beside its bound.

Model: a Qwen3-30B-A3B-shaped Q8_0 MoE built in host RAM from random Q8_0 blocks (random int8
weights, valid f16 scales; ``distinct_layers`` distinct layers, the others copies of them in their
own memory; :func:`build_layers`). Routing: ``traces.synth`` (the preset ``qwen3-30b-a3b`` when
it exists, else :data:`FALLBACK_PARAMS`, fitted to a published 48x128 top-8 LRU curve: 41/64/82/92%
hits at 8/16/32/64 slots, per-sequence reset; :func:`make_trace`). ``static`` is pre-placed from a
profile counted on the warm-up part of the same trace (:func:`warmup_profile`).

Dense part (:class:`Dense`): a fixed GPU stand-in per layer, the cost of a fused decode block at
short context: RMSNorm fused into an fp16 [5120 x hidden] GEMV, then an fp16 [hidden x 4096] GEMV
of its first 4096 outputs plus the residual, then the MoE's RMSNorm (three kernels, fp32
accumulation, ~38 MB of weights read per layer). The experts' output is the next layer's input
(no second residual: with random experts it would grow without bound). The CuPy-operator version
of the same computation is timed beside it and is its numerical check. No router compute.

The bound (:func:`bound_s`), per policy, from rates measured in the run (:func:`measure_rates`):
sum over layers of ``dense + max(GPU bytes / GPU rate, PCIe bytes / upload rate, CPU bytes / CPU
rate)`` for the decisions the policy made (background copies not counted), and the ``ideal
split`` bound: the same hits with every layer's misses split between PCIe and CPU in the best
proportion. GPU rates are device time (kernels queued behind a spin kernel, so no launch gap is
timed). Without a CPU policy the CPU pool is not measured (rate 0; the ideal split is PCIe alone).

:func:`run_policy` runs each layer as a forward pass does: the dense part and the engine's
``begin_layer`` (early start of the resident experts) before the driver plans the step, then
``run_layer``; with ``sync`` it waits for the layer's GPU work after ``run_layer``, as the model's
next router read-back does. ``gpu`` runs with every expert resident. :func:`report` prints the
results, hybrid / best non-hybrid and a per-layer host-time breakdown (host clock around each
call, the engine's phases, the hand-off's edges per CPU call handed off, beside device-event times
of single calls); :func:`write_outputs` writes ``bench_executor.{json,csv,png}``.
"""
from __future__ import annotations

import csv
import gc
import io
import json
import os
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np

from scheduler.core import Capacity
from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from scheduler.policies import make_policy
from scheduler.profile import Profile

from . import quant as Q
from .experts import LayerExperts, random_layer

__all__ = ["Dense", "FALLBACK_PARAMS", "HOST_PHASES", "NO_CPU", "bench_cost_model", "bound_s", "build_layers",
           "engine_variant", "label", "make_trace", "measure_rates", "policy_spec", "report", "run_policy",
           "warmup_profile", "write_outputs"]

# fitted with traces.synth.signature to the published 48x128 top-8 LRU hit rates (see module docstring)
FALLBACK_PARAMS = dict(zipf_s=0.6, topic_concentration=0.3, reuse_prob=0.3, reuse_lag_tokens=2.0)
QKV, ATTN = 5120, 4096  # dense stand-in widths

_DENSE_EXTRA = r"""

// y[t] = x[t] * rsqrt(mean(x[t]^2) + eps), rows of n floats. grid T, block 32 * DW.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, float* __restrict__ y, int n, float eps) {
    __shared__ float part[DW];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* xt = x + (long long)blockIdx.x * n;
    float* yt = y + (long long)blockIdx.x * n;
    float q = 0.f;
    for (int c = threadIdx.x; c < n; c += 32 * DW) q += xt[c] * xt[c];
    q = wsum(q);
    if (lane == 0) part[warp] = q;
    __syncthreads();
    q = 0.f;
    for (int i = 0; i < DW; i++) q += part[i];
    float s = rsqrtf(q / n + eps);
    for (int c = threadIdx.x; c < n; c += 32 * DW) yt[c] = xt[c] * s;
}

// one thread sleeps ns nanoseconds: queued work behind it starts without launch gaps (timing only)
extern "C" __global__ void spin_ns(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < (unsigned long long)ns);
}
"""


def dense_source() -> str:
    """The stand-in's CUDA source: ``gemv_f16.cu`` and the RMSNorm and spin kernels."""
    return resources.files(__package__).joinpath("gemv_f16.cu").read_text() + _DENSE_EXTRA


def make_trace(args, seed: int, num_tokens: int):
    """A ``traces.synth`` trace of ``num_tokens`` tokens on ``args``' shape (layers, experts,
    top_k) and where its parameters came from."""
    from traces import synth

    preset = synth.PRESETS.get("qwen3-30b-a3b")
    params = preset.params if preset is not None else synth.SynthParams(**FALLBACK_PARAMS)
    return synth.generate(args.layers, args.experts, args.top_k, num_tokens, params, np.random.default_rng(seed)), \
        ("preset qwen3-30b-a3b" if preset is not None else f"fitted here {FALLBACK_PARAMS}")


def bench_cost_model(args, hardware, policy: str):
    """The cost model a hardware description gives the bench's shape (``args``: layers, experts,
    top_k, hidden, ffn; Q8_0 experts), as ``moelab run --hardware`` builds it for a model file:
    ``Costs(model, hardware, ExecConfig(policy=policy)).cost_model()`` of the ``qwen3-30b-a3b``
    preset reshaped to the bench (its dense part and head are the preset's)."""
    from scheduler.costs import Costs, ExecConfig
    from scheduler.models import load_model

    spec = replace(load_model("qwen3-30b-a3b"), name="bench", num_layers=args.layers, num_experts=args.experts,
                   top_k=args.top_k, hidden=args.hidden, expert_ffn=args.ffn, first_dense_layers=0,
                   expert_quant="Q8_0", layer_expert_bytes=())
    return Costs(spec, hardware, ExecConfig(policy=policy)).cost_model()


def policy_spec(text: str) -> tuple[str, dict]:
    """``NAME`` or ``NAME:FIELD=VALUE:...`` (a policy and config fields: ints, floats, true/false,
    words) -> (name, options); ValueError naming the part that is not ``FIELD=VALUE``."""
    name, *parts = text.split(":")
    options = {}
    for part in parts:
        key, eq, v = part.partition("=")
        if not eq or not key or not v:
            raise ValueError(f"policy {text!r}: {part!r} is not FIELD=VALUE")
        low = v.lower()
        if low in ("true", "false"):
            options[key] = low == "true"
        else:
            try:
                options[key] = int(v)
            except ValueError:
                try:
                    options[key] = float(v)
                except ValueError:
                    options[key] = v
    return name, options


def warmup_profile(trace, rows: int, slots: int) -> Profile:
    """Profile counted on the trace's first ``rows`` rows (the warm-up part)."""
    ids = np.asarray(trace.expert_ids[:rows]).astype(np.int64)  # (rows, L, k)
    n_l, n_e = trace.num_layers, max(trace.num_experts)
    flat = ids + (np.arange(n_l) * n_e)[None, :, None]
    counts = np.bincount(flat[ids >= 0], minlength=n_l * n_e).reshape(n_l, n_e)
    return Profile.from_counts(counts, slots=slots)


class Dense:
    """The per-layer GPU stand-in for attention (see the module docstring); outputs alternate
    between two preallocated buffers, all work on ``stream``."""

    def __init__(self, cp, layers: int, hidden: int, rng: np.random.Generator, stream):
        from .gpu_experts import Launch

        self.cp, self.stream, self.hidden = cp, stream, hidden
        self.mod = cp.RawModule(code=dense_source(), options=("-std=c++14",))
        self.gemv = Launch(self.mod.get_function("gemv_f16"), 9)
        self.spin = Launch(self.mod.get_function("spin_ns"), 1)
        self.norm = Launch(self.mod.get_function("rmsnorm"), 4)
        self.eps = Launch.f32(1e-6)
        g = cp.random.default_rng(int(rng.integers(2**31)))
        with stream:
            self.w1 = [(g.standard_normal((QKV, hidden), dtype=cp.float32) / np.sqrt(hidden)).astype(cp.float16)
                       for _ in range(layers)]  # (5120, hidden)
            self.w2 = [(g.standard_normal((hidden, ATTN), dtype=cp.float32) / 64).astype(cp.float16)
                       for _ in range(layers)]  # (hidden, 4096)
        self._bufs: dict[int, tuple] = {}
        self._ops_w: dict[int, tuple] = {}
        self._next = 0

    def __call__(self, x, layer: int):
        """x: (T, hidden) float32 C-contiguous device array -> (T, hidden) float32 (a ring buffer)."""
        t = x.shape[0]
        bufs = self._bufs.get(t)
        if bufs is None:
            with self.stream:
                bufs = self._bufs[t] = (self.cp.empty((t, QKV), self.cp.float32),
                                        self.cp.empty((t, self.hidden), self.cp.float32),
                                        [self.cp.empty((t, self.hidden), self.cp.float32) for _ in range(2)])
        a, res, outs = bufs
        out = outs[self._next]
        self._next ^= 1
        s, h = self.stream.ptr, self.hidden
        self.gemv((-(-QKV // 8), t), 128, s, self.w1[layer].data.ptr, x.data.ptr, h, 0, a.data.ptr, QKV, h, 1, self.eps)
        self.gemv((-(-h // 8), t), 128, s, self.w2[layer].data.ptr, a.data.ptr, QKV, x.data.ptr, res.data.ptr, h,
                  ATTN, 0, self.eps)
        self.norm((t, 1), 128, s, res.data.ptr, out.data.ptr, h, self.eps)
        return out

    def cupy_ops(self, x, layer: int):
        """The same computation with CuPy operators (the earlier stand-in, on contiguous (in, out)
        weight copies as it had them; fp16 activations)."""
        cp = self.cp
        with self.stream:
            if layer not in self._ops_w:
                self._ops_w[layer] = (cp.ascontiguousarray(self.w1[layer].T), cp.ascontiguousarray(self.w2[layer].T))
            w1, w2 = self._ops_w[layer]
            h = (x * cp.reciprocal(cp.sqrt(cp.mean(x * x, axis=1, keepdims=True) + 1e-6))).astype(cp.float16)
            a = cp.matmul(h, w1)[:, :ATTN]
            r = x + cp.matmul(a, w2).astype(cp.float32)
            return r * cp.reciprocal(cp.sqrt(cp.mean(r * r, axis=1, keepdims=True) + 1e-6))

    def reference(self, x: np.ndarray, layer: int) -> np.ndarray:
        """float64 host reference."""
        w1, w2 = self.w1[layer].get().astype(np.float64), self.w2[layer].get().astype(np.float64)
        x = x.astype(np.float64)
        h = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6)
        r = x + (h @ w1.T)[:, :ATTN] @ w2.T
        return r / np.sqrt((r * r).mean(axis=1, keepdims=True) + 1e-6)


def gpu_us(cp, dense: Dense, fn, reps: int = 20) -> float:
    """Device time per call of ``fn`` (work on the dense stream only), queued behind a spin kernel
    that outlasts the host's queueing of all ``reps`` calls (so no launch gap is timed)."""
    s = dense.stream
    t0 = time.perf_counter()
    fn()
    s.synchronize()
    spin_ns = max(10_000_000, int(3e9 * reps * (time.perf_counter() - t0)))
    a, b = cp.cuda.Event(), cp.cuda.Event()
    dense.spin((1, 1), 1, s.ptr, spin_ns)
    a.record(s)
    for _ in range(reps):
        fn()
    b.record(s)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3 / reps


def host_us(fn, reps: int = 50) -> float:
    """Host time per call of ``fn`` (median of ``reps``, no synchronisation)."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def measure_rates(cp, layers, gx, pool, dense: Dense, reps: int = 6) -> dict:
    """Upload, CPU-pool and GPU-kernel rates (GB/s), the dense stand-in's time per layer (device
    time, used by the bound) and host/device times of the per-layer calls (the breakdown)."""
    eb = layers[0].expert_bytes
    n_slots = gx.arenas[0].size // gx.slot_bytes[0]
    k = min(8, n_slots)
    with gx.compute:  # the compute stream does not wait for the legacy default stream
        x1 = cp.asarray(np.random.default_rng(0).standard_normal((1, layers[0].hidden)).astype(np.float32))
    # uploads: k experts per layer into its slots, rotating layers
    gx.wait(gx.all_done_event())
    t0 = time.perf_counter()
    n = 0
    for i in range(reps * 4):
        lx = layers[i % len(layers)]
        gx.begin_copies()
        for s in range(k):
            gx.upload(lx.layer, (i * k + s) % lx.num_experts, s)
            n += 1
        gx.wait(gx.copies_event())
    upload_gbps = n * eb / (time.perf_counter() - t0) / 1e9
    gx.wait(gx.all_done_event())
    # expert kernels as the engine runs them: k resident experts of layer 0, one token each
    meta = gx.layer_meta([gx.source_ptr(0, s) for s in range(k)], list(range(k + 1)), [0] * k, list(range(k)),
                         [1.0 / k] * k, k)
    y = gx.pair_outputs(0, k)
    gx.wait(gx.all_done_event())
    bases = [gx.source_ptr(0, s) for s in range(k)]

    def experts1():  # the one-token path: gate/up, then down and combine, the pair table by value
        gx.pack1(bases, [1.0 / k] * k, list(range(k)))
        gx.gate_up1(0, x1, k, k)
        return gx.down_combine1(0, k)

    times = {"experts": lambda: gx.run_groups(0, meta, 0, k, x1, k), "combine": lambda: gx.combine_meta(meta, y),
             "experts1_fused": experts1, "dense": lambda: dense(x1, 0), "dense_cupy_ops": lambda: dense.cupy_ops(x1, 0)}
    assert dense.stream is gx.compute
    out = {"gpu_us": {name: gpu_us(cp, dense, fn) for name, fn in times.items()}}
    out["host_us"] = {name: host_us(fn) for name, fn in times.items()}
    out["host_us"]["layer_meta"] = host_us(lambda: gx.layer_meta([gx.source_ptr(0, s) for s in range(k)],
                                                                  list(range(k + 1)), [0] * k, list(range(k)),
                                                                  [1.0 / k] * k, k))
    gx.wait(gx.all_done_event())
    out["host_us"].update(driver_call_us(cp, gx, dense, min(3, n_slots)))
    gpu_gbps = k * eb / (out["gpu_us"]["experts"] * 1e-6) / 1e9
    # CPU pool: k experts per call, rotating layers so L3 does not serve them (0: not measured)
    cpu_gbps = 0.0
    if pool is not None:
        xh = np.random.default_rng(1).standard_normal((k, layers[0].hidden)).astype(np.float32)
        pool.warmup(layers[0])
        cpu_t = []
        for i in range(reps * 2):
            lx = layers[(i * 7 + 3) % len(layers)]
            job = pool.submit(lx, list(range(k, 2 * k)), xh)
            job.result()
            cpu_t.append(job.compute_s)
        cpu_gbps = k * eb / float(np.median(cpu_t[1:])) / 1e9
    # dense stand-in: numerics against float64 and the CuPy-operator version
    ref = dense.reference(x1.get(), 0)
    fused, ops = dense(x1, 0), dense.cupy_ops(x1, 0)
    gx.compute.synchronize()
    fused, ops = fused.get(), ops.get()
    err = {"fused_vs_f64": float(np.linalg.norm(fused - ref) / np.linalg.norm(ref)),
           "cupy_ops_vs_f64": float(np.linalg.norm(ops - ref) / np.linalg.norm(ref))}
    gx.run_groups(0, meta, 0, k, x1, k)
    grouped, one = gx.combine_meta(meta, y), experts1()
    gx.compute.synchronize()  # .get() copies on the current stream, which does not wait for compute
    grouped, one = grouped.get(), one.get()
    err["experts1_vs_grouped"] = float(np.linalg.norm(one - grouped) / np.linalg.norm(grouped))
    out.update(upload_gbps=upload_gbps, gpu_gbps=gpu_gbps, cpu_gbps=cpu_gbps,
               dense_s_per_layer=out["gpu_us"]["dense"] * 1e-6, experts_per_measure=k, dense_rel_err=err)
    return out


def driver_call_us(cp, gx, dense: Dense, n: int) -> dict:
    """Host us per call of what a layer step queues: a step's copy of ``n`` experts (one batched
    driver call, where the driver has it, and one call per part), one part's copy, an event
    record, a stream wait, a one-thread kernel launch (NaN: not available)."""
    rt, b = cp.cuda.runtime, gx._batch
    ev = cp.cuda.Event(disable_timing=True)
    row = gx._host_rows(0)
    out = {}

    def copy_in(batched: bool) -> None:
        fn = b._fn
        if not batched:
            b._fn = None
        try:
            gx.copy_in(0, list(range(n)), list(range(n)))
        finally:
            b._fn = fn

    out[f"copy_in_{n}_batched"] = host_us(lambda: copy_in(True), 20) if b.batched else float("nan")
    gx.wait(gx.all_done_event())
    out[f"copy_in_{n}_per_part"] = host_us(lambda: copy_in(False), 20)
    gx.wait(gx.all_done_event())
    if row is not None:
        dst = gx.source_ptr(0, 0)
        out["memcpy_one_part"] = host_us(lambda: rt.memcpyAsync(dst, row[0][0], row[0][2], rt.memcpyHostToDevice,
                                                                 gx.copy.ptr), 20)
    out["event_record"] = host_us(lambda: rt.eventRecord(ev.ptr, gx.compute.ptr))
    out["stream_wait_event"] = host_us(lambda: rt.streamWaitEvent(gx.copy.ptr, ev.ptr))
    out["launch_1thread"] = host_us(lambda: dense.spin((1, 1), 1, gx.compute.ptr, 0))
    out["batch_refused"] = b.refused or 0
    gx.wait(gx.all_done_event())
    return out


def bound_s(decisions, eb: int, rates: dict) -> tuple[float, float]:
    """(bound of these decisions, ideal-split bound with the same hits), in seconds."""
    g, p, c, dn = rates["gpu_gbps"] * 1e9, rates["upload_gbps"] * 1e9, rates["cpu_gbps"] * 1e9, rates["dense_s_per_layer"]
    own = ideal = 0.0
    for d in decisions:
        n_gpu = len(d.hits) + len(d.uploads) + len(d.streams)
        n_pcie = len(d.uploads) + len(d.streams)
        own += dn + max(n_gpu * eb / g, n_pcie * eb / p, len(d.cpu) * eb / c if d.cpu else 0.0)
        misses = n_pcie + len(d.cpu)
        ideal += dn + max(len(d.hits) * eb / g, misses * eb / (p + c))
    return own, ideal


HOST_PHASES = ("dense", "run_layer", "background")
NO_CPU = {"gpu", "lru", "freq-lru"}  # policies that never compute an expert on the CPU
HYBRIDS = ("hybrid", "hybrid-cost")  # the policies report() compares with the best of the others
ENGINE_PHASES = ("host_early_s", "host_plan_s", "host_submit_s", "host_queue_s", "input_wait_s", "cpu_wait_s",
                 "host_combine_s", "background_wait_s")


def engine_variant(text: str) -> dict:
    """``ExpertEngine`` options from ``WAIT:PUT`` (``device:early``, the defaults, or the former
    ``host:compute``): ``background_wait`` and ``handoff_put``; ValueError naming what is wrong."""
    from .engine import BACKGROUND_WAITS, HANDOFF_PUTS

    parts = text.split(":")
    if len(parts) != 2 or parts[0] not in BACKGROUND_WAITS or parts[1] not in HANDOFF_PUTS:
        raise ValueError(f"engine variant {text!r}: expected WAIT:PUT with WAIT in {'|'.join(BACKGROUND_WAITS)}, "
                         f"PUT in {'|'.join(HANDOFF_PUTS)}")
    return dict(zip(("background_wait", "handoff_put"), parts))


def run_policy(cp, name, args, layers, geo, cap, profile, tokens, routing, dense, gx, rates, options,
               sync: bool = False, variant: str | None = None, cost_model=None) -> dict:
    """One policy over the trace. As in a forward pass, each layer's dense part runs and the
    engine's ``begin_layer`` starts the resident experts (unless ``--no-early``) before the driver
    plans the step; ``sync`` waits for the layer's GPU work after ``run_layer``, as the model's
    next router read-back does (then the host phases hold no back-pressure from the GPU queue).
    ``variant``: the engine's ``WAIT:PUT`` (:func:`engine_variant`; None: its defaults).
    ``cost_model``: for the policies that read one (``hybrid``'s share when ``options`` give no
    ``miss_frac_256``, ``hybrid-cost``, ``lookahead``; :func:`bench_cost_model`)."""
    from .engine import ExpertEngine

    if name == "gpu":  # every expert resident: the arena holds the whole model
        cap = Capacity.per_layer(geo, args.experts)
    pol = make_policy(name, geo, cap, profile=profile, cost_model=cost_model, **options)
    engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx,
                          **(engine_variant(variant) if variant else {}))
    engine.load_residents(pol.cache.slot)
    rng = np.random.default_rng(args.seed + 7)
    with gx.compute:
        x0 = cp.asarray(rng.standard_normal((1, args.hidden)).astype(np.float32))
    eb = layers[0].expert_bytes
    timed, decisions = False, []
    hits = routed = bg_bytes = bg_moves = 0
    host = dict.fromkeys(HOST_PHASES, 0.0)
    t0 = up0 = stats0 = None
    state = {"x": x0, "ids": None, "w": None}
    pc = time.perf_counter
    early = not args.no_early

    def forward(tok):
        """The token's steps, each yielded after its layer's dense part (and early start)."""
        for step in tok.steps:
            ids, w = routing[tok.index][step.layer]
            a = pc()
            state["x"] = x = dense(state["x"], step.layer)
            if timed:
                host["dense"] += pc() - a
            state["ids"], state["w"] = ids[None, :], w[None, :]
            if early:
                engine.begin_layer(step.layer, x, state["ids"])
            yield step

    gc_s = [0.0, 0.0]  # garbage collector's time while timed (it pauses whichever phase runs)

    def gc_clock(phase, info):
        if timed:
            gc_s[phase == "stop"] += pc()

    gc.callbacks.append(gc_clock)
    try:
        for item in drive(pol, (replace(t, steps=forward(t)) for t in tokens)):
            if isinstance(item, RunLayer):
                b = pc()
                state["x"] = engine.run_layer(item, state["x"], state["ids"], state["w"])
                if sync:
                    gx.compute.synchronize()
                if timed:
                    host["run_layer"] += pc() - b
                    decisions.append(item.decision)
                    hits += len(item.decision.hits)
                    routed += len(item.step.experts)
            elif isinstance(item, StartBackground):
                a = pc()
                engine.start_background(item.moves)
                if timed:
                    host["background"] += pc() - a
                    bg_bytes += len(item.moves) * eb
                    bg_moves += len(item.moves)
            elif isinstance(item, AwaitBackground):
                a = pc()
                engine.await_background(item.moves)
                if timed:
                    host["background"] += pc() - a
            elif isinstance(item, EndToken) and item.token.index == args.warmup - 1:
                engine.synchronize()
                timed, t0, up0 = True, pc(), gx.bytes_uploaded
                stats0 = {k: v for k, v in vars(engine.stats).items() if k != "per_layer_cpu_s"}
                state["x"] = x0
    finally:
        gc.callbacks.remove(gc_clock)
    engine.synchronize()
    wall = pc() - t0
    n = args.tokens
    own, ideal = bound_s(decisions, eb, rates)
    st = {k: v - stats0[k] for k, v in vars(engine.stats).items() if k != "per_layer_cpu_s"}
    engine.close()
    per_layer = 1e6 / max(len(decisions), 1)
    breakdown = {f"{k}_us": v * per_layer for k, v in host.items()}
    breakdown.update({f"{k[:-2]}_us": st[k] * per_layer for k in ENGINE_PHASES})
    breakdown["wall_us"] = wall * per_layer
    breakdown["gc_us"] = (gc_s[1] - gc_s[0]) * per_layer
    calls = max(st.get("handoff_calls", 0), 1)  # the hand-off's edges, per CPU call handed off
    breakdown["handoff_in_us"] = st.get("handoff_in_s", 0.0) * 1e6 / calls
    breakdown["handoff_out_us"] = st.get("handoff_out_s", 0.0) * 1e6 / calls
    return {
        "policy": name, "options": options, "profile": profile is not None,
        "cost_model": cost_model is not None and not (name == "hybrid" and "miss_frac_256" in options), "sync": sync, "early": early,
        "variant": variant, "background_moves": bg_moves,
        "early_pairs": st.get("early_pairs", 0), "tokens": n, "wall_s": wall,
        "tokens_per_s": n / wall, "hit_rate": hits / max(routed, 1), "uploaded_gb": (gx.bytes_uploaded - up0) / 1e9,
        "background_gb": bg_bytes / 1e9, "cpu_pairs": st["cpu_pairs"], "gpu_pairs": st["gpu_pairs"],
        "cpu_compute_s": st["cpu_compute_s"], "cpu_wait_s": st["cpu_wait_s"],
        "background_wait_s": st["background_wait_s"], "bound_tokens_per_s": n / own,
        "ideal_split_bound_tokens_per_s": n / ideal, "per_layer_us": breakdown,
    }


def label(r: dict) -> str:
    """A run's name in tables: policy, ``sync``, hybrid's miss fraction (``cost``: its cost model's
    share), fill cap, other options and profile."""
    s = r["policy"] + (" sync" if r.get("sync") else "")
    opts = r["options"]
    if "miss_frac_256" in opts:
        s += f" f={opts['miss_frac_256']}"
    elif r["policy"] == "hybrid" and r.get("cost_model"):
        s += " cost"
    if "max_fills" in opts:
        s += f" fills<={opts['max_fills']}"
    s += "".join(f" {k}={v}" for k, v in opts.items() if k not in ("miss_frac_256", "max_fills"))
    if r["policy"] == "hybrid" and r["profile"]:
        s += " +prof"
    if r.get("variant"):
        s += " " + r["variant"]
    return s


def report(results: list[dict], rates: dict) -> tuple[str, dict | None]:
    """The printed tables, and {'ratio', 'hybrid', 'best'} (None without both kinds of runs)."""
    out = io.StringIO()
    w = out.write
    n = max([22] + [len(label(r)) + 1 for r in results])
    w(f"\n{'policy':<{n}}{'tok/s':>8}{'hits':>7}{'up GB':>8}{'bg moves':>9}{'cpu pairs':>10}{'bound':>8}{'%bound':>8}"
      f"{'ideal':>8}\n")
    for r in results:
        w(f"{label(r):<{n}}{r['tokens_per_s']:8.1f}{r['hit_rate']:7.3f}{r['uploaded_gb']:8.2f}"
          f"{r.get('background_moves', 0):9d}{r['cpu_pairs']:10d}"
          f"{r['bound_tokens_per_s']:8.1f}{100 * r['tokens_per_s'] / r['bound_tokens_per_s']:7.0f}%"
          f"{r['ideal_split_bound_tokens_per_s']:8.1f}\n")
    best = max((r for r in results if r["policy"] not in HYBRIDS), key=lambda r: r["tokens_per_s"], default=None)
    hyb = max((r for r in results if r["policy"] in HYBRIDS), key=lambda r: r["tokens_per_s"], default=None)
    summary = None
    if best and hyb:
        summary = {"ratio": hyb["tokens_per_s"] / best["tokens_per_s"], "hybrid": label(hyb), "best": label(best)}
        w(f"hybrid / best non-hybrid: {summary['ratio']:.2f}x ({label(hyb)} {hyb['tokens_per_s']:.1f} vs "
          f"{label(best)} {best['tokens_per_s']:.1f} tok/s); hybrid at "
          f"{100 * hyb['tokens_per_s'] / hyb['ideal_split_bound_tokens_per_s']:.0f}% of the ideal-split bound\n")
    cols = [r for r in results if r is best or r is hyb or r["policy"] in ("lru", "cpu", "gpu") or r.get("variant")]
    cols = list({id(r): r for r in cols}.values())
    cw = max([14] + [len(label(r)) + 1 for r in cols])
    w(f"\nper layer, us (host clock around each call; engine phases inside run_layer)\n{'phase':<18}")
    w("".join(f"{label(r):>{cw}}" for r in cols) + "\n")
    for key in cols[0]["per_layer_us"] if cols else ():
        w(f"{key[:-3]:<18}" + "".join(f"{r['per_layer_us'][key]:{cw}.1f}" for r in cols) + "\n")
    w(f"\none call, us{'':<14}{'host':>10}{'device':>10}\n")
    for name in rates["gpu_us"]:
        w(f"{name:<26}{rates['host_us'][name]:10.1f}{rates['gpu_us'][name]:10.1f}\n")
    for name, v in rates["host_us"].items():
        if name not in rates["gpu_us"] and isinstance(v, float):
            w(f"{name:<26}{v:10.1f}{'':>10}\n")
    e = rates["dense_rel_err"]
    w(f"dense stand-in rel. error vs float64: fused {e['fused_vs_f64']:.1e}, cupy ops {e['cupy_ops_vs_f64']:.1e}\n")
    w(f"one-token expert path vs grouped kernels + combine: rel. difference {e['experts1_vs_grouped']:.1e}\n")
    return out.getvalue(), summary


def write_outputs(out: Path, config: dict, rates: dict, results: list[dict], summary) -> None:
    """JSON (everything), CSV (one row per run) and a PNG bar chart, each via a temp file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)

    def put(name: str, write) -> None:
        tmp = out / (name + ".tmp")
        write(tmp)
        os.replace(tmp, out / name)

    put("bench_executor.json", lambda p: p.write_text(
        json.dumps({"config": config, "rates": rates, "results": results, "summary": summary}, indent=1)))
    fields = ["label", "tokens_per_s", "hit_rate", "uploaded_gb", "cpu_pairs", "gpu_pairs", "bound_tokens_per_s",
              "ideal_split_bound_tokens_per_s", "wall_s"]
    keys = list(results[0]["per_layer_us"]) if results else []

    def write_csv(p: Path) -> None:
        with open(p, "w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(fields + [f"per_layer_{k}" for k in keys])
            for r in results:
                wr.writerow([label(r)] + [r[k] for k in fields[1:]] + [round(r["per_layer_us"][k], 2) for k in keys])

    put("bench_executor.csv", write_csv)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(results)), 4))
    xs = np.arange(len(results))
    ax.bar(xs, [r["tokens_per_s"] for r in results], color=["C1" if r["policy"] in HYBRIDS else "C0" for r in results])
    ax.scatter(xs, [r["bound_tokens_per_s"] for r in results], marker="_", s=400, color="k", label="bound")
    ax.scatter(xs, [r["ideal_split_bound_tokens_per_s"] for r in results], marker="_", s=400, color="C3",
               label="ideal-split bound")
    ax.set_xticks(xs, [label(r) for r in results], rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    title = f"{config['layers']} layers x {config['experts']} experts, {config['slots_per_layer']} slots/layer, {config['gpu']}"
    if summary:
        title += f"\nhybrid / best non-hybrid = {summary['ratio']:.2f}x"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    put("bench_executor.png", lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


def build_layers(args, rng: np.random.Generator) -> list[LayerExperts]:
    """``args.layers`` Q8_0 layers of random blocks: ``args.distinct_layers`` distinct, the rest
    copies of them (in their own memory, named for their layer)."""
    layers = []
    for l in range(args.layers):  # distinct random layers, copied into fresh memory for the rest
        if l < args.distinct_layers:
            layers.append(random_layer(rng, l, args.experts, args.hidden, args.ffn, Q.Q8_0, exact=False))
        else:
            src = layers[l % args.distinct_layers]
            tag = f"blk.{l % args.distinct_layers}."
            layers.append(LayerExperts(l, *(replace(t, data=t.data.copy(), name=t.name.replace(tag, f"blk.{l}."))
                                            for t in (src.gate, src.up, src.down))))
    return layers
