"""Decode speed with and without the token graph (``execute.token_graph``), side by side in one run.

For each policy, the same decode tokens (random ids, one sequence) run on a GGUF through
``execute.model.run`` with the expert engine, in each of ``--modes``: ``plain`` block by block
(``MOELAB_TOKEN_GRAPH=0``), ``graph`` the token graph without pipelining, ``pipelined`` the token
graph with the next token launched while the host settles the last (the default); ``cpuplain`` and
``cpugraph`` run the policy wrapped in ``scheduler.graph.CpuMisses`` (every miss of a decode token on
the CPU pool, its upload a fill after the token), block by block and as one graph whose blocks hand
their misses to the pool (``MOELAB_GRAPH_CPU=1``, ``execute.graph_cpu``); ``cpustream`` as
``cpugraph`` with each block's step settled while the graph runs (``MOELAB_GRAPH_CPU_STREAM=1``). The first
``--warmup`` tokens are not timed. Prints and writes (``--out``/bench_token_graph.json) per run:
tokens/s, wall time per layer step, host time in the engine per layer step (``run_layer`` or
``settle_layer``: plan + queue + combine), the host's time blocked on graphs per layer step (wait:
the GPU's share the host did not overlap), the graphs' device time per block (CUDA events around
each launch), the tokens launched ahead, the share of tokens the graph completed, the hit rate, the
CPU pairs and the hand-off's edges per call; then each mode / the first mode per policy.

    python experiments/bench_token_graph.py MODEL.gguf --policies gpu,lru,hybrid --cache-mib 2048
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

MODES = ("plain", "graph", "pipelined", "cpuplain", "cpugraph", "cpustream")


def _graph_counts(model) -> tuple:
    """The token graph's counters: tokens tried, completed, host wait, launched ahead, device time."""
    tg = getattr(model, "token_graph", None)
    return (tg.tokens, tg.complete, tg.wait_s, tg.launched_ahead, tg.gpu_s) if tg is not None else (0, 0, 0.0, 0, 0.0)


def kernel_times(model, tg, pos: int, n: int) -> dict:
    """Per launch name: microseconds per block, the mean of ``n`` tokens at ``pos`` run as plain
    launches with an event after each (``TokenGraph.time_launches``)."""
    info = model.info
    emb = np.ascontiguousarray(model.token_embd[0] * np.float32(info.embedding_scale), np.float32)
    sums: dict = {}
    for _ in range(n):
        model.gd.emb.set(emb)
        for name, ms in tg.time_launches(pos):
            sums[name] = sums.get(name, 0.0) + 1e3 * ms / (n * info.num_layers)
    return sums


