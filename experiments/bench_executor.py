"""Executor benchmark: cpu, lru, static and hybrid side by side on real kernels, beside the bound.

A Qwen3-30B-A3B-shaped Q8_0 MoE (default 48 layers x 128 experts, hidden 2048, ffn 768, top-8:
5.0 MB per expert, ~31 GB) is built in host RAM from random Q8_0 blocks (random int8 weights,
valid f16 scales; 4 distinct layers, the others copies of them in their own memory; no GGUF file: loading files is ``moelab replay``'s job). The GPU expert cache
is capped at ``--cache-mib`` MiB and at ``--cache-frac`` of each layer's experts (the smaller).

Routing: ``traces.synth`` (the preset ``qwen3-30b-a3b`` when it exists, else parameters fitted
here to ANCHORS' 48x128 LRU figures: 41/64/82/92% hits at 8/16/32/64 slots, per-sequence reset).
``static`` (and ``hybrid``) start from a profile counted on a separate trace of the same model.

Dense part (attention etc.): a fixed GPU stand-in per layer (RMSNorm + an fp16 [2048 x 5120] and
a [4096 x 2048] matmul, weights per layer), measured alone and included in the bound. No router
compute: the trace gives the routing.

The bound, per policy, from rates measured in this run: sum over layers of
``dense + max(GPU bytes / GPU rate, PCIe bytes / upload rate, CPU bytes / CPU rate)`` for the
decisions the policy made (background copies not counted), and the ``ideal split`` bound: the
same hits with every layer's misses split between PCIe and CPU in the best proportion.

Writes ``OUT/bench_executor.json`` (config + results) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from execute import quant as Q
from dataclasses import replace

from execute.experts import LayerExperts, random_layer
from scheduler.core import Capacity, Geometry
from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from scheduler.policies import make_policy
from scheduler.profile import Profile

# fitted with traces.synth.signature to ANCHORS' 48x128 top-8 LRU hit rates (see module docstring)
FALLBACK_PARAMS = dict(zipf_s=0.6, topic_concentration=0.3, reuse_prob=0.3, reuse_lag_tokens=2.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_trace(args, seed: int, num_tokens: int):
    from traces import synth

    preset = synth.PRESETS.get("qwen3-30b-a3b")
    params = preset.params if preset is not None else synth.SynthParams(**FALLBACK_PARAMS)
    return synth.generate(args.layers, args.experts, args.top_k, num_tokens, params, np.random.default_rng(seed)), \
        ("preset qwen3-30b-a3b" if preset is not None else f"fitted here {FALLBACK_PARAMS}")


class Dense:
    """The per-layer GPU stand-in for attention (see the module docstring)."""

    def __init__(self, cp, layers: int, hidden: int, rng: np.random.Generator):
        self.cp = cp
        g = cp.random.default_rng(int(rng.integers(2**31)))
        self.qkv = [(g.standard_normal((hidden, 5120), dtype=cp.float32) / np.sqrt(hidden)).astype(cp.float16)
                    for _ in range(layers)]
        self.o = [(g.standard_normal((4096, hidden), dtype=cp.float32) / 64).astype(cp.float16) for _ in range(layers)]

    def __call__(self, x, layer: int):
        cp = self.cp
        h = (x * cp.reciprocal(cp.sqrt(cp.mean(x * x, axis=1, keepdims=True) + 1e-6))).astype(cp.float16)
        a = cp.matmul(h, self.qkv[layer])[:, :4096]
        return x + cp.matmul(a, self.o[layer]).astype(cp.float32)


def measure_rates(cp, layers, gx, pool, dense, reps: int = 6) -> dict:
    """Upload, CPU-pool and GPU-kernel rates (GB/s) and the dense stand-in's time per layer."""
    eb = layers[0].expert_bytes
    n_slots = gx.arenas[0].size // gx.slot_bytes[0]
    k = min(8, n_slots)
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
    # GPU kernels: k resident experts, one token each
    times = []
    for i in range(reps * 4):
        lx = layers[i % len(layers)]
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(gx.compute)
        gx.run(lx.layer, list(range(k)), x1, [0] * k)
        stop.record(gx.compute)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    gpu_gbps = k * eb / float(np.median(times[2:])) / 1e9
    # CPU pool: k experts per call, rotating layers so L3 does not serve them
    xh = np.random.default_rng(1).standard_normal((k, layers[0].hidden)).astype(np.float32)
    pool.warmup(layers[0])
    cpu_t = []
    for i in range(reps * 2):
        lx = layers[(i * 7 + 3) % len(layers)]
        job = pool.submit(lx, list(range(k, 2 * k)), xh)
        job.result()
        cpu_t.append(job.compute_s)
    cpu_gbps = k * eb / float(np.median(cpu_t[1:])) / 1e9
    # dense stand-in
    with gx.compute:
        x = x1.copy()
        for layer in range(len(layers)):
            x = dense(x, layer)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        gx.compute.synchronize()
        t0 = time.perf_counter()
        for r in range(reps):
            for layer in range(len(layers)):
                x = dense(x, layer)
        gx.compute.synchronize()
    dense_s = (time.perf_counter() - t0) / (reps * len(layers))
    return {"upload_gbps": upload_gbps, "gpu_gbps": gpu_gbps, "cpu_gbps": cpu_gbps, "dense_s_per_layer": dense_s,
            "experts_per_measure": k}


