"""Plain vs speculative decode, and chunked prefill, per policy: the two sweeps of
``experiments/speculative.py``.

``simulated_sweep``: a Qwen3-30B-A3B-shaped synthetic trace (traces.synth's qwen3-30b-a3b
routing) verified in batches of draft_len + 1 tokens with per-draft acceptance
(``simulate.speculative``), simulated for lru, hybrid at each of ``FRACTIONS`` and hybrid-cost;
beside it, the scheduler's own CPU time per layer step of driving each policy over the same
batches (``plan_s_per_step``). ``executor_sweep``: ``moelab run``'s greedy generation of one
prompt, plain and with prompt-lookup drafts, per configuration (``executor_configs``), in
interleaved rounds after a warm-up (``measure_cells``); token-by-token prefill once per policy.
Both return rows {mode, draft_len, policy, miss_fraction, tokens_per_s, ...}; the checks and
outputs are in ``speculative_report``.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from scheduler import MISS_FRAC_256
from simulate.run import SimConfig, run
from simulate.speculative import merge_rows, verify_batches

__all__ = ["FRACTIONS", "EXEC_PROMPT", "policies", "sim_config", "simulate", "plan_s_per_step", "simulated_sweep",
           "gpu_present", "executor_configs", "run_once", "spread", "measure_cells", "executor_sweep"]

FRACTIONS = (0.1, MISS_FRAC_256 / 256, 0.25, 0.5)


def policies():
    yield "lru", None
    for f in FRACTIONS:
        yield "hybrid", f
    yield "hybrid-cost", None


def sim_config(policy, frac, args) -> SimConfig:
    return SimConfig(model=args.model, hardware=args.hardware, policy=policy, miss_fraction=frac,
                     cache_mib=args.cache_mib, phase="all")


def simulate(tokens, produced, policy, frac, args) -> float:
    result, _ = run(sim_config(policy, frac, args), tokens=tuple(tokens))
    return produced / result.total_s


def plan_s_per_step(runs, args) -> dict:
    """Scheduler CPU seconds per layer step of each (mode, draft, policy, fraction) in ``runs``
    (their batches): the policy as the simulator builds it, driven with no timing; each run
    interleaved with the others, best of ``--plan-repeats``."""
    from scheduler import drive, make_policy
    from simulate import load_hardware, load_model
    from scheduler.costs import Costs, ExecConfig
    from simulate.run import build_capacity

    model, hw = load_model(args.model), load_hardware(args.hardware)
    geometry = model.geometry()
    best_s = {}
    for _ in range(args.plan_repeats):
        for key, batches in runs.items():
            policy, frac = key[2], key[3]
            cfg = sim_config(policy, frac, args)
            options = {"adaptive": cfg.adaptive, "miss_fraction": frac} if policy == "hybrid" else {}
            if policy in ("hybrid", "hybrid-cost"):  # hybrid: its share when frac is None
                options["cost_model"] = Costs(model, hw, ExecConfig(pinned=cfg.pinned, policy=policy)).cost_model()
            capacity = build_capacity(cfg, model, hw)
            pol = make_policy(policy, geometry, capacity, **options)
            t0 = time.process_time()
            for _ in drive(pol, batches):
                pass
            dt = (time.process_time() - t0) / sum(len(t.steps) for t in batches)
            best_s[key] = min(best_s.get(key, dt), dt)
    return best_s



def simulated_sweep(args) -> list[dict]:
    """Decode rows at every draft length 0..``args.max_draft`` and chunked-prefill rows, per policy
    and fraction, each with its simulated tokens/s and ``plan_us_per_layer_step``."""
    from traces import synth

    preset = synth.PRESETS["qwen3-30b-a3b"]
    trace = synth.generate(preset.num_layers, preset.num_experts, preset.top_k, args.tokens, preset.params,
                           np.random.default_rng(args.seed))
    rows = list(trace.tokens())
    results, runs = [], {}
    for draft in range(args.max_draft + 1):
        batches, produced = verify_batches(rows, draft, args.acceptance, np.random.default_rng(args.seed + draft))
        for policy, frac in policies():
            tps = simulate(batches, produced, policy, frac, args)
            runs["decode", draft, policy, frac] = batches
            results.append({"mode": "decode", "draft_len": draft, "policy": policy,
                            "miss_fraction": "" if frac is None else round(frac, 4), "tokens_per_s": tps})
            print(f"draft {draft}  {policy:<11} {'' if frac is None else f'{frac:.3f}':>6}  {tps:8.2f} tok/s",
                  file=sys.stderr)
    chunks = [merge_rows(rows[i:i + args.prefill_chunk], n)
              for n, i in enumerate(range(0, len(rows), args.prefill_chunk))]
    for policy, frac in policies():
        tps = simulate(chunks, len(rows), policy, frac, args)
        runs["prefill", "", policy, frac] = chunks
        results.append({"mode": "prefill", "draft_len": "", "policy": policy,
                        "miss_fraction": "" if frac is None else round(frac, 4), "tokens_per_s": tps})
    print(f"timing the scheduler (best of {args.plan_repeats})", file=sys.stderr)
    plan_s = plan_s_per_step(runs, args)
    for r in results:
        frac = None if r["miss_fraction"] == "" else next(f for f in FRACTIONS if round(f, 4) == r["miss_fraction"])
        r["plan_us_per_layer_step"] = 1e6 * plan_s[r["mode"], r["draft_len"], r["policy"], frac]
    return results


EXEC_PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
               "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n")


def gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: the CPU path only
        return False


def executor_configs(args):
    """(policy, miss fraction or None, extra moelab run arguments) of the executor sweep."""
    names = args.policies.split(",") if args.policies else (["lru", "hybrid", "hybrid-cost"] if gpu_present() else ["cpu"])
    cache = ([] if args.cache_slots is None and args.cache_mib is None else
             ["--cache-slots", str(args.cache_slots)] if args.cache_slots is not None else ["--cache-mib", str(args.cache_mib)])
    for name in names:
        pol = ["--policy", name]
        if name == "hybrid":
            for f in FRACTIONS:
                yield name, f, pol + cache + ["--miss-fraction", str(f)]
        elif name == "hybrid-cost":
            yield name, None, pol + cache + ["--hardware", args.hardware]
        else:
            yield name, None, pol + ([] if name == "cpu" else cache)


def run_once(args, extra):
    """One ``moelab run`` of the sweep's prompt with ``extra``: (figures, generated token ids)."""
    from execute.cli_run import run_figures

    base = [args.executor, "-p", args.prompt or EXEC_PROMPT, "-n", str(args.gen_tokens), "--raw",
            "--backend", args.backend, "--seed", str(args.seed), "--prefill-chunk", str(args.prefill_chunk)]
    if args.threads:
        base += ["--threads", str(args.threads)]
    if args.pageable:
        base += ["--pageable"]
    return run_figures(base + extra)


