"""Simulated decode tokens/s of hybrid's and hybrid-cost's miss split against lru and cpu, by
hardware and cache budget: qwen3-30b-a3b on a synthetic trace, and the bundled (real) granite
trace on its own model where a budget leaves experts off the GPU. ``hybrid`` is the cost-model
share (the default with a hardware file); ``hybrid f=44`` the seed's fixed 44/256.

    python experiments/hybrid_split.py [--out docs/perf/hybrid_split] [--tokens 512] [--docs FILE.md]

Writes OUT/config.json, OUT/results.csv, OUT/README.md (the table and this command) and
OUT/hybrid_split.png; with --docs, replaces the section between the hybrid_split markers there.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from scheduler import MISS_FRAC_256
from simulate.run import SimConfig, SimError, run

HARDWARE = ("h200-xeon16", "docs/fidelity/h200-calibrated.json", "rtx4060-laptop")
POLICIES = ("lru", "cpu", "hybrid", "hybrid-cost", f"hybrid f={MISS_FRAC_256}")
# (model, trace, budgets in MiB): the real trace's model holds 2304 MiB of experts, so only budgets below
# (and lru needs top-k = 8 slots per layer: >= 576 MiB)
SETS = (("qwen3-30b-a3b", "synth", (2048, 4096, 12288)), ("granite-3.0-1b-a400m", None, (1024, 1536, 2048)))
BEGIN, END = "<!-- hybrid_split: begin (experiments/hybrid_split.py writes this section) -->", "<!-- hybrid_split: end -->"
FIELDS = ("model", "trace", "hardware", "cache_mib", "policy", "tokens_per_s", "hit_rate", "cpu_experts",
          "uploads", "vs_lru", "vs_cpu", "error")


def simulate_row(model: str, trace: str | None, hardware: str, mib: float, policy: str, tokens: int,
                 seed: int) -> dict:
    """One simulation: tokens/s, hit rate, CPU experts and uploads, or the error that kept it from running."""
    name, frac = (policy.split(" f=")[0], int(policy.split(" f=")[1]) / 256) if " f=" in policy else (policy, None)
    cfg = SimConfig(model=model, hardware=hardware, policy=name, cache_mib=mib, miss_fraction=frac,
                    trace=trace, synth_tokens=tokens, seed=seed, tokens=None if trace == "synth" else tokens)
    row = {"model": model, "trace": trace or "bundled granite", "hardware": Path(hardware).stem, "cache_mib": mib,
           "policy": policy}
    try:
        s = run(cfg)[0].summary()
    except SimError as e:
        return {**row, "error": str(e).split(";")[0]}
    return {**row, "tokens_per_s": s["tokens_per_s"], "hit_rate": s["hit_rate"], "cpu_experts": s["cpu_experts"],
            "uploads": s["uploads"] + s["streams"], "error": ""}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s over lru's and cpu's of the same model, trace, hardware and budget."""
    base = {(r["model"], r["hardware"], r["cache_mib"], r["policy"]): r.get("tokens_per_s") for r in rows}
    for r in rows:
        for ref in ("lru", "cpu"):
            b = base.get((r["model"], r["hardware"], r["cache_mib"], ref))
            r[f"vs_{ref}"] = r["tokens_per_s"] / b if r.get("tokens_per_s") and b else None
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: a line per (model, hardware, budget), a column per policy: tokens/s (x lru, x cpu)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    out = ["| model / trace | hardware | cache MiB | " + " | ".join(policies) + " |",
           "|---|---|---:|" + "---:|" * len(policies)]
    keys = list(dict.fromkeys((r["model"], r["trace"], r["hardware"], r["cache_mib"]) for r in rows))
    by = {(r["model"], r["trace"], r["hardware"], r["cache_mib"], r["policy"]): r for r in rows}
    for k in keys:
        cells = []
        for p in policies:
            r = by.get((*k, p), {})
            if not r.get("tokens_per_s"):
                cells.append("does not fit" if "memory" in r.get("error", "") else "n/a")
            elif p in ("lru", "cpu"):
                cells.append(f"{r['tokens_per_s']:.1f}")
            else:
                ratios = ", ".join("-" if r[f"vs_{b}"] is None else f"{r[f'vs_{b}']:.2f}x" for b in ("lru", "cpu"))
                cells.append(f"{r['tokens_per_s']:.1f} ({ratios})")
        out.append(f"| {k[0]} / {k[1]} | {k[2]} | {k[3]:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def failures(rows: list[dict], policies=("hybrid", "hybrid-cost")) -> list[str]:
    """Configurations where a cost-model policy is slower than lru or cpu (simulated); those that
    made lru's decisions (same hit rate, uploads and CPU experts) say so."""
    key = lambda r: (r["model"], r["hardware"], r["cache_mib"])
    lru = {key(r): r for r in rows if r["policy"] == "lru" and not r.get("error")}
    same = lambda r: key(r) in lru and all(r[k] == lru[key(r)][k] for k in ("hit_rate", "uploads", "cpu_experts"))
    return [f"{r['policy']} {r['model']} {r['hardware']} {r['cache_mib']:g} MiB: {r['vs_lru']:.3f}x lru, "
            f"{r['vs_cpu']:.3f}x cpu" + (" (lru's decisions)" if same(r) else "")
            for r in rows if r["policy"] in policies and not r.get("error")
            and r["vs_lru"] is not None and r["vs_cpu"] is not None and (r["vs_lru"] < 1.0 or r["vs_cpu"] < 1.0)]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    hws = list(dict.fromkeys(r["hardware"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(len(models), len(hws), figsize=(4.2 * len(hws), 3.2 * len(models)), squeeze=False)
    for ax, (model, hw) in zip(axes.ravel(), [(m, h) for m in models for h in hws]):
        mibs = list(dict.fromkeys(r["cache_mib"] for r in rows if r["model"] == model and r["hardware"] == hw))
        for i, p in enumerate(policies):
            ys = [next((r.get("tokens_per_s") or 0.0 for r in rows if (r["model"], r["hardware"], r["cache_mib"],
                        r["policy"]) == (model, hw, m, p)), 0.0) for m in mibs]
            ax.bar([j + (i - len(policies) / 2 + 0.5) * 0.8 / len(policies) for j in range(len(mibs))], ys,
                   0.8 / len(policies), label=p)
        ax.set_xticks(range(len(mibs)), [f"{m:g}" for m in mibs])
        ax.set_title(f"{model}\n{hw}", fontsize=8)
        ax.set_xlabel("cache MiB")
    for row in axes:
        row[0].set_ylabel("simulated tokens/s")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme(rows: list[dict], config: dict, command: str) -> str:
    bad = failures(rows)
    return "\n".join([
        "# Miss split: hybrid and hybrid-cost against lru and cpu (simulated)", "",
        "Decode tokens/s from `moelab simulate` (link and CPU pool charged); in brackets the ratio to `lru` "
        "and to `cpu` of the same line. `hybrid`: the share from the hardware's cost model (the default "
        f"with a hardware file); `hybrid f={MISS_FRAC_256}`: the seed's fixed {MISS_FRAC_256}/256. "
        f"qwen3-30b-a3b on a synthetic trace of {config['tokens']} tokens (seed {config['seed']}); the bundled "
        f"granite trace's decode rows (at most {config['tokens']}) on its own model (2304 MiB of experts, "
        "so only budgets below that).", "", table(rows), "",
        "Slower than lru or cpu: " + ("; ".join(bad) + "." if bad else "none.") + (
            " A configuration with lru's decisions differs from lru only by the host's planning time "
            "per layer step that a calibrated hardware file charges each policy (measured by `moelab "
            "calibrate`)." if any("lru's decisions" in b for b in bad) else ""), "",
        f"Command: `{command}`", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/perf/hybrid_split")
    ap.add_argument("--tokens", type=int, default=512, help="synthetic tokens / real trace rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hardware", default=",".join(HARDWARE))
    ap.add_argument("--docs", default=None, help="a Markdown file whose hybrid_split section gets the table")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        print(f"hybrid_split: --tokens {args.tokens}: expected >= 1", file=sys.stderr)
        return 2
    hardware = [h for h in args.hardware.split(",") if h]
    docs = Path(args.docs) if args.docs else None
    if docs is not None and (not docs.is_file() or BEGIN not in docs.read_text() or END not in docs.read_text()):
        print(f"hybrid_split: --docs {docs}: expected a file with the hybrid_split markers", file=sys.stderr)
        return 2
    rows = with_ratios([simulate_row(m, tr, hw, mib, p, args.tokens, args.seed) for m, tr, mibs in SETS
                        for hw in hardware for mib in mibs for p in POLICIES])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"tokens": args.tokens, "seed": args.seed, "hardware": hardware, "policies": list(POLICIES),
              "sets": [[m, tr, list(mibs)] for m, tr, mibs in SETS]}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in FIELDS} for r in rows)
    command = "python experiments/hybrid_split.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    text = readme(rows, config, command)
    (out / "README.md").write_text(text)
    plot(rows, out / "hybrid_split.png")
    if docs is not None:
        doc = docs.read_text()
        body = text.split("\n", 2)[2]  # the README less its title
        docs.write_text(doc[:doc.index(BEGIN) + len(BEGIN)] + "\n" + body + f"\nFiles: `{out}/`.\n" + doc[doc.index(END):])
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