def run_one(weights, policy: str, cache_mib: float, tokens: list[int], warmup: int, mode: str, threads: int,
            max_fills: int | None = None, kernels: str = "", timed: int = 0) -> dict:
    from execute import model as M
    from execute.token_graph import TokenGraph
    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit
    from scheduler.graph import CpuMisses

    os.environ["MOELAB_TOKEN_GRAPH"] = "0" if mode in ("plain", "cpuplain") else "1"
    os.environ["MOELAB_GRAPH_CPU"] = "1" if mode.startswith(("cpugraph", "cpustream")) else "0"
    os.environ["MOELAB_GRAPH_CPU_STREAM"] = "1" if mode.startswith("cpustream") else "0"
    TokenGraph.pipeline = mode == "pipelined"
    if kernels:
        os.environ["MOELAB_DECODE_KERNELS"] = kernels
    info = weights.info
    g = info.geometry()
    cap = Capacity.per_layer(g, max(info.num_experts)) if policy == "gpu" else Capacity.from_mib(g, cache_mib)
    model = M.MoeModel(weights, use_gpu=True, max_tokens=len(tokens) + 1)
    backend = M.EngineExperts(weights, cap, threads, use_gpu=True)
    audit = Audit(g)
    marks: dict = {}

    def progress(n: int) -> None:
        if n == warmup:
            marks["t0"] = time.perf_counter()
            marks["stats"] = dict(vars(backend.engine.stats))
            marks["tg"] = _graph_counts(model)
            tg = getattr(model, "token_graph", None)
            marks["cpu"] = tg.cpu.cpu_pairs if tg is not None and tg.cpu is not None else 0

    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        pol = make_policy(policy, g, cap)
        M.run(model, backend, CpuMisses(pol, max_fills) if mode.startswith("cpu") else pol, inputs, audit=audit, progress=progress)
        import cupy as cp

        cp.cuda.get_current_stream().synchronize()
        wall = time.perf_counter() - marks["t0"]
        st = vars(backend.engine.stats)
        tg = getattr(model, "token_graph", None)
        graph_cpu = tg.cpu.cpu_pairs - marks["cpu"] if tg is not None and tg.cpu is not None else 0
        try:
            per_kernel = kernel_times(model, tg, len(tokens), timed) if timed and tg is not None else {}
        except Exception as exc:  # noqa: BLE001 - the run's own figures stand; say why there are none
            per_kernel = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"kernel times: {per_kernel['error']}", file=sys.stderr, flush=True)
    finally:
        backend.close()
        TokenGraph.pipeline = True
    n = len(tokens) - warmup
    d = {k: st.get(k, 0) - marks["stats"].get(k, 0) for k in ("steps", "host_plan_s", "host_queue_s", "host_combine_s",
                                                 "host_early_s", "graph_steps", "uploads", "cpu_pairs",
                                                 "handoff_calls", "handoff_in_s", "handoff_out_s")}
    steps = max(d["steps"], 1)
    tried, done, wait_s, ahead, gpu_s = (a - b for a, b in zip(_graph_counts(model), marks["tg"]))
    s = audit.summary()
    return {"policy": policy, "mode": mode, "kernels": kernels or "default", "tokens": n, "tokens_per_s": n / wall, "wall_s": wall,
            "wall_us_per_layer_step": 1e6 * wall / steps,
            "engine_host_us_per_layer_step": 1e6 * (d["host_plan_s"] + d["host_queue_s"] + d["host_combine_s"]
                                                    + d["host_early_s"]) / steps,
            "graph_wait_us_per_layer_step": 1e6 * wait_s / steps, "tokens_launched_ahead": ahead,
            "graph_gpu_us_per_graph_layer": 1e6 * gpu_s / max(tried * weights.info.num_layers, 1),
            "graph_tokens_tried": tried, "graph_tokens_complete": done, "graph_steps": d["graph_steps"],
            "uploads": d["uploads"], "hit_rate": s["hit_rate"], "cache_mib": cap.slot_bytes(g) / 2**20,
            "cpu_pairs": d["cpu_pairs"] + graph_cpu, "fills": s.get("fills", 0),
            "handoff_in_us": 1e6 * d["handoff_in_s"] / max(d["handoff_calls"], 1),
            "handoff_out_us": 1e6 * d["handoff_out_s"] / max(d["handoff_calls"], 1),
            "kernel_us_per_block": per_kernel}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="GGUF model")
    ap.add_argument("--policies", default="gpu,lru", help="comma list (default gpu,lru)")
    ap.add_argument("--modes", default="plain,graph,pipelined",
                    help="comma list of " + ", ".join(MODES))
    ap.add_argument("--cache-mib", type=float, default=2048, help="expert cache of the policies other than gpu")
    ap.add_argument("--tokens", type=int, default=96, help="timed decode tokens")
    ap.add_argument("--warmup", type=int, default=16, help="untimed tokens first")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--graph-fills", type=int, default=None,
                    help="cpuplain/cpugraph: uploads deferred per token at most (CpuMisses max_fills; default no limit)")
    ap.add_argument("--kernels", default="",
                    help="comma list of MOELAB_DECODE_KERNELS variants, each mode run under each (default: as set)")
    ap.add_argument("--kernel-times", type=int, default=0, metavar="N",
                    help="after each graph run, N more tokens as plain launches timed one by one (us a block per launch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_token_graph"))
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.warmup < 1:
        ap.error("--tokens and --warmup: expected >= 1")
    if args.kernel_times < 0:
        ap.error("--kernel-times: expected >= 0")
    if args.graph_fills is not None and args.graph_fills < 0:
        ap.error("--graph-fills: expected >= 0")
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: {args.modes!r}, expected a comma list of {', '.join(MODES)}")
    from execute.gguf_model import load_model

    weights = load_model(args.model)
    tokens = np.random.default_rng(args.seed).integers(weights.info.vocab, size=args.tokens + args.warmup).tolist()
    from execute.kernel_variants import DECODE_KERNELS

    variants = [v for v in args.kernels.split(",") if v] or [""]
    if any(v not in DECODE_KERNELS for v in variants if v):
        ap.error(f"--kernels: {args.kernels!r}, expected a comma list of {', '.join(DECODE_KERNELS)}")
    rows = []
    for policy in args.policies.split(","):
        for mode, kern in ((m, v) for m in modes for v in variants):
            r = run_one(weights, policy, args.cache_mib, tokens, args.warmup, mode, args.threads, args.graph_fills, kern,
                        args.kernel_times)
            rows.append(r)
            print(f"{policy:>8} {mode:>9} {r['kernels']:>7}: {r['tokens_per_s']:7.1f} tok/s, wall {r['wall_us_per_layer_step']:6.1f} "
                  f"us/layer step, engine host {r['engine_host_us_per_layer_step']:5.1f}, graph wait "
                  f"{r['graph_wait_us_per_layer_step']:5.1f} us/layer step, graph on GPU "
                  f"{r['graph_gpu_us_per_graph_layer']:5.1f} us/layer, graph {r['graph_tokens_complete']}/"
                  f"{r['graph_tokens_tried']} tokens complete, {r['tokens_launched_ahead']} ahead, hits "
                  f"{r['hit_rate']:.3f}, cpu pairs {r['cpu_pairs']}, fills {r['fills']}, hand-off in/out "
                  f"{r['handoff_in_us']:.1f}/{r['handoff_out_us']:.1f} us", flush=True)
            if r["kernel_us_per_block"] and "error" not in r["kernel_us_per_block"]:
                print("    us a block: " + ", ".join(f"{k} {v:.1f}" for k, v in r["kernel_us_per_block"].items())
                      + f"; sum {sum(r['kernel_us_per_block'].values()):.1f}", flush=True)
    for policy in args.policies.split(","):
        base = next((r for r in rows if r["policy"] == policy), None)
        for r in rows:
            if r["policy"] == policy and r is not base:
                print(f"{policy}: {r['mode']} {r['kernels']} / {base['mode']} {base['kernels']} = "
                      f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args), layers=weights.info.num_layers, experts=list(weights.info.num_experts)[:1])
    (out / "bench_token_graph.json").write_text(json.dumps({"config": config, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
