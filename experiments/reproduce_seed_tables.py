"""Predict the published decode rows in ``experiments/seed_tables.json`` with the simulator.

Machines: the ``rtx4060-laptop`` and ``l4-colab`` presets. Models: the Qwen3.5-35B-A3B preset and
the Qwen3-Coder-Next geometry of the data file, in the published quant types, on synthetic traces
of each geometry (no recorded routing of these models is available). Rows (what each measured is
in the data file's ``rows_measured``):

- ``full``: policy ``gpu``; ``cpu``: policy ``cpu`` (upstream ``--cpu-moe``);
- ``lru``: upstream's cache: ``lru`` over ONE pool shared by all MoE layers (upstream keeps one LRU
  per group of layers with the same layout), every miss uploaded;
- ``hybrid`` / ``hybrid-slow-fill``: ``hybrid`` with no miss sent over PCIe (the pull request's CPU
  computes every miss), adaptive fills of at most 512 / 16 experts per token.

Uploads (on demand and background) are pageable copies: both builds upload from the host
buffers the experts are computed from. Host figures derived from the rows, per machine:
``gpu_mem_gbps`` from a ``full`` row where the machine has one (else the preset's estimate);
``cpu_thread_gbps`` from its first ``cpu`` row; one shared parameter, ``k`` = pageable upload rate /
the CPU's per-thread expert rate (a pageable copy is staged through pinned memory by one host
thread), fitted on one machine's ``lru`` rows and used unchanged on the other. Each row is
predicted twice: ``k`` fitted on its own machine, and on the other machine.

    python experiments/reproduce_seed_tables.py [--seeds 3] [--tokens-scale 1.0] [--data experiments/seed_tables.json] [--out docs/SEED_TABLES.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from scheduler import Audit, Capacity, drive, make_policy
from scheduler.costs import Costs, ExecConfig
from simulate.engine import Simulator
from scheduler.hardware import Hardware, load_hardware
from scheduler.models import ModelSpec, load_model
from simulate.run import SimConfig, load_tokens

DATA = Path(__file__).resolve().parent / "seed_tables.json"
ROW_NAMES = {"full": "all on the GPU (-fit)", "cpu": "--cpu-moe", "lru": "cache (upstream LRU)",
             "hybrid": "hybrid + adaptive", "hybrid-slow-fill": "hybrid + adaptive, 16 fills/token"}
SLOW_FILLS = 16
TOLERANCE = 0.15


def load_data(path: Path = DATA) -> dict:
    """The published figures; a malformed file is a ValueError naming the field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    for key in ("source", "machines", "tables", "rows_measured"):
        if key not in data:
            raise ValueError(f"{path}: missing field {key!r}")
    for i, t in enumerate(data["tables"]):
        for key in ("machine", "model", "quant", "cache_mib", "tokens", "rows", "note"):
            if key not in t:
                raise ValueError(f"{path}: tables[{i}] has no field {key!r}")
        if t["machine"] not in data["machines"]:
            raise ValueError(f"{path}: tables[{i}].machine {t['machine']!r} is not in 'machines'")
        for r, v in t["rows"].items():
            if r not in ROW_NAMES:
                raise ValueError(f"{path}: tables[{i}].rows.{r}: unknown row, expected one of {', '.join(ROW_NAMES)}")
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{path}: tables[{i}].rows.{r}: {v!r}, expected tokens/s > 0")
    return data


def model_of(data: dict, name: str, quant: str) -> ModelSpec:
    spec = data.get("models", {}).get(name)
    m = ModelSpec(name=name, **spec) if spec else load_model(name)
    return m.with_quant(quant)


