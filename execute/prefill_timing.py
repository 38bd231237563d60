"""Each stage of one prefill block timed on the GPU at a model's real shapes (``execute.prefill_stages``
counts them; ``experiments/bench_prefill_stages.py`` runs this).

:func:`time_stages` writes a one-block synthetic model (``execute.synth``, a preset's geometry,
Q8_0 experts, F16 dense matrices as the peer benchmark's file has them, a small vocabulary), loads it as ``moelab run --policy gpu`` does
(every expert resident, the batched experts of ``execute.prefill`` when ``MOELAB_PREFILL`` allows),
and times, on block 0 for a chunk of T tokens at position ``pos``:

- the model's own pieces (``MoeModel._rms``, ``_proj``, ``_attention``, ``_route``) on the default
  GPU chunk path (``execute.prefill_dense``: fused norms, F16 products on tensor cores, routing on
  the device, fused attention launches) and, as ``*_cupy``, ``*_tile`` and ``route_host``, on the
  CuPy path it replaced; the experts' ``run_layer`` (batched with ``pf_mm2`` and with ``pf_mm``, and
  the engine's grouped kernels) with the same decision;
- ``pf_mm`` and ``pf_mm2`` (``execute.prefill_mm2``) alone on the step's pairs, gate/up and down;
- references: a float16 cuBLAS product of the qkv shape (what the dense projection could cost)
  and a device-to-device copy (the bandwidth ceiling);
- one whole chunk through ``execute.driver.run`` (dense, routing, plan, experts, head), first the
  process's first chunk (one-time costs: CuPy kernels loaded, cuBLAS set up), then warm, then warm
  on the previous paths (``chunk_run_loop_old``: CuPy dense, ``pf_mm``); one warm chunk under
  ``cProfile`` names the host functions that take the most time (``host_profile``).

Each stage: ``warmup`` calls, then ``reps`` calls, each between two CUDA events on the stream its
work runs on, the host's time to return from the call taken too; medians. ``device_ms`` of a stage
with a host wait in it (``route``) includes the host's part.

:func:`chunk_profile` times whole chunks of a given model file (every block, as ``moelab run
--policy gpu`` runs its prompt, audit included): the first chunk after ``MoeModel.warm_up`` (the
prompt of a run), warm chunks, the host clock per block split as the driver splits it, Python's
garbage collections meanwhile (``gc.callbacks``), the same with the objects made so far frozen
(``gc.freeze``), and one warm chunk under ``cProfile``.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from . import quant as Q
from .prefill_stages import ChunkShape, fused_costs, stage_costs

__all__ = ["chunk_profile", "time_stages", "synth_block", "host_profile"]


def synth_block(path: Path, preset: str = "qwen3-30b-a3b", vocab: int = 1024, seed: int = 0,
                dense_quant: str = "F16") -> Path:
    """A one-block model of ``preset``'s geometry at ``path`` (Q8_0 experts; dense matrices in
    ``dense_quant``, F16 as in the peer benchmark's file)."""
    from .synth import config_from_preset, synth_model

    return synth_model(path, config_from_preset(preset, num_layers=1, vocab=vocab, quant="Q8_0",
                                                dense_quant=dense_quant, seed=seed))


_SPIN = r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
}
"""


def _timer(fn, stream, warmup: int, reps: int, gated: bool = True) -> tuple[float, float, float | None, object]:
    """Median device ms (events on ``stream`` around the call), host ms (until the call returns),
    kernel ms (the same events with the stream held busy by a spin kernel while the host queues
    the work, so that host gaps drop out; None when not ``gated``) of ``fn()``, and its last result."""
    import cupy as cp

    out = None
    for _ in range(warmup):
        out = fn()
    cp.cuda.Device().synchronize()
    dev, host, kern = [], [], []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        t0 = time.perf_counter()
        out = fn()
        host.append(1e3 * (time.perf_counter() - t0))
        b.record(stream)
        b.synchronize()
        dev.append(cp.cuda.get_elapsed_time(a, b))
    if gated:
        spin = cp.RawKernel(_SPIN, "spin")
        hold = int(1e6 * (2.0 * max(host) + 1.0))  # ns: longer than the host takes to queue the work
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            with stream:
                spin((1,), (1,), (np.int64(hold),))
            a.record(stream)
            out = fn()
            b.record(stream)
            b.synchronize()
            kern.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(dev)), float(np.median(host)), float(np.median(kern)) if kern else None, out


def host_profile(fn, top: int = 15) -> dict[str, list[dict]]:
    """The functions where ``fn()`` spends its host time (``cProfile``): the ``top`` by own time
    (``"own"``) and by cumulative time (``"cumulative"``), each ``{function, calls, own_ms,
    cumulative_ms}``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    st = pstats.Stats(prof)
    rows = [{"function": f"{Path(f).name}:{line}({name})", "calls": int(nc), "own_ms": 1e3 * tt,
             "cumulative_ms": 1e3 * ct} for (f, line, name), (_, nc, tt, ct, _) in st.stats.items()]
    return {k: sorted(rows, key=lambda r: -r[f"{k}_ms"])[:top] for k in ("own", "cumulative")}


