"""Calibration measurements: each part of the executor timed alone, repeated, as ``stats``.

CPU side (no GPU): random experts in host RAM (``build_layers``), the scheduler's planning per
layer step for each policy, the engine's polling sleep, host memory read bandwidth, the CPU
expert pool per call and by quant type and thread count. GPU side (``GpuTimer``: CUDA events on a
stream held by a spin kernel while the work is queued, so GPU time alone; host time of calls
made back to back, warm): device copy and matmul rates, the link by copy size, expert uploads,
batches and the combine, the dense stand-in at four widths, and ``ExpertEngine.run_layer``'s host
phases (``cpu_layer_parts`` splits a layer with CPU experts by the pool job's stamps).
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from scheduler.core import Capacity, Decision, Geometry, Step, Token
from scheduler.drive import RunLayer, drive
from scheduler.policies import make_policy

from . import quant as Q
from .calibrate_fit import fit_line, fit_table, stats
from .experts import LayerExperts, random_layer
from .standin import StandIn

__all__ = ["PLAN_POLICIES", "SPIN_S", "PHASES", "COLD_SET_BYTES", "MEM_READ_BYTES", "cold_set_shape", "build_layers",
           "synth_tokens", "measure_plan_s", "measure_poll_s",
           "measure_cpu_mem_gbps", "measure_cpu_pool", "measure_cpu_types", "GpuTimer", "measure_gpu_basics",
           "measure_link", "measure_gpu_experts", "measure_dense", "cpu_layer_parts", "measure_engine"]

PLAN_POLICIES = ("cpu", "gpu", "lru", "freq-lru", "static", "hybrid", "hybrid-cost", "predict", "lookahead")
SPIN_S = 0.004  # how long the spin kernel holds a stream while work is queued behind it
# Host memory the CPU side holds at once, each many times a last-level cache (so reads come from
# DRAM) and a small share of RAM: the experts the pool's calls rotate over (per other quant type:
# half as many bytes, beside them), and the buffer of the memory read, freed before the experts
# are built.
COLD_SET_BYTES = 384 << 20
MEM_READ_BYTES = 512 << 20


def cold_set_shape(num_layers: int, num_experts: int, expert_bytes: int,
                   budget: int = COLD_SET_BYTES) -> tuple[int, int]:
    """``(layers, experts per layer)`` of the random experts the CPU pool is timed on: the model's
    shape when it fits ``budget`` bytes, else fewer experts per layer (at least 8, the largest
    call), then fewer layers (at least 1)."""
    per_layer = max(8, min(num_experts, budget // max(1, num_layers * expert_bytes)))
    return max(1, min(num_layers, budget // (per_layer * expert_bytes))), per_layer


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

    ``hybrid-cost`` and ``lookahead`` price their decisions with ``cost_model`` (default:
    qwen3-30b-a3b's on the h200-xeon16 preset, its layers repeated to ``geometry``'s count: the
    planning work is what is timed here, not the quality of its split)."""
    if {"hybrid-cost", "lookahead"} & set(policies) and cost_model is None:
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


def measure_cpu_mem_gbps(threads: int, nbytes: int = MEM_READ_BYTES, reps: int = 5) -> dict:
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
    from .cpu_pool import CpuExpertPool

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


def measure_gpu_basics(cp, timer: GpuTimer, reps: int) -> dict:
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


def measure_link(cp, timer: GpuTimer, reps: int) -> dict:
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


def measure_gpu_experts(cp, timer: GpuTimer, gx, layers, reps: int) -> dict:
    """Expert uploads, GPU expert batches (metadata copy + kernels, as the engine queues them), the
    one-token path (``gate_up1`` + ``down_combine1``, 1..8 experts) and the combine, through
    ``GpuExperts``; host time of each per-layer call."""
    hidden = layers[0].hidden
    with gx.compute:
        x1 = gx.as_input(cp.asarray(np.random.default_rng(0).standard_normal((1, hidden)).astype(np.float32)))
    out = {"upload": {}, "upload_host": {}, "batch": {}, "one": {}, "calls_host": {}}
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
    bases = [gx.source_ptr(0, s) for s in range(8)]
    for n in (1, 2, 4, 8):  # the one-token path (the pair table by value, down and combine in one launch)
        def one(n=n):
            gx.pack1(bases[:n], [1.0 / n] * n, list(range(n)))
            gx.gate_up1(0, x1, n, n)
            gx.down_combine1(0, n)
        out["one"][n] = timer.gpu(gx.compute, one, reps)
    meta8 = _meta(gx, 8)
    y8 = gx.pair_outputs(0, 8)
    out["combine"] = timer.gpu(gx.compute, lambda: gx.combine_meta(meta8, y8), reps)
    calls = {"layer_meta": lambda: _meta(gx, 8), "expert_call": lambda: gx.run_groups(0, meta8, 0, 8, x1, 8),
             "combine": lambda: gx.combine_meta(meta8, y8)}
    for name, fn in calls.items():
        out["calls_host"][name] = timer.host(gx.compute, fn, reps)
    gx.wait(gx.all_done_event(), "calibration kernels")
    return out


