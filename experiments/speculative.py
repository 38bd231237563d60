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

The sweeps are moelab.speculative's, the checks, tables, plot and files moelab.speculative_report's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moelab.speculative import executor_sweep, simulated_sweep
from moelab.speculative_report import evaluate, executor_checks, plot, print_table, write_results


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
    results = simulated_sweep(args)
    checks = evaluate(results, args.max_draft)
    out = Path(args.out)
    write_results(out, results, checks, args)
    plot(results, args, out / "speculative.png")
    print("simulated tokens/s (scheduler time not charged: the presets charge none)")
    print_table(results, args.max_draft)
    print("scheduler planning time, us of process CPU per layer step (driving the policy alone, same batches)")
    print_table(results, args.max_draft, "plan_us_per_layer_step")
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0


def executor_main(args) -> int:
    from execute.experts import ExecutorError

    args.out = args.out or "experiments/out/speculative-executor"
    try:
        results = executor_sweep(args)
    except ExecutorError as exc:
        print(f"speculative: {exc}", file=sys.stderr)
        return 2
    checks = executor_checks(results, args.max_draft)
    policies_run = {r["policy"] for r in results}
    out = Path(args.out)
    write_results(out, results, checks, args)
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


if __name__ == "__main__":
    sys.exit(main())