def bound_s(decisions, eb: int, rates: dict) -> tuple[float, float]:
    """(bound of these decisions, ideal-split bound with the same hits), in seconds."""
    g, p, c, dn = rates["gpu_gbps"] * 1e9, rates["upload_gbps"] * 1e9, rates["cpu_gbps"] * 1e9, rates["dense_s_per_layer"]
    own = ideal = 0.0
    for d in decisions:
        n_gpu = len(d.hits) + len(d.uploads) + len(d.streams)
        n_pcie = len(d.uploads) + len(d.streams)
        own += dn + max(n_gpu * eb / g, n_pcie * eb / p, len(d.cpu) * eb / c)
        misses = n_pcie + len(d.cpu)
        ideal += dn + max(len(d.hits) * eb / g, misses * eb / (p + c))
    return own, ideal


def run_policy(cp, name, args, layers, geo, cap, profile, tokens, routing, dense, gx, rates, options) -> dict:
    from execute.engine import ExpertEngine

    pol = make_policy(name, geo, cap, profile=profile if name in ("static", "hybrid") else None, **options)
    engine = ExpertEngine(layers, cap, threads=args.threads, use_gpu=True, timeout_s=60, gpu=gx)
    engine.load_residents(pol.cache.slot)
    rng = np.random.default_rng(args.seed + 7)
    x0 = cp.asarray(rng.standard_normal((1, args.hidden)).astype(np.float32))
    eb = layers[0].expert_bytes
    timed, decisions = False, []
    up0 = hits = routed = 0
    t0 = None
    x = x0
    bg_bytes = 0
    for item in drive(pol, tokens):
        if isinstance(item, RunLayer):
            layer = item.step.layer
            with gx.compute:
                x = dense(x, layer)
            ids, w = routing[item.token.index][layer]
            x = engine.run_layer(item, x, ids[None, :], w[None, :])
            if timed:
                decisions.append(item.decision)
                hits += len(item.decision.hits)
                routed += len(item.step.experts)
        elif isinstance(item, StartBackground):
            engine.start_background(item.moves)
            if timed:
                bg_bytes += len(item.moves) * eb
        elif isinstance(item, AwaitBackground):
            engine.await_background(item.moves)
        elif isinstance(item, EndToken) and item.token.index == args.warmup - 1:
            engine.synchronize()
            timed, t0, up0 = True, time.perf_counter(), gx.bytes_uploaded
            stats0 = dict(vars(engine.stats))
            stats0.pop("per_layer_cpu_s")
            x = x0
    engine.synchronize()
    wall = time.perf_counter() - t0
    n = args.tokens
    own, ideal = bound_s(decisions, eb, rates)
    st = engine.stats
    engine.close()
    return {
        "policy": name, "options": options, "tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
        "hit_rate": hits / max(routed, 1), "uploaded_gb": (gx.bytes_uploaded - up0) / 1e9,
        "background_gb": bg_bytes / 1e9,
        "cpu_pairs": st.cpu_pairs - stats0["cpu_pairs"], "gpu_pairs": st.gpu_pairs - stats0["gpu_pairs"],
        "cpu_compute_s": st.cpu_compute_s - stats0["cpu_compute_s"], "cpu_wait_s": st.cpu_wait_s - stats0["cpu_wait_s"],
        "background_wait_s": st.background_wait_s - stats0["background_wait_s"],
        "bound_tokens_per_s": n / own, "ideal_split_bound_tokens_per_s": n / ideal,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cache-mib", type=float, default=4096)
    ap.add_argument("--cache-frac", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--policies", default="cpu,lru,static,hybrid")
    ap.add_argument("--miss-fracs", default="44", help="hybrid miss_frac_256 values to run (comma list)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    import cupy as cp

    from execute.cpu_experts import CpuExpertPool
    from execute.gpu_experts import GpuExperts

    rng = np.random.default_rng(args.seed)
    log(f"building {args.layers} x {args.experts} Q8_0 experts in host RAM")
    layers = []
    for l in range(args.layers):  # 4 distinct random layers, copied into fresh memory for the rest
        if l < 4:
            layers.append(random_layer(rng, l, args.experts, args.hidden, args.ffn, Q.Q8_0, exact=False))
        else:
            src = layers[l % 4]
            layers.append(LayerExperts(l, *(replace(t, data=t.data.copy(), name=t.name.replace(f"blk.{l % 4}.", f"blk.{l}."))
                                            for t in (src.gate, src.up, src.down))))
    eb = layers[0].expert_bytes
    geo = Geometry((args.experts,) * args.layers, args.top_k, (eb,) * args.layers)
    slots = min(Capacity.from_mib(geo, args.cache_mib).pools[0][1], int(args.cache_frac * args.experts))
    cap = Capacity.per_layer(geo, slots)
    log(f"{geo.total_expert_bytes / 1e9:.1f} GB of experts, {eb} B each; cache {slots} slots/layer = "
        f"{cap.slot_bytes(geo) / 2**20:.0f} MiB")
    total = args.warmup + args.tokens
    trace, trace_src = make_trace(args, args.seed + 1, total)
    prof_trace, _ = make_trace(args, args.seed + 2, 512)
    profile = Profile.from_counts(prof_trace.routing_counts(), slots=slots * args.layers)
    tokens = list(trace.tokens())
    wrng = np.random.default_rng(args.seed + 3)
    routing = [[(trace.expert_ids[t, l].astype(np.int64), wrng.dirichlet(np.ones(args.top_k)).astype(np.float32))
                for l in range(args.layers)] for t in range(total)]
    t0 = time.perf_counter()
    gx = GpuExperts(layers, cap, scratch_slots=16, pinned=True, timeout_s=60)
    pin_s = time.perf_counter() - t0
    log(f"pinned {len(gx.registered)} host buffers in {pin_s:.1f} s (staging: {gx.staging is not None})")
    dense = Dense(cp, args.layers, args.hidden, rng)
    with CpuExpertPool(args.threads, timeout_s=120) as pool:
        rates = measure_rates(cp, layers, gx, pool, dense)
    log("rates: " + ", ".join(f"{k} {v:.3g}" for k, v in rates.items()))
    results = []
    runs = [(p, {}) for p in args.policies.split(",") if p != "hybrid"]
    if "hybrid" in args.policies.split(","):
        runs += [("hybrid", {"miss_frac_256": int(f)}) for f in args.miss_fracs.split(",")]
    for name, options in runs:
        r = run_policy(cp, name, args, layers, geo, cap, profile, tokens, routing, dense, gx, rates, options)
        results.append(r)
        log(f"{name} {options}: {r['tokens_per_s']:.1f} tok/s, hits {r['hit_rate']:.3f}, bound {r['bound_tokens_per_s']:.1f}")
    gx.close()
    config = {k: v for k, v in vars(args).items()}
    config.update(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), trace=trace_src, slots_per_layer=slots,
                  expert_bytes=eb, total_expert_gb=geo.total_expert_bytes / 1e9, pin_s=pin_s,
                  gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), threads=args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench_executor.json.tmp"
    tmp.write_text(json.dumps({"config": config, "rates": rates, "results": results}, indent=1))
    os.replace(tmp, out / "bench_executor.json")
    best = max((r for r in results if r["policy"] != "hybrid"), key=lambda r: r["tokens_per_s"], default=None)
    print(f"\n{'policy':<22}{'tok/s':>8}{'hits':>7}{'up GB':>8}{'cpu pairs':>10}{'bound':>8}{'%bound':>8}{'ideal':>8}")
    for r in results:
        label = r["policy"] + ("" if not r["options"] else f" f={r['options']['miss_frac_256']}")
        print(f"{label:<22}{r['tokens_per_s']:8.1f}{r['hit_rate']:7.3f}{r['uploaded_gb']:8.2f}{r['cpu_pairs']:10d}"
              f"{r['bound_tokens_per_s']:8.1f}{100 * r['tokens_per_s'] / r['bound_tokens_per_s']:7.0f}%"
              f"{r['ideal_split_bound_tokens_per_s']:8.1f}")
    hyb = [r for r in results if r["policy"] == "hybrid"]
    if best and hyb:
        h = max(hyb, key=lambda r: r["tokens_per_s"])
        print(f"best hybrid f={h['options']['miss_frac_256']}: {h['tokens_per_s'] / best['tokens_per_s']:.2f}x the best "
              f"non-hybrid ({best['policy']}), {100 * h['tokens_per_s'] / h['bound_tokens_per_s']:.0f}% of its bound, "
              f"{100 * h['tokens_per_s'] / h['ideal_split_bound_tokens_per_s']:.0f}% of the ideal-split bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