def measure_dense(cp, timer: GpuTimer, gx, args, reps: int) -> dict:
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


PHASES = ("host_plan_s", "input_wait_s", "host_queue_s", "host_combine_s", "cpu_compute_s")


def cpu_layer_parts(t_call: float, t_ret: float, d: dict, job) -> dict:
    """One layer with CPU experts split into the engine's phases (seconds), from the host clock
    around ``run_layer`` (``t_call``, ``t_ret``), its ``LayerStats`` deltas ``d`` and the CPU job's
    stamps: plan (before anything is queued), submit (input fetch and row gather up to the submit),
    handoff (the submit's rest and the GIL hand-off), queue (GPU work queued while the pool runs),
    start (submit -> the pool starts), compute, ret (pool done -> caller resumes), combine (rows'
    upload and combine queued). A call handed off through mapped memory (``job.gated``: no host
    wait) has plan (its submit and the input's put included) and queue; its start and end are
    the hand-off's edges, measured on the GPU's clock (``handoff_in_s``/``handoff_out_s``), and its
    compute is known once the call is done (0.0 before)."""
    if getattr(job, "gated", False):
        job.poll()
        return {"plan": d["host_plan_s"], "submit": 0.0, "handoff": 0.0, "queue": d["host_queue_s"], "start": 0.0,
                "compute": job.compute_s, "ret": 0.0, "combine": 0.0}
    t1 = t_call + d["host_plan_s"]
    return {"plan": d["host_plan_s"], "submit": job.submitted_s - t1,
            "handoff": t1 + d["input_wait_s"] - job.submitted_s, "queue": d["host_queue_s"],
            "start": job.started_s - job.submitted_s, "compute": job.finished_s - job.started_s,
            "ret": job.collected_s - job.finished_s, "combine": t_ret - job.collected_s}


def measure_engine(cp, timer: GpuTimer, engine, layers, reps: int, seed: int) -> dict:
    """Host time of ``ExpertEngine.run_layer`` by phase: hits-only and upload layers (whole, plan,
    queue, combine), and layers with one hit and 1..8 CPU experts (``cpu_layer_parts``)."""
    rng = np.random.default_rng(seed)
    hidden, L = layers[0].hidden, len(layers)
    with engine.gpu.compute:
        x = cp.asarray(rng.standard_normal((1, hidden)).astype(np.float32))
    engine.load_residents({(l, e): e for l in range(L) for e in range(16)})
    tok = Token(0, 0, 0, "decode", ())
    st = engine.stats
    snap = lambda: {k: getattr(st, k) for k in PHASES}

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
                    d = {k: s1[k] - s0[k] for k in PHASES}
                    for k, v in cpu_layer_parts(t0, t1, d, jobs[-1]).items():
                        parts.setdefault(k, []).append(v)
            out["cpu_layer"][n] = {k: stats(v) for k, v in parts.items()}
    finally:
        del engine.pool.submit
    ho = engine.handoff
    if ho is not None:  # the CPU layers went through the mapped-memory hand-off: its two edges
        ho.collect(engine.stats, final=True)
        e = np.array(ho.edges.last, np.float64).reshape(-1, 2)
        if len(e):
            out["handoff"] = {"in": stats(e[:, 0].tolist()), "out": stats(e[:, 1].tolist())}
    return out


def measure_cpu_types(args, layers, rng) -> tuple[dict, dict]:
    from .cpu_pool import CpuExpertPool

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
        eb = 2 * args.ffn * Q.row_bytes(qt, args.hidden) + args.hidden * Q.row_bytes(qt, args.ffn)
        lx = _type_layer(rng, qt, max(16, cold_set_shape(1, 64, eb, COLD_SET_BYTES // 2)[1]), args.hidden, args.ffn)
        quant[Q.QTYPES[qt].name] = rate([lx], args.threads)
        del lx
    threads = {t: rate(layers, t) for t in sorted({4, 8, 12, args.threads}) if t <= args.threads}
    return quant, threads


def _type_layer(rng: np.random.Generator, qt: int, num_experts: int, hidden: int, ffn: int) -> LayerExperts:
    """``random_layer`` of ``num_experts`` built 4 experts at a time into its final arrays: a float
    type's float32 draw then never holds more than 4 experts."""
    out = None
    for i in range(0, num_experts, 4):
        lx = random_layer(rng, 0, min(4, num_experts - i), hidden, ffn, qt, exact=False)
        tensors = (lx.gate, lx.up, lx.down)
        if out is None:
            out = [(t, np.empty((num_experts,) + t.data.shape[1:], t.data.dtype)) for t in tensors]
        for (_, dst), t in zip(out, tensors):
            dst[i:i + len(t.data)] = t.data
    return LayerExperts(0, *(replace(t, data=d) for t, d in out))