def predict(hw: Hardware, model: ModelSpec, table: dict, row: str, seeds: int, scale: float) -> dict:
    """Mean tokens/s and hit rate of one row over ``seeds`` synthetic traces."""
    g = model.geometry()
    n_tok = max(8, int(round(table["tokens"] * scale)))
    pol = {"full": "gpu", "cpu": "cpu", "lru": "lru"}.get(row, "hybrid")
    cap = Capacity.from_mib(g, float(table["cache_mib"]))
    if row == "full":  # every expert resident (the model fits in VRAM)
        cap = Capacity.per_layer(g, g.max_experts)
    elif row == "lru":  # one LRU shared by every MoE layer (all have the same layout)
        cap = Capacity.shared(g, [g.moe_layers], [cap.pools[0][1] * len(g.moe_layers)])
    opts = {}
    if pol == "hybrid":
        opts = {"adaptive": True, "miss_fraction": 0.0,
                "max_fills": SLOW_FILLS if row == "hybrid-slow-fill" else 512}
    # uploads are pageable; rows without uploads copy only activations, through pinned buffers
    costs = Costs(model, hw, ExecConfig(pinned=row in ("full", "cpu"), policy=pol))
    tps, hits = [], []
    for seed in range(seeds):
        cfg = SimConfig(model=model.name, trace="synth", synth_tokens=n_tok, seed=seed)
        tokens = load_tokens(cfg, model)
        policy = make_policy(pol, g, cap, **opts)
        # lag 0: a pageable copy holds the host thread that issues it, so the next token waits for
        # the fills committed after this one (they cannot overlap its compute)
        s = Simulator(costs).run(drive(policy, tokens, lag_tokens=0), Audit(g, keep_records=False)).summary()
        tps.append(s["tokens_per_s"])
        hits.append(s["hit_rate"])
    return {"tps": float(np.mean(tps)), "hit_rate": float(np.mean(hits)),
            "slots": cap.min_slots_per_layer(g) if row != "lru" else cap.pools[0][1] // len(g.moe_layers)}


def solve(f, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) ~= target, f increasing (bisection in log space, 30 steps)."""
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def gpu_fraction(data: dict, scale: float) -> float:
    """Achieved / spec-sheet GPU bandwidth, from the first ``full`` row (every weight on the GPU)."""
    for t in data["tables"]:
        if "full" in t["rows"]:
            hw, m = load_hardware(t["machine"]), model_of(data, t["model"], t["quant"])
            gbps = solve(lambda x: predict(dataclasses.replace(hw, gpu_mem_gbps=x), m, t, "full", 1, scale)["tps"],
                         t["rows"]["full"], 20.0, 2000.0)
            return gbps / data["machines"][t["machine"]]["gpu_spec_gbps"]
    raise ValueError("no 'full' row (every weight on the GPU) to derive the GPU's achieved bandwidth from")


def derive_host(data: dict, machine: str, frac: float, seeds: int, scale: float) -> tuple[Hardware, dict]:
    """The machine's preset with ``gpu_mem_gbps`` = ``frac`` x its spec bandwidth (``frac`` from a
    ``full`` row: the same dequantising kernels on the same GPU architecture) and
    ``cpu_thread_gbps`` from its first ``cpu`` row; returns the figures and the rows used."""
    hw = load_hardware(machine)
    hw = dataclasses.replace(hw, gpu_mem_gbps=round(frac * data["machines"][machine]["gpu_spec_gbps"], 1))
    used = {}
    tables = [t for t in data["tables"] if t["machine"] == machine]
    for t in tables:
        if "full" in t["rows"]:
            used["gpu_mem_gbps"] = (t, "full")
    for t in tables:
        if "cpu" in t["rows"]:
            m = model_of(data, t["model"], t["quant"])
            gbps = solve(lambda x: predict(dataclasses.replace(hw, cpu_thread_gbps=x), m, t, "cpu", 1, scale)["tps"],
                         t["rows"]["cpu"], 0.1, 100.0)
            hw = dataclasses.replace(hw, cpu_thread_gbps=round(gbps, 2))
            used["cpu_thread_gbps"] = (t, "cpu")
            break
    return hw, used


def with_k(hw: Hardware, k: float) -> Hardware:
    """Pageable upload rate = k x the per-thread expert rate of the pool (quant efficiency 1 here)."""
    return dataclasses.replace(hw, pageable_gbps=round(k * hw.cpu_thread_gbps, 2))


def fit_k(data: dict, machine: str, hw: Hardware, seeds: int, scale: float) -> float:
    """k minimising the squared log error of the machine's ``lru`` rows (golden-section on log k)."""
    rows = [(t, model_of(data, t["model"], t["quant"])) for t in data["tables"]
            if t["machine"] == machine and "lru" in t["rows"]]

    def loss(logk):
        h = with_k(hw, math.exp(logk))
        return sum(math.log(predict(h, m, t, "lru", seeds, scale)["tps"] / t["rows"]["lru"]) ** 2 for t, m in rows)

    a, b = math.log(0.05), math.log(20.0)
    r = (math.sqrt(5) - 1) / 2
    for _ in range(25):
        c, d = b - r * (b - a), a + r * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    return round(math.exp((a + b) / 2), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="synthetic traces per row (mean reported)")
    ap.add_argument("--tokens-scale", type=float, default=1.0,
                    help="fraction of each row's published token count to simulate (tests use less)")
    ap.add_argument("--data", default=str(DATA), help="the published figures (JSON)")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        print(f"error: --seeds {args.seeds}, expected >= 1", file=sys.stderr)
        return 2
    if not 0 < args.tokens_scale <= 1:
        print(f"error: --tokens-scale {args.tokens_scale}, expected in (0, 1]", file=sys.stderr)
        return 2
    try:
        data = load_data(Path(args.data))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = report(data, args.seeds, args.tokens_scale)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    return 0