def spread(vals) -> float:
    """(max - min) / median of measured figures."""
    return (max(vals) - min(vals)) / float(np.median(vals))


def measure_cells(args, cells, run=None) -> list[list[tuple[dict, list[int]]]]:
    """Every cell's (figures, tokens) of ``--repeats`` rounds. One unrecorded warm-up run first (a
    first run may pay one-time costs, e.g. CuPy compiling kernels at first use); then each round
    runs every cell once, in the sweep's order in even rounds and reversed in odd ones, so that a
    slow drift of the host weighs on every cell alike. Greedy runs of one cell must agree."""
    run = run or (lambda extra: run_once(args, extra))
    run(cells[0])
    got: list[list[tuple[dict, list[int]]]] = [[] for _ in cells]
    for r in range(args.repeats):
        order = range(len(cells)) if r % 2 == 0 else range(len(cells) - 1, -1, -1)
        for i in order:
            fig, toks = run(cells[i])
            if got[i] and toks != got[i][0][1]:
                raise RuntimeError(f"greedy runs of {cells[i]} disagree with each other")
            got[i].append((fig, toks))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    return got



def executor_sweep(args) -> list[dict]:
    """Every configuration's decode rows (median of ``--repeats`` rounds at each draft length, with
    acceptance, hit rate, whether the tokens equal the plain run's) and its prefill rows (chunked:
    every run of the configuration; ``prefill-1``: one token-by-token run). A user error of
    ``moelab run`` raises ``ExecutorError``."""
    configs = list(executor_configs(args))
    drafts = range(args.max_draft + 1)
    cells = [extra + ["--speculative", str(d)] for _, _, extra in configs for d in drafts]
    results = []
    got = measure_cells(args, cells)
    for c, (policy, frac, extra) in enumerate(configs):
        runs = got[c * len(drafts):(c + 1) * len(drafts)]
        row = {"policy": policy, "miss_fraction": "" if frac is None else round(frac, 4)}
        for d, reps in zip(drafts, runs):
            figs = [f for f, _ in reps]
            tps = float(np.median([f["decode_tokens_per_s"] for f in figs]))
            results.append({"mode": "decode", "draft_len": d, **row, "tokens_per_s": tps,
                            "acceptance": figs[0].get("acceptance_rate", ""),
                            "tokens_per_step": figs[0].get("tokens_per_step", 1.0), "hit_rate": figs[0]["hit_rate"],
                            "uploads": figs[0]["uploads"] + figs[0]["streams"], "cpu_experts": figs[0]["cpu"],
                            "same_tokens": reps[0][1] == runs[0][0][1], "runs": len(figs),
                            "spread": spread([f["decode_tokens_per_s"] for f in figs]),
                            "tokens_per_s_runs": [f["decode_tokens_per_s"] for f in figs]})
            print(f"draft {d}  {policy:<11} {'' if frac is None else f'{frac:.3f}':>6}  {tps:8.2f} tok/s  "
                  f"acceptance {figs[0].get('acceptance_rate', 0.0):.2f}", file=sys.stderr)
        # the prompt is processed alike whatever the draft length: every run of the config counts
        pre = [f["prompt_tokens_per_s"] for reps in runs for f, _ in reps]
        one, _ = run_once(args, extra + ["--prefill-chunk", "1", "-n", "1"])
        for mode, vals in (("prefill", pre), ("prefill-1", [one["prompt_tokens_per_s"]])):
            results.append({"mode": mode, "draft_len": "", **row, "tokens_per_s": float(np.median(vals)),
                            "acceptance": "", "tokens_per_step": "", "hit_rate": "", "uploads": "",
                            "cpu_experts": "", "same_tokens": "",
                            "runs": len(vals), "spread": spread(vals), "tokens_per_s_runs": vals})
    return results