class _NoPrepare:
    """A backend without ``prepare`` (its residents are up already; the CPU pool is never used)."""

    def __init__(self, backend):
        self._b = backend

    def __getattr__(self, name):
        if name == "prepare":
            raise AttributeError(name)
        return getattr(self._b, name)


def time_stages(tokens: int = 256, pos: int = 0, preset: str = "qwen3-30b-a3b", reps: int = 20, warmup: int = 3,
                workdir: str | None = None, threads: int = 4, dense_quant: str = "F16") -> dict:
    """Rows ``{stage, device_ms, host_ms, MB, GFLOP, GB/s, TFLOP/s, note}`` and the setup's seconds
    (module docstring); ``workdir`` holds the synthetic model (a temporary directory when None)."""
    import cupy as cp

    from scheduler import Capacity, make_policy
    from scheduler.drive import RunLayer

    from .backends import EngineExperts
    from .batch_route import merge_rows
    from .driver import ChunkInput, run
    from .gguf_model import load_model
    from .model import MoeModel

    t_start = time.perf_counter()
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="moelab_stages_")
        workdir = tmp.name
    path = synth_block(Path(workdir) / f"{preset}-1block.gguf", preset, dense_quant=dense_quant)
    t_synth = time.perf_counter()
    weights = load_model(path, lazy_dense=True)  # as moelab run loads it
    info = weights.info
    shape = ChunkShape(tokens, pos, info.hidden, info.num_heads, info.num_kv_heads, info.head_dim,
                       info.num_experts[0], info.top_k, info.ffn,
                       dense_bytes_per_weight={"F32": 4.0, "F16": 2.0, "BF16": 2.0}.get(dense_quant, 34 / 32))
    geo = info.geometry()
    cap = Capacity.per_layer(geo, list(geo.num_experts))
    policy = make_policy("gpu", geo, cap)
    backend = EngineExperts(weights, cap, threads, True, 60.0, pinned=True)
    model = MoeModel(weights, use_gpu=True, max_tokens=pos + tokens + 1)
    backend.engine.load_residents(dict(policy.cache.slot))  # not prepare(): no CPU pool (Numba) warmup
    cp.cuda.Device().synchronize()
    t_ready = time.perf_counter()
    rows: list[dict] = []
    costs = {s.name: s for s in stage_costs(shape) + fused_costs(shape)}
    try:
        rng = np.random.default_rng(0)
        w = model.layers[0]
        null = cp.cuda.get_current_stream()
        # one whole chunk through the run loop (one block, the head of a small vocabulary), first of
        # all: the first call is the process's first chunk (CuPy's elementwise kernels loaded or
        # compiled, cuBLAS's handle made), as a moelab run's prompt is
        chunk = tuple(int(t) for t in rng.integers(0, info.vocab, tokens))
        walls = []
        for r in range(1 + warmup + max(reps // 4, 3)):
            res = run(model, _NoPrepare(backend), policy, [ChunkInput(r, r, 0, "prefill", chunk)])
            cp.cuda.Device().synchronize()
            walls.append(res)

        def split(rs) -> str:
            return "dense {:.3f} ms, experts {:.3f} ms, other {:.3f} ms (host clock)".format(
                *(1e3 * float(np.median([v(r) for r in rs])) for v in
                  (lambda r: r.dense_s.sum(), lambda r: r.experts_s.sum(), lambda r: r.other_s)))

        keep = walls[1 + warmup:]
        rows.append({"stage": "chunk_first_call", "device_ms": None, "host_ms": 1e3 * walls[0].wall_s,
                     "note": "the process's first chunk: " + split(walls[:1])})
        rows.append({"stage": "chunk_run_loop", "device_ms": None,
                     "host_ms": 1e3 * float(np.median([r.wall_s for r in keep])),
                     "note": "driver.run of one chunk, warm: " + split(keep)})
        profile = host_profile(lambda: run(model, _NoPrepare(backend), policy, [ChunkInput(0, 0, 0, "prefill", chunk)]))
        # the same chunk on the previous paths: CuPy dense (no prefill_dense) and pf_mm experts
        batched = backend.batched
        mm2 = dict(batched._use_mm2) if batched is not None else {}
        pd, model.pd = model.pd, None
        if batched is not None:
            batched._use_mm2 = {k: False for k in mm2}
        try:
            old = []
            for r in range(warmup + max(reps // 4, 3)):
                res = run(model, _NoPrepare(backend), policy, [ChunkInput(r, r, 0, "prefill", chunk)])
                cp.cuda.Device().synchronize()
                old.append(res)
        finally:
            model.pd = pd
            if batched is not None:
                batched._use_mm2 = mm2
        old = old[warmup:]
        rows.append({"stage": "chunk_run_loop_old", "device_ms": None,
                     "host_ms": 1e3 * float(np.median([r.wall_s for r in old])),
                     "note": "the same, MOELAB_PREFILL_DENSE=0 and MOELAB_PREFILL_MM=1's paths: " + split(old)})
        x = cp.asarray(rng.standard_normal((tokens, info.hidden)).astype(np.float32))
        o_in = cp.asarray(rng.standard_normal((tokens, info.num_heads * info.head_dim)).astype(np.float32) * 0.1)
        model.pos = pos

        def add(stage, fn, stream=null, cost=None, note="", gated=True):
            d, h, k, out = _timer(fn, stream, warmup, reps, gated)
            c = costs.get(cost or stage)
            row = {"stage": stage, "device_ms": d, "kernel_ms": k, "host_ms": h, "note": note or (c.note if c else "")}
            if c is not None:
                best = k if k else d
                row.update({"MB": c.bytes / 1e6, "GFLOP": c.flops / 1e9, "launches": c.launches,
                            "GB/s": c.bytes / 1e6 / max(best, 1e-9), "TFLOP/s": c.flops / 1e9 / max(best, 1e-9)})
            rows.append(row)
            return out

        def cupy_path(fn):  # fn on the CuPy dense path (MOELAB_PREFILL_DENSE=0's)
            def call():
                pd, model.pd = model.pd, None
                try:
                    return fn()
                finally:
                    model.pd = pd
            return call

        fused = model.pd is not None
        qt = getattr(w["wqkv"], "qt", None)
        f16 = fused and qt == Q.F16
        proj_note = {Q.F16: "f16 halves on tensor cores (cuBLAS)", Q.Q8_0: "weights and activations as f16 halves, "
                  "three cuBLAS products", Q.BF16: "weights and activations as f16 halves, three cuBLAS products"}
        h = add("attn_norm", lambda: model._rms(x, w["attn_norm"]), cost="attn_norm_fused" if fused else None,
                note="pd_rmsnorm (one launch)" if fused else "")
        add("attn_norm_cupy", cupy_path(lambda: model._rms(x, w["attn_norm"])), cost="attn_norm")
        add("qkv_proj", lambda: model._proj(h, w["wqkv"]), cost="qkv_proj_f16" if f16 else None,
            note=proj_note.get(qt, "") if fused else "")
        add("qkv_proj_tile", cupy_path(lambda: model._proj(h, w["wqkv"])), cost="qkv_proj")
        add("attention_block", lambda: model._attention(0, h),
            note="qkv_proj + qk/rope/kv (pd_qk_rope_kv) + attention (cuBLAS, pd_softmax) + o_proj" if fused
            else "qkv_proj + qk_norm_rope + attention + o_proj")
        add("attention_block_cupy", cupy_path(lambda: model._attention(0, h)),
            note="qkv_proj + qk_norm_rope + attention + o_proj, CuPy expressions and float32 tiles")
        add("o_proj", lambda: model._proj(o_in, w["wo"]), cost="o_proj_f16" if f16 else None,
            note=proj_note.get(qt, "") if fused else "")
        add("o_proj_tile", cupy_path(lambda: model._proj(o_in, w["wo"])), cost="o_proj")
        hn = add("ffn_norm", lambda: model._rms(x, w["ffn_norm"]), cost="ffn_norm_fused" if fused else None,
                 note="pd_rmsnorm (one launch)" if fused else "")
        add("ffn_norm_cupy", cupy_path(lambda: model._rms(x, w["ffn_norm"])), cost="ffn_norm")
        add("router_proj", lambda: model._proj(hn, w["router"]))
        add("router_proj_tile", cupy_path(lambda: model._proj(hn, w["router"])), cost="router_proj")
        ids, wts = add("route", lambda: model._route(0, hn, None), cost="route_gpu" if fused else "route_host",
                       note="router_proj + pd_route (float64 top-k on the device) + one copy of ids and weights "
                       "(host wait inside)" if fused else "router_proj + logits to the host + top-k (host wait inside)",
                       gated=False)
        ids_h, wts_h = add("route_host", cupy_path(lambda: model._route(0, hn, None)),
                           note="router_proj + logits to the host + top-k in float64 numpy (host wait inside)",
                           gated=False)
        rows[-1]["note"] += (f"; ids equal to the device's: {bool(np.array_equal(ids, ids_h))}, weights' largest "
                             f"relative difference {float(np.max(np.abs(wts - wts_h) / np.maximum(np.abs(wts_h), 1e-300))):.1e}")
        step = add("step", lambda: merge_rows(0, ids, wts), note="merge_rows (host)", gated=False)
        d = policy.plan(step)
        policy.commit(d)
        wf = wts.astype(np.float32)
        gx = backend.engine.gpu
        if batched is not None and batched.takes(d, ids):
            add("experts_batched", lambda: batched.run_layer(d, hn, ids, wf), gx.compute, cost="experts",
                note=f"BatchedExperts.run_layer ({'pf_mm2' if batched._use_mm2.get(0) else 'pf_mm'}), device time "
                "on its stream")

            def pf_mm_layer():
                keep, batched._use_mm2 = batched._use_mm2, {k: False for k in batched._use_mm2}
                try:
                    return batched.run_layer(d, hn, ids, wf)
                finally:
                    batched._use_mm2 = keep

            add("experts_batched_pf_mm", pf_mm_layer, gx.compute, cost="experts",
                note="BatchedExperts.run_layer with pf_mm (MOELAB_PREFILL_MM=1), device time on its stream")
        item = RunLayer(None, step, d)
        add("experts_engine", lambda: backend.engine.run_layer(item, hn, ids, wf), gx.compute, cost="experts",
            note="ExpertEngine.run_layer (grouped kernels, MOELAB_PREFILL=0's path)")
        # the product kernels alone on this step's pairs: pf_mm (BatchedExperts') against pf_mm2
        from . import prefill_mm2 as M2
        from .prefill import _kernel as pf_kernel, _tiles

        lx = backend.engine.layers[0]
        if M2.applies(lx) and int(cp.cuda.Device().compute_capability) >= 80:
            order = list(d.hits)
            rank = np.full(lx.num_experts, -1, np.int64)
            rank[order] = np.arange(len(order))
            counts = np.bincount(rank[ids.reshape(-1)], minlength=len(order))
            trow, tn, tgr, _ = _tiles(counts)
            tiles = tuple(cp.asarray(v) for v in (trow, tn, tgr))
            base = cp.asarray(np.array([gx.source_ptr(0, backend.engine.slot_of[(0, e)]) for e in order], np.uint64))
            R, H, F = int(counts.sum()), lx.hidden, lx.ffn
            split = pf_kernel("pf_split")

            def halves(v):
                hi, lo, iv = cp.empty(v.shape, cp.uint16), cp.empty(v.shape, cp.uint16), cp.empty(len(v), cp.float32)
                split((len(v),), (256,), (v, np.uint64(0), np.int32(v.shape[1]), hi, lo, iv))
                return hi, lo, iv

            a_in = halves(cp.asarray(rng.standard_normal((R, H)).astype(np.float32)))
            h_in = halves(cp.asarray(rng.standard_normal((R, F)).astype(np.float32) * 0.1))
            off_g, off_u, off_d = lx.device_offsets()
            rb_h, rb_f = Q.row_bytes(Q.Q8_0, H), Q.row_bytes(Q.Q8_0, F)
            outs = {}
            for name, f in (("pf_mm", pf_kernel("pf_mm")), ("pf_mm2", M2.kernel())):
                hf, y = cp.empty((R, F), cp.float32), cp.empty((R, H), cp.float32)
                for mode, args, out, wbytes in ((0, (a_in, H, F, off_g, off_u, rb_h), hf, 2 * F * rb_h),
                                                (1, (h_in, F, H, off_d, 0, rb_f), y, H * rb_f)):
                    dm, hm, km, _ = _timer(lambda: M2.launch(f, base, tiles, args[0], *args[1:], mode, out), null,
                                           warmup, reps)
                    mb = len(trow) * wbytes / 1e6
                    rows.append({"stage": f"{name}_{'gate_up' if mode == 0 else 'down'}", "device_ms": dm, "kernel_ms": km,
                                 "host_ms": hm, "MB": mb, "GB/s": mb / max(km, 1e-9),
                                 "note": f"{len(trow)} tiles, {R} pair rows; MB: the tiles' weight reads"})
                outs[name] = (hf.get(), y.get())
            same = all(np.array_equal(a, b) for a, b in zip(outs["pf_mm"], outs["pf_mm2"]))
            rows[-1]["note"] += f"; pf_mm2 equals pf_mm bit for bit: {same}"
        # references
        qkv_rows = (info.num_heads + 2 * info.num_kv_heads) * info.head_dim
        a16 = cp.asarray(rng.standard_normal((tokens, info.hidden)), cp.float16)
        b16 = cp.asarray(rng.standard_normal((qkv_rows, info.hidden)) * 0.02, cp.float16)
        flops = 2.0 * tokens * qkv_rows * info.hidden
        dms, hms, kms, _ = _timer(lambda: a16 @ b16.T, null, warmup, reps)
        rows.append({"stage": "ref_f16_gemm_qkv", "device_ms": dms, "kernel_ms": kms, "host_ms": hms, "GFLOP": flops / 1e9,
                     "TFLOP/s": flops / 1e9 / max(kms, 1e-9), "note": "cuBLAS f16 product of the qkv shape"})
        src = cp.empty(1 << 30, cp.uint8)
        dst = cp.empty_like(src)
        dms, hms, _, _ = _timer(lambda: dst.__setitem__(slice(None), src), null, 1, 5, False)
        rows.append({"stage": "ref_copy_1GiB", "device_ms": dms, "host_ms": hms, "MB": 2 * src.nbytes / 1e6,
                     "GB/s": 2 * src.nbytes / 1e6 / max(dms, 1e-9), "note": "device-to-device copy (read + write)"})
        del src, dst
    finally:
        backend.close()
        if tmp is not None:
            tmp.cleanup()
    return {"shape": dataclasses.asdict(shape), "rows": rows, "host_profile": profile,
            "setup_s": {"synth": t_synth - t_start, "load_and_prepare": t_ready - t_synth},
            "prefill_env": os.environ.get("MOELAB_PREFILL", "1"), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}


class _GcClock:
    """Collections and their host seconds per generation while installed (``gc.callbacks``)."""

    def __init__(self):
        self.n, self.s, self._t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = int(info.get("generation", 0))
            self.n[g] += 1
            self.s[g] += time.perf_counter() - self._t

    def __enter__(self):
        import gc

        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self)


def chunk_profile(path, tokens: int = 256, reps: int = 5, threads: int = 4, top: int = 25) -> dict:
    """Chunks of ``tokens`` random ids at position 0 through ``execute.driver.run`` on the model at
    ``path`` with every expert resident (policy ``gpu``, an audit as ``moelab run`` keeps), block by
    block and with the whole chunk on the device (``execute.prefill_device``) side by side: rows
    ``{case, wall_ms, per_block_ms, dense_ms, experts_ms, other_ms, gc, queue_ms, wait_ms, gpu_ms}``
    for the first chunk after the warm-up (device path), then ``reps`` warm chunks of each path
    interleaved (medians; the device path's host queueing, host wait and device time of its blocks
    per chunk); whether the two paths' logits are identical; the cProfile of one warm chunk of each
    path (:func:`host_profile`)."""
    import gc

    import cupy as cp

    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit

    from .backends import EngineExperts
    from .driver import ChunkInput, run
    from .gguf_model import load_model
    from .model import MoeModel
    from .prefill_device import DeviceChunk

    t0 = time.perf_counter()
    weights = load_model(path, lazy_dense=True)
    info = weights.info
    geo = info.geometry()
    cap = Capacity.per_layer(geo, list(geo.num_experts))
    policy = make_policy("gpu", geo, cap)
    backend = EngineExperts(weights, cap, threads, True, 60.0, pinned=True)
    rows: list[dict] = []
    try:
        model = MoeModel(weights, use_gpu=True, max_tokens=tokens + 1)
        backend.engine.load_residents(dict(policy.cache.slot))
        model.warm_up(tokens)
        dev = DeviceChunk.build(model, backend.engine, backend.batched) if backend.batched is not None else None
        cp.cuda.Device().synchronize()
        t_ready = time.perf_counter()
        chunk = tuple(int(t) for t in np.random.default_rng(0).integers(0, info.vocab, tokens))
        blocks = info.num_layers
        logits, same = {}, []

        def once(r: int, on: bool):
            model.device_chunk = dev if on else False
            audit = Audit(geo, profile_residents=policy.cache.slot.keys(), keep_log=True, record_routes=True)
            with _GcClock() as g:
                res = run(model, _NoPrepare(backend), policy, [ChunkInput(r, r, 0, "prefill", chunk)], audit=audit)
                cp.cuda.Device().synchronize()
            logits[on] = cp.asnumpy(model.logits)
            took = dev is not None and on and dev.chunks > chunks[0]
            chunks[0] = dev.chunks if dev is not None else 0
            dq = (dev.queue_s, dev.wait_s, dev.gpu_s) if took else (float("nan"),) * 3
            return res, g, dq

        chunks = [0]

        def row(case: str, runs) -> dict:
            med = lambda f: float(np.median([f(r) for r, _, _ in runs]))  # noqa: E731
            wall = 1e3 * med(lambda r: r.wall_s)
            dq = [1e3 * float(np.median([d[i] for _, _, d in runs])) / blocks for i in range(3)]
            return {"case": case, "runs": len(runs), "wall_ms": wall, "per_block_ms": wall / blocks,
                    "tokens_per_s": tokens / wall * 1e3, "dense_ms": 1e3 * med(lambda r: r.dense_s.sum()),
                    "experts_ms": 1e3 * med(lambda r: r.experts_s.sum()), "other_ms": 1e3 * med(lambda r: r.other_s),
                    "queue_ms_per_block": dq[0], "wait_ms_per_block": dq[1], "gpu_ms_per_block": dq[2],
                    "gc_collections": [int(np.median([g.n[i] for _, g, _ in runs])) for i in range(3)],
                    "gc_ms": [1e3 * float(np.median([g.s[i] for _, g, _ in runs])) for i in range(3)]}

        on_first = dev is not None
        rows.append(row("first_chunk_after_warm_up" + (" (device)" if on_first else ""), [once(0, on_first)]))
        runs = {False: [], True: []}
        for r in range(reps):
            for on in ((False, True) if dev is not None else (False,)):
                runs[on].append(once(1 + r, on))
                if on:
                    same.append(bool(np.array_equal(logits[True], logits[False])))
        rows.append(row("warm, block by block", runs[False]))
        if dev is not None:
            rows.append(row("warm, chunk on the device", runs[True]))
        profile = {f"{key} ({name})": v for on, name in (((False, "block by block"), (True, "device"))
                                                        if dev is not None else ((False, "block by block"),))
                   for key, v in host_profile(lambda: once(0, on), top=top).items()}
    finally:
        backend.close()
    return {"model": str(path), "blocks": blocks, "tokens": tokens, "rows": rows, "host_profile": profile,
            "device_chunks": 0 if dev is None else dev.chunks, "device_reruns": 0 if dev is None else dev.reruns,
            "logits_identical": None if dev is None else all(same),
            "gc_objects": len(gc.get_objects()), "setup_s": t_ready - t0,
            "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
