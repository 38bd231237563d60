"""Plain vs speculative decode, and chunked prefill, for lru, fixed-fraction hybrid and hybrid-cost.

In simulation: a Qwen3-30B-A3B-shaped model (traces.synth's calibrated qwen3-30b-a3b routing) on
a hardware preset, a verification batch of draft_len + 1 tokens per step with per-draft acceptance
``--acceptance`` (simulate.speculative). Tokens/s = tokens produced / simulated time, which does
not include the scheduler's own planning time (the hardware presets charge none); that is measured
beside it: process CPU time per layer step of driving each policy over the same batches (no
simulation, interleaved, best of ``--plan-repeats``). Checks, each printed PASS/FAIL:

1. speculative hybrid is never slower than speculative lru (the seed systems' failure);
2. speculative hybrid beats plain hybrid wherever speculative lru beats plain lru;
3. hybrid-cost is at least as fast as the best fixed miss fraction in every configuration;
4. prefill tokens/s on the hybrid path is at least the upload-everything (lru) path's.

    python experiments/speculative.py [--hardware rtx4070super-5950x] [--cache-mib 5632] [--out DIR]

On the executor (``--executor MODEL.gguf``): ``moelab run``'s greedy generation of one prompt, side
by side in one process, plain (draft 0) and with prompt-lookup drafts of 1..``--max-draft``, per
policy (default on a GPU: lru, hybrid at each fixed fraction, hybrid-cost with ``--hardware``;
without one: cpu), and prefill in chunks of ``--prefill-chunk`` vs token by token. Every speculative
run must give the plain run's tokens (checked); with lru and hybrid present, the checks above are
applied to the measured figures. Median of ``--repeats`` interleaved rounds (each runs every
configuration once, in alternating order), after one unrecorded warm-up run (on the H200,
without it, plain lru ran first at 74 tok/s and its draft-1 run next at 109).
Chunked prefill is timed in the same runs (the prompt is processed alike at every draft length);
token-by-token prefill (``prefill-1``) in one run per policy.

    python experiments/speculative.py --executor m.gguf [--policies lru,hybrid,hybrid-cost]
        [--cache-slots N | --cache-mib M] [--hardware FILE] [--threads T] [--pageable] [--out DIR]

Writes results.csv, results.json, config.json and speculative.png into --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scheduler import MISS_FRAC_256
from simulate.run import SimConfig, run
from simulate.speculative import merge_rows, verify_batches

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
            if policy == "hybrid-cost":
                options["cost_model"] = Costs(model, hw, ExecConfig(pinned=cfg.pinned, policy=policy)).cost_model()
            capacity = build_capacity(cfg, model, hw)
            pol = make_policy(policy, geometry, capacity, **options)
            t0 = time.process_time()
            for _ in drive(pol, batches):
                pass
            dt = (time.process_time() - t0) / sum(len(t.steps) for t in batches)
            best_s[key] = min(best_s.get(key, dt), dt)
    return best_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--hardware", default="rtx4070super-5950x")
    ap.add_argument("--cache-mib", type=float, default=None,
                    help="expert cache (default in simulation 5632, 5.5 GiB, as the seed's MTP report)")
    ap.add_argument("--tokens", type=int, default=256, help="decode rows replayed")
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="default experiments/out/speculative[-executor]")
    ap.add_argument("--plan-repeats", type=int, default=2, help="scheduler timing runs (best taken)")
    ex = ap.add_argument_group("executor mode")
    ex.add_argument("--executor", metavar="MODEL.gguf", default=None, help="measure moelab run on this model")
    ex.add_argument("--policies", default=None, help="comma-separated (default: lru,hybrid,hybrid-cost on a GPU, else cpu)")
    ex.add_argument("--cache-slots", type=int, default=None, help="GPU expert cache slots per layer")
    ex.add_argument("--prompt", default=None, help="prompt text (default: a repetitive paragraph)")
    ex.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per run")
    ex.add_argument("--threads", type=int, default=None, help="CPU expert threads")
    ex.add_argument("--backend", default="engine", choices=("engine", "numpy"))
    ex.add_argument("--repeats", type=int, default=3, help="runs per configuration (median reported)")
    ex.add_argument("--pageable", action="store_true", help="moelab run --pageable: the weights are not page-locked")
    args = ap.parse_args()
    if args.executor:
        return executor_main(args)
    args.cache_mib = 5632.0 if args.cache_mib is None else args.cache_mib
    args.out = args.out or "experiments/out/speculative"

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

    checks = evaluate(results, args.max_draft)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "results.csv", lambda f: _csv(f, results))
    _write(out / "results.json", lambda f: json.dump({"results": results, "checks": checks}, f, indent=1))
    _write(out / "config.json", lambda f: json.dump(vars(args), f, indent=1))
    plot(results, args, out / "speculative.png")
    print("simulated tokens/s (scheduler time not charged: the presets charge none)")
    print_table(results, args.max_draft)
    print("scheduler planning time, us of process CPU per layer step (driving the policy alone, same batches)")
    print_table(results, args.max_draft, "plan_us_per_layer_step")
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0


# the executor ----------------------------------------------------------------------------------------
EXEC_PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
               "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n")


def _gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: the CPU path only
        return False


def executor_configs(args):
    """(policy, miss fraction or None, extra moelab run arguments) of the executor sweep."""
    names = args.policies.split(",") if args.policies else (["lru", "hybrid", "hybrid-cost"] if _gpu_present() else ["cpu"])
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


def _run_once(args, extra):
    """One ``moelab run`` of the sweep's prompt with ``extra``: (figures, generated token ids)."""
    from execute.cli_run import run_figures

    base = [args.executor, "-p", args.prompt or EXEC_PROMPT, "-n", str(args.gen_tokens), "--raw",
            "--backend", args.backend, "--seed", str(args.seed), "--prefill-chunk", str(args.prefill_chunk)]
    if args.threads:
        base += ["--threads", str(args.threads)]
    if args.pageable:
        base += ["--pageable"]
    return run_figures(base + extra)