def report(data: dict, seeds: int, scale: float) -> str:
    machines = list(data["machines"])
    hosts, used = {}, {}
    frac = gpu_fraction(data, scale)
    for mname in machines:
        hosts[mname], used[mname] = derive_host(data, mname, frac, seeds, scale)
    ks = {mname: fit_k(data, mname, hosts[mname], seeds, scale) for mname in machines}
    cmd = "python experiments/reproduce_seed_tables.py" + (f" --seeds {seeds}" if seeds != 3 else "") + (
        f" --tokens-scale {scale}" if scale != 1.0 else "")
    lines = ["# The seeds' decode rows, predicted by the simulator", "",
             f"Command: `{cmd} --out docs/SEED_TABLES.md`", "",
             "## Method", "",
             "The published rows (`experiments/seed_tables.json`: its `source` names the systems, machines and "
             "models; `rows_measured` says what each row measured) are replayed on synthetic traces "
             f"(`traces.synth` defaults, {seeds} seeds, mean reported) of each model's geometry. Rows: "
             "`--cpu-moe` = policy `cpu`; upstream's cache = `lru` over one pool shared by all MoE layers; the "
             "pull request's hybrid = `hybrid` with no miss sent over PCIe (its CPU computes every miss), "
             f"adaptive fills of at most 512 (or {SLOW_FILLS}, before its faster fill) experts per token. Every upload "
             "is a pageable copy.", "",
             "Host figures derived from the rows (the presets' `sources` say so): the GPU's achieved / spec-sheet "
             "bandwidth from the one row with every weight on the GPU (L4), applied to both machines' spec "
             "bandwidth (the same Ada-generation GDDR6 GPUs and kernels); `cpu_thread_gbps` from each machine's first "
             "`--cpu-moe` row (those rows are marked *fit* and not counted below). A pageable upload also holds "
             "the host thread that issues it, so the fills committed after a token complete before the next "
             "token starts (`drive(..., lag_tokens=0)`). One parameter is fitted across machines: k = pageable upload "
             "rate / per-thread CPU rate (a pageable copy is staged by one host thread), fitted on one machine's "
             "cache rows and used unchanged on the other. Error = predicted / published - 1.", "",
             "| machine | gpu_mem_gbps | cpu_thread_gbps | k fitted here | pageable_gbps (own k) |",
             "|---|---:|---:|---:|---:|"]
    for mname in machines:
        h = hosts[mname]
        lines.append(f"| {mname} | {h.gpu_mem_gbps:.1f} | {h.cpu_thread_gbps:.2f} | {ks[mname]:.3f} | "
                     f"{with_k(h, ks[mname]).pageable_gbps:.2f} |")
    lines += [""]
    errors = []  # (row label, error with own k, error with the other machine's k)
    speedups = {}
    for t in data["tables"]:
        mname = t["machine"]
        other = next(m for m in machines if m != mname) if len(machines) > 1 else mname
        model = model_of(data, t["model"], t["quant"])
        own, cross = with_k(hosts[mname], ks[mname]), with_k(hosts[mname], ks[other])
        lines += [f"## {data['machines'][mname]['about']}: {t['note']}", "",
                  f"Preset `{mname}`, model `{t['model']}` experts {t['quant']}, {t['cache_mib']} MiB cache, "
                  f"{t['tokens']} tokens published ({max(8, int(round(t['tokens'] * scale)))} simulated).", "",
                  f"| row | published t/s | predicted (k of {mname}) | error | predicted (k of {other}) | error | "
                  "hit rate | slots/layer |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        pred = {}
        for row, pub in t["rows"].items():
            a = predict(own, model, t, row, seeds, scale)
            b = predict(cross, model, t, row, seeds, scale)
            fit = any(tt is t and rr == row for tt, rr in used[mname].values())
            pred[row] = (a["tps"], b["tps"])
            ea, eb = a["tps"] / pub - 1, b["tps"] / pub - 1
            if not fit:
                errors.append((f"{ROW_NAMES[row]}, {mname}, {t['note'].split(',')[0]}", ea, eb))
            lines.append(f"| {ROW_NAMES[row]}{' (fit)' if fit else ''} | {pub:.1f} | {a['tps']:.1f} | {ea:+.1%} | "
                         f"{b['tps']:.1f} | {eb:+.1%} | {a['hit_rate']:.1%} | {a['slots']} |")
        lines.append("")
        if "lru" in t["rows"] and "hybrid" in t["rows"] or "hybrid-slow-fill" in t["rows"] and "lru" in t["rows"]:
            h = "hybrid" if "hybrid" in t["rows"] else "hybrid-slow-fill"
            pub_r = t["rows"][h] / t["rows"]["lru"]
            pr = (pred[h][0] / pred["lru"][0], pred[h][1] / pred["lru"][1])
            lines += [f"Hybrid / cache: published {pub_r:.2f}x, predicted {pr[0]:.2f}x (own k), {pr[1]:.2f}x (other "
                      f"machine's k).", ""]
            speedups.setdefault(mname, (pub_r, pr))
    n = len(errors)
    within_own = sum(1 for e in errors if abs(e[1]) <= TOLERANCE)
    within_cross = sum(1 for e in errors if abs(e[2]) <= TOLERANCE)
    sp = {m: (v[1][0] / v[0] - 1, v[1][1] / v[0] - 1) for m, v in speedups.items()}
    worst = max(errors, key=lambda e: abs(e[1]))
    lines += ["## Errors", "",
              f"- Rows within {TOLERANCE:.0%} with k fitted on their own machine: {within_own} of {n}; with k "
              f"fitted on the other machine: {within_cross} of {n}. Largest error (own k): {worst[1]:+.1%} "
              f"({worst[0]}).",
              "- Hybrid / cache speedup error (first table of each machine with both rows): " + "; ".join(
                  f"{m} {a:+.1%} (own k), {b:+.1%} (other k)" for m, (a, b) in sp.items()) + ".", "",
              "## Known limits", "",
              "- No recorded routing of these models exists here: hit rates come from synthetic traces with "
              "default parameters, not Qwen3.5's or Qwen3-Coder-Next's own routing; every cache row depends on them.",
              "- The prompt is not simulated: upstream's cache does its own loading while the prompt runs (left out "
              "of the published generation rate), and both caches start empty here.",
              "- Not modelled: llama.cpp's graph splits and its per-layer synchronisation on the `--cpu-moe` and "
              "cache paths (the pull request replaces them with a device mailbox); merged uploads of consecutive "
              "sorted misses; the pull request's swap rounds not running while its slow fill runs; mixed per-tensor "
              "quant types; the `-fit` rows that split layers between GPU and CPU.",
              "- The laptop has no row with every weight on the GPU: its `gpu_mem_gbps` is the L4's achieved "
              "fraction of its spec sheet, applied to the laptop's spec sheet.",
              "- The laptop's non-hybrid rows varied by up to about 5 t/s between rounds (published); a 15% "
              "target on them is inside that noise, and the `--cpu-moe` row that sets the laptop's CPU figure "
              "carries it.",
              "- Not reproduced: the laptop's hybrid rows (predicted well below the published figures, on both "
              "models). The model charges the pull request's hybrid the same CPU expert rate as upstream's "
              "`--cpu-moe` row; the pull request also changed the CPU's one-token-per-expert kernel (row chunking, "
              "tuned on that laptop) and replaces upstream's per-layer graph-split synchronisation with a device "
              "mailbox, and neither is modelled (a slow hand-off inside the `--cpu-moe` row is read as a slow "
              "CPU). The L4's hybrid rows, whose CPU figure comes the same way, are within 15%.", "",
              f"rows within 15%: {within_own} of {n}; hybrid/cache speedup error: laptop "
              f"{abs(sp.get('rtx4060-laptop', (float('nan'),))[0]):.0%}, L4 {abs(sp.get('l4-colab', (float('nan'),))[0]):.0%}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
