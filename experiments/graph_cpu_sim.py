"""Simulated decode tokens/s of the token graph with misses on the CPU pool (``execute.graph_cpu``)
against the policies as they run now, on the peer benchmark's recorded H200 routing.

Per budget (``--budgets``, MiB: the peer's result.json beside its ``trace``, at lru's cache size) and
policy (``--policies``): the policy as it runs now (the token graph with its back-off, block by block
after a miss) and the policy wrapped in ``scheduler.graph.CpuMisses`` (every miss of a decode token
on the CPU inside the graph, its upload a fill after the token; ``--fills`` budgets per token, ``-``
for none) with the simulator's ``graph_cpu`` chain, on ``--hardware``. Writes OUT/config.json,
results.csv and README.md.

    python experiments/graph_cpu_sim.py [--out docs/perf/graph_cpu_sim] [--budgets 2048,4096,12288]
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from scheduler import Audit, drive, make_policy
from scheduler.costs import Costs, ExecConfig
from scheduler.graph import CpuMisses
from scheduler.hardware import HardwareError, load_hardware
from simulate.engine import Simulator
from simulate.peer import batched_tokens, load_result, peer_model
from simulate.run import SimConfig, build_capacity, load_tokens

FIELDS = ("budget_mib", "cache_mib", "policy", "mode", "max_fills", "tokens_per_s", "vs_now", "vs_lru", "hit_rate",
          "cpu_experts", "uploads", "fills")


def rows_for(result_path: Path, hw, policies: list[str], fills: list[int | None], block_s: float | None,
             stream: bool = False) -> list[dict]:
    result = load_result(result_path)
    model = peer_model(result["config"])
    trace = result_path.parent / "trace"
    tokens = load_tokens(SimConfig(model=model.name, trace=str(trace), phase="all"), model)
    batches = (tokens.trace.meta or {}).get("batches")
    tokens = batched_tokens(tokens, batches) if batches else list(tokens)
    mib = next(float(r["cache_mib"]) for r in result["rows"] if r.get("cell") == "moelab lru" and r.get("cache_mib"))
    g = model.geometry()
    out = []
    for name in policies:
        cap = build_capacity(SimConfig(model=model.name, policy=name, cache_mib=mib), model, hw)
        costs = Costs(model, hw, ExecConfig(policy=name))
        cm = costs.cost_model() if name in ("hybrid", "hybrid-cost", "lookahead", "oracle") else None
        modes = ("cpugraph", "cpustream") if stream else ("cpugraph",)
        for mode, f in [("now", None)] + [(m, f) for m in modes for f in fills]:
            policy = make_policy(name, g, cap, tokens=tokens, cost_model=cm)
            if mode != "now":
                policy = CpuMisses(policy, f)
            s = Simulator(costs, token_graph=True, graph_cpu=mode != "now", graph_cpu_block_s=block_s,
                          graph_cpu_stream=mode == "cpustream").run(
                drive(policy, tokens, 1), Audit(g, keep_records=False)).summary()
            out.append({"budget_mib": result["config"]["budget_mib"], "cache_mib": mib, "policy": name, "mode": mode,
                        "max_fills": "" if f is None else f, "tokens_per_s": s["tokens_per_s"],
                        "hit_rate": s["hit_rate"], "cpu_experts": s["cpu_experts"], "uploads": s["uploads"],
                        "fills": s.get("fills", "")})
            print(f"{out[-1]['budget_mib']:>6} MiB {name:>12} {mode:>8} fills {f}: {s['tokens_per_s']:7.1f} tok/s, "
                  f"hits {s['hit_rate']:.3f}", flush=True)
    for r in out:
        now = next(x["tokens_per_s"] for x in out if x["policy"] == r["policy"] and x["mode"] == "now")
        lru = next((x["tokens_per_s"] for x in out if x["policy"] == "lru" and x["mode"] == "now"), None)
        r["vs_now"], r["vs_lru"] = r["tokens_per_s"] / now, (r["tokens_per_s"] / lru if lru else "")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="2048,4096,12288", help="peer budgets, MiB (docs/perf/peer_h200/budget-N)")
    ap.add_argument("--policies", default="lru,hybrid,hybrid-cost")
    ap.add_argument("--fills", default="-,24", help="CpuMisses max_fills per token, comma list ('-': no limit)")
    ap.add_argument("--hardware", default="docs/fidelity/h200-calibrated.json")
    ap.add_argument("--block-us", type=float, default=None,
                    help="a CPU graph's block time, us (default: the hardware file's graph_block_s)")
    ap.add_argument("--stream", action="store_true",
                    help="also cpustream rows: each block's step settled while the graph runs (graph_cpu_stream)")
    ap.add_argument("--out", default="out/graph_cpu_sim")
    args = ap.parse_args(argv)
    try:
        fills = [None if f == "-" else int(f) for f in args.fills.split(",")]
        budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        ap.error("--fills / --budgets: comma lists of integers ('-' in --fills: no limit)")
    if args.block_us is not None and not args.block_us > 0:
        ap.error("--block-us: expected > 0")
    paths = [Path(f"docs/perf/peer_h200/budget-{b}/result.json") for b in budgets]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"--budgets: no peer result {missing[0]}")
    try:
        hw = load_hardware(args.hardware)
    except HardwareError as e:
        ap.error(f"--hardware: {e}")
    block_s = None if args.block_us is None else args.block_us * 1e-6
    rows = [r for p in paths for r in rows_for(p, hw, args.policies.split(","), fills, block_s, args.stream)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args), indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    lines = ["# Token graph with misses on the CPU pool, simulated", "",
             f"`python experiments/graph_cpu_sim.py --budgets {args.budgets} --policies {args.policies} "
             f"--fills {args.fills} --hardware {args.hardware}"
             + (f" --block-us {args.block_us:g}" if args.block_us else "") + (" --stream" if args.stream else "")
             + "`: the peer benchmark's recorded H200 routing, each policy as it runs now against `CpuMisses` with "
             "the graph's CPU chain (simulated, not measured; `cpustream`: each block's step settled while the graph "
             "runs). A CPU graph's block costs "
             + (f"{args.block_us:g} us (given)" if args.block_us else "the file's resident-only `graph_block_s`")
             + "; docs/perf/graph_cpu_h200 measured about 112-117 us a block with no miss on 4 blocks.",
             "", "| budget MiB | policy | mode | max fills | tokens/s | x now | x lru | hit rate |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lru = f"{r['vs_lru']:.2f}" if r["vs_lru"] != "" else "-"
        lines.append(f"| {r['budget_mib']} | {r['policy']} | {r['mode']} | {r['max_fills'] or '-'} | "
                     f"{r['tokens_per_s']:.1f} | {r['vs_now']:.2f} | {lru} | {r['hit_rate']:.3f} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