def _spread(vals) -> float:
    """(max - min) / median of measured figures."""
    return (max(vals) - min(vals)) / float(np.median(vals))


def measure_cells(args, cells, run=None) -> list[list[tuple[dict, list[int]]]]:
    """Every cell's (figures, tokens) of ``--repeats`` rounds. One unrecorded warm-up run first (a
    first run may pay one-time costs, e.g. CuPy compiling kernels at first use); then each round
    runs every cell once, in the sweep's order in even rounds and reversed in odd ones, so that a
    slow drift of the host weighs on every cell alike. Greedy runs of one cell must agree."""
    run = run or (lambda extra: _run_once(args, extra))
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


def executor_main(args) -> int:
    from execute.experts import ExecutorError

    args.out = args.out or "experiments/out/speculative-executor"
    configs = list(executor_configs(args))
    drafts = range(args.max_draft + 1)
    cells = [extra + ["--speculative", str(d)] for _, _, extra in configs for d in drafts]
    results = []
    try:
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
                                "spread": _spread([f["decode_tokens_per_s"] for f in figs]),
                                "tokens_per_s_runs": [f["decode_tokens_per_s"] for f in figs]})
                print(f"draft {d}  {policy:<11} {'' if frac is None else f'{frac:.3f}':>6}  {tps:8.2f} tok/s  "
                      f"acceptance {figs[0].get('acceptance_rate', 0.0):.2f}", file=sys.stderr)
            # the prompt is processed alike whatever the draft length: every run of the config counts
            pre = [f["prompt_tokens_per_s"] for reps in runs for f, _ in reps]
            one, _ = _run_once(args, extra + ["--prefill-chunk", "1", "-n", "1"])
            for mode, vals in (("prefill", pre), ("prefill-1", [one["prompt_tokens_per_s"]])):
                results.append({"mode": mode, "draft_len": "", **row, "tokens_per_s": float(np.median(vals)),
                                "acceptance": "", "tokens_per_step": "", "hit_rate": "", "uploads": "",
                                "cpu_experts": "", "same_tokens": "",
                                "runs": len(vals), "spread": _spread(vals), "tokens_per_s_runs": vals})
    except ExecutorError as exc:
        print(f"speculative: {exc}", file=sys.stderr)
        return 2
    checks = [("speculative greedy gives plain greedy's tokens", all(r["same_tokens"] for r in results if r["mode"] == "decode"),
               f"{sum(1 for r in results if r['mode'] == 'decode')} runs")]
    policies_run = {r["policy"] for r in results}
    if {"lru", "hybrid", "hybrid-cost"} <= policies_run:
        checks += evaluate(results, args.max_draft)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "results.csv", lambda f: _csv(f, results))
    _write(out / "results.json", lambda f: json.dump({"results": results, "checks": checks}, f, indent=1))
    _write(out / "config.json", lambda f: json.dump(vars(args), f, indent=1))
    plot(results, args, out / "speculative.png", f"{Path(args.executor).name}, moelab run (measured)",
         sorted(policies_run))
    for policy in sorted(policies_run):
        rows = [r for r in results if r["policy"] == policy]
        for r in rows:
            if r["mode"] == "decode":
                print(f"{policy:<11} {str(r['miss_fraction']):>6} draft {r['draft_len']}: {r['tokens_per_s']:8.1f} tok/s, "
                      f"acceptance {'-' if r['acceptance'] == '' else format(r['acceptance'], '.2f')}, "
                      f"{r['tokens_per_step']:.2f} tokens/step")
        for mode in ("prefill", "prefill-1"):
            vals = [r["tokens_per_s"] for r in rows if r["mode"] == mode]
            print(f"{policy:<11} {mode:<9}: {max(vals):8.1f} prompt tok/s")
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0


def best_row(results, mode, draft, policy):
    """The fastest row of ``policy`` (of its fixed fractions, for hybrid) in ``mode`` at ``draft``."""
    rows = [r for r in results if r["mode"] == mode and r["draft_len"] == draft and r["policy"] == policy]
    return max(rows, key=lambda r: r["tokens_per_s"])


def _noise(detail: str, ratio: float, *rows) -> str:
    """``detail``, and for measured rows short of a ratio of 1 whether the shortfall lies inside
    half the larger spread (max - min over median) of the runs compared."""
    half = max((r.get("spread") or 0.0) / 2 for r in rows)
    if ratio >= 1.0 or not half:
        return detail
    where = "inside" if 1.0 - ratio <= half else "outside"
    return f"{detail} ({where} the runs' noise: half-spread {100 * half:.0f}%)"


def evaluate(results, max_draft):
    checks = []
    drafts = range(1, max_draft + 1)
    lru = {d: best_row(results, "decode", d, "lru") for d in range(max_draft + 1)}
    hyb = {d: max(best_row(results, "decode", d, "hybrid"), best_row(results, "decode", d, "hybrid-cost"),
                  key=lambda r: r["tokens_per_s"]) for d in range(max_draft + 1)}
    ratio = {d: hyb[d]["tokens_per_s"] / lru[d]["tokens_per_s"] for d in range(max_draft + 1)}
    worst = min(drafts, key=ratio.__getitem__)
    checks.append(("speculative hybrid >= speculative lru", ratio[worst] >= 1.0,
                   _noise(f"min ratio {ratio[worst]:.2f}", ratio[worst], hyb[worst], lru[worst])))
    gains = [(d, lru[d]["tokens_per_s"] > lru[0]["tokens_per_s"], hyb[d]["tokens_per_s"] > hyb[0]["tokens_per_s"])
             for d in drafts]
    ok = all(h for d, l, h in gains if l)
    checks.append(("spec hybrid beats plain hybrid where spec lru beats plain lru", ok,
                   ", ".join(f"d{d}: lru {'+' if l else '-'} hybrid {'+' if h else '-'}" for d, l, h in gains)))
    modes = [("decode", d) for d in range(max_draft + 1)] + [("prefill", "")]
    short = []
    for m, d in modes:
        hc, fx = best_row(results, m, d, "hybrid-cost"), best_row(results, m, d, "hybrid")
        r = hc["tokens_per_s"] / fx["tokens_per_s"]
        if r < 1 - 1e-9:
            short.append(_noise(f"{m} {d}: {r:.2f}", r, hc, fx))
    checks.append(("hybrid-cost >= best fixed miss fraction", not short,
                   "all configs" if not short else "short in " + "; ".join(short)))
    pf = max(best_row(results, "prefill", "", "hybrid"), best_row(results, "prefill", "", "hybrid-cost"),
             key=lambda r: r["tokens_per_s"])
    pl = best_row(results, "prefill", "", "lru")
    r = pf["tokens_per_s"] / pl["tokens_per_s"]
    checks.append(("prefill hybrid path >= upload-everything", r >= 1.0,
                   _noise(f"{pf['tokens_per_s']:.1f} vs {pl['tokens_per_s']:.1f} tok/s", r, pf, pl)))
    return checks


def print_table(results, max_draft, key="tokens_per_s"):
    cols = [("lru", None)] + [("hybrid", round(f, 4)) for f in FRACTIONS] + [("hybrid-cost", None)]
    head = "mode     draft " + " ".join(f"{p if f is None else f'h{f:.3f}':>11}" for p, f in cols)
    print(head)
    for mode, d in [("decode", d) for d in range(max_draft + 1)] + [("prefill", "")]:
        vals = []
        for p, f in cols:
            r = [x for x in results if x["mode"] == mode and x["draft_len"] == d and x["policy"] == p
                 and (f is None or x["miss_fraction"] == f)]
            vals.append(f"{r[0][key]:>11.2f}")
        print(f"{mode:<8} {str(d):>5} " + " ".join(vals))


def plot(results, args, path, title=None, policies=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = [("lru", "lru", None), (f"hybrid {MISS_FRAC_256}/256", "hybrid", round(MISS_FRAC_256 / 256, 4)),
             ("hybrid best fixed", "hybrid", "best"), ("hybrid-cost", "hybrid-cost", None)]
    if policies is not None:
        lines = [x for x in lines if x[1] in policies] + [(p, p, None) for p in policies
                                                           if p not in ("lru", "hybrid", "hybrid-cost")]
    for label, pol, frac in lines:
        xs, ys = [], []
        for d in range(args.max_draft + 1):
            rs = [r for r in results if r["mode"] == "decode" and r["draft_len"] == d and r["policy"] == pol
                  and (frac in (None, "best") or r["miss_fraction"] == frac)]
            xs.append(d)
            ys.append(max(r["tokens_per_s"] for r in rs))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("draft length (tokens verified per step - 1)")
    ax.set_ylabel("decode tokens/s" + ("" if title else " (simulated)"))
    ax.set_title(title or f"{args.model} on {args.hardware}, {args.cache_mib:.0f} MiB cache, acceptance {args.acceptance}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def _csv(f, rows):
    """The rows' scalar columns (per-run lists stay in results.json)."""
    w = csv.DictWriter(f, fieldnames=[k for k, v in rows[0].items() if not isinstance(v, list)], extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def _write(path: Path, fill, binary: bool = False) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"newline": ""})) as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


if __name__ == "__main__":
    sys.exit(main())
