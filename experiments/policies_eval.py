"""Every scheduler policy on real and synthetic routing traces, simulated with the link and the CPU
charged; the defaults of the tuned families chosen by leave-one-trace-out; writes docs/POLICIES.md.

Traces: the bundled granite trace's decode rows, the switch-base-8 test trace, and synthetic
families (``simulate.evaluate.synthetic_cases``). Each runs from a cold cache on a model preset
reshaped to its geometry (``simulate.evaluate.trace_model``), on each hardware preset, at two
cache sizes. The logic lives in ``simulate.evaluate``; this script runs it and renders the page.

    python experiments/policies_eval.py                       # writes docs/POLICIES.md
    python experiments/policies_eval.py --tokens 12 --out /tmp/p.md   # a small version
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulate.evaluate import (GRIDS, OFFLINE, Case, run_set, select, summary, synthetic_cases,  # noqa: E402
                               trace_model, view)
from traces import load  # noqa: E402
from traces.importers import import_trace  # noqa: E402

SWITCH = ROOT / "tests" / "traces" / "data" / "switch-base-8" / "router-trace.v2.json"
HARDWARE = ("h200-xeon16", "rtx4060-laptop")
ROWS = ("lru", "freq-lru", "hybrid", "hybrid-cost", "predict", "lookahead", "static", "belady", "oracle")

ABOUT = {
    "lru": "Every miss uploaded, the least recently used resident the step does not use evicted (upstream's cache).",
    "freq-lru": "Every miss uploaded; the victim has the lowest routing count (halved every 16 steps), least recent on ties.",
    "hybrid": "A fixed share (44/256) of a step's distinct misses over PCIe, the rest on the CPU pool; fills after "
              "each token and swap rounds by decayed usage.",
    "hybrid-cost": "hybrid whose split comes from the cost model, its floor tuned online by shadow replays.",
    "predict": "Forecasts from transition counts learnt online; evicts by forecast, prefetches the next layer's "
               "likeliest experts after each step whatever the link is doing; every miss over PCIe.",
    "lookahead": "Online, with the cost model: each miss to the CPU or the link, whichever gives the faster "
                 "layer by the simulator's terms (the pool's hand-off copies and each GPU batch included; never "
                 "predicted slower than uploading every miss), plus what a cached upload is worth later; residents "
                 "ranked by recency, frequency or predict's forecast (`values`; `adaptive`: recency unless frequency's "
                 "shadow caches, run as the policy admits, hit 5% more lately); confident cross-layer prefetch only into the link's idle window; fills "
                 "by the same ranking in the link's idle time between tokens; prefetch or fill swaps held back "
                 "until an audit finds they lately brought more routes than they cost.",
    "static": "Residents fixed from the replayed trace's own routing counts (an oracle profile); misses on the CPU.",
    "belady": "Demand-only offline optimum for hits (knows the trace); every miss uploaded or streamed, no CPU.",
    "oracle": "The ceiling: lookahead's planner fed the future (Belady residency, prefetch of the next step's "
              "experts within the link's idle window, fastest CPU-or-link split, fills of experts used after "
              "the next token).",
}


def cases(limit: int | None) -> list[Case]:
    g = load(None)
    gt = tuple(g.tokens("decode"))[:limit]
    sw = import_trace("switch", SWITCH)
    st = tuple(sw.tokens())[:limit]
    return ([Case("granite", "real", gt, trace_model(g), (8, 16)), Case("switch-base-8", "real", st, trace_model(sw), (2, 4))]
            + synthetic_cases(limit or 192))


def _f(x, fmt=".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(res, chosen, cs, hardware, command) -> str:
    held, tuned = view(res, chosen, True), view(res, chosen, False)
    cols = [(h, s) for h in hardware for s in (0, 1)]
    out = ["# Policies", "",
           "Each scheduler policy on real and synthetic routing traces, simulated with the link and the CPU "
           "charged: tokens/s, hit rate, demand hit rate, experts moved over PCIe per token. Written by "
           "`experiments/policies_eval.py` (logic in `simulate/evaluate.py`).", "", "## Method", "",
           "Every trace runs from a cold cache (driver lag 1) on the `granite-3.0-1b-a400m` preset reshaped to the "
           "trace's geometry (its expert and dense sizes; the trace's layers, experts and top-k), on "
           + ", ".join(f"`{h}`" for h in hardware) + ", at two cache sizes per layer. A *hit* is the simulator's: "
           "resident when its step starts, a prefetch that lands after its step could start excluded (`moelab "
           "trace stats` reports the same); the *demand* hit rate leaves out experts brought in by any copy that "
           "completed since the previous step. *Gap closed* = (tokens/s - lru) / (oracle - lru). "
           "`lookahead` and `predict` have grids of configurations (" + "; ".join(
               f"{n}: {len(g)}" for n, g in GRIDS.items()) + "); for each trace the configuration with the highest "
           "geometric-mean tokens/s over lru on the *other* traces is reported (held out), and the one chosen on "
           "all traces is the family's default (tuning). Other families run at their defaults; "
           + ", ".join(f"`{p}`" for p in OFFLINE) + " read the trace they are scored on.", "",
           "Traces: " + "; ".join(f"{c.name} ({len(c.tokens)} tokens, {c.model.num_layers} layers x "
                                  f"{c.model.num_experts} experts top-{c.model.top_k}, slots {c.slots[0]}/{c.slots[1]})"
                                  for c in cs) + ".", "", "## Policies", ""]
    for p in ROWS:
        out += [f"**{p}**. {ABOUT[p]}", ""]
    out += ["## Chosen configurations", ""]
    for name, (default, per) in chosen.items():
        out.append(f"- `{name}` default (all traces): `{GRIDS[name][default]}`; held out: " + "; ".join(
            f"{c} `{GRIDS[name][i]}`" for c, i in per.items()))
    out += ["", "## Held-out summary (lookahead)", "",
            "lookahead's tokens/s over lru, over max(lru, hybrid), and gap closed, in its held-out configuration; "
            "then the same in its default configuration (tuning, chosen with the trace in).", "",
            "| trace | hardware | slots | x lru | x max(lru, hybrid) | gap closed | tuning: x lru | tuning: gap |",
            "|---|---|---|---|---|---|---|---|"]
    tun = {(r["case"], r["hardware"], r["slots"]): r for r in summary(tuned, cs, hardware)}
    rows = summary(held, cs, hardware)
    for r in rows:
        t = tun[r["case"], r["hardware"], r["slots"]]
        out.append(f"| {r['case']} | {r['hardware']} | {r['slots']} | {_f(r['x_lru'], '.3f')} | {_f(r['x_best'], '.3f')} "
                   f"| {_f(r['gap'] and 100 * r['gap'], '.0f')}% | {_f(t['x_lru'], '.3f')} | {_f(t['gap'] and 100 * t['gap'], '.0f')}% |")
    ok = [r for r in rows if r["x_best"] is not None]
    small = [r["gap"] for r in rows if r["smallest"] and r["gap"] is not None]
    allg = [r["gap"] for r in rows if r["gap"] is not None]
    out += ["", f"Held out: >= 1.0x max(lru, hybrid) on {sum(r['x_best'] >= 1.0 for r in ok)} of {len(ok)} "
            f"configurations; >= 1.2x lru on {sum((r['x_lru'] or 0) >= 1.2 for r in ok)} of {len(ok)}; median gap "
            f"closed {_f(sorted(allg)[len(allg) // 2] * 100 if allg else None, '.0f')}% (smallest cache: "
            f"{_f(sorted(small)[len(small) // 2] * 100 if small else None, '.0f')}%).", ""]
    for fam in dict.fromkeys(c.family for c in cs):
        out += [f"## Tables: {fam} traces", "",
                "Cell: tokens/s (x lru), hit rate / demand hit rate, experts moved per token; lookahead and predict "
                "in their held-out configuration.", ""]
        for c in (c for c in cs if c.family == fam):
            out += [f"**{c.name}**", "", "| policy | " + " | ".join(f"{h} {c.slots[i]}" for h, i in cols) + " |",
                    "|---" * (len(cols) + 1) + "|"]
            for p in ROWS:
                cells = []
                for h, i in cols:
                    r, lru = held.get((c.name, h, c.slots[i], p)), held.get((c.name, h, c.slots[i], "lru"))
                    cells.append("n/a" if r is None else f"{r['tokens_per_s']:.0f} (x{r['tokens_per_s'] / lru['tokens_per_s']:.2f}"
                                 f") {r['hit_rate']:.2f}/{r['demand_hit_rate']:.2f} {r['moved_per_token']:.1f}"
                                 if lru else f"{r['tokens_per_s']:.0f}")
                out.append(f"| {p} | " + " | ".join(cells) + " |")
            out.append("")
    out += ["## Known limits", "",
            "- `oracle` is a ceiling by construction, not by proof: a test checks it against every online policy "
            "on the evaluation set; Belady's residency is optimal for hits, not for time.",
            "- The driver completes a prefetch before the next step is planned, so a wrong prefetch cannot be "
            "stopped on the link; lookahead only evicts it first (and its audit holds such swaps back until they pay).",
            "- Every trace is priced with granite's expert sizes; synthetic traces come from one generator "
            "(`traces.synth`); the real traces are small (granite 192 decode rows, switch 215 rows).",
            "- hybrid and hybrid-cost run at their own defaults (their owner tunes them); predict's grid is small.",
            "- Only the grids above are chosen by leave-one-trace-out. lookahead's design and its fixed constants "
            "(the audit's threshold and memory, the shadows' memory, the 5% margin of adaptive values, the "
            "hand-off terms in its split) were settled while developing on this whole set, so the held-out "
            "columns are held out for the grid's choice only.",
            "- On h200-xeon16 the pool and the link cost about the same per miss, so lookahead's edge there comes "
            "from residency alone and stays small on the synthetic traces (summary above), where the oracle's "
            "knowledge of the next experts is worth far more; lookahead's forecasts are rarely confident enough "
            "to prefetch there.",
            "- predict's dataclass default is still its earlier one (every miss over PCIe, prefetch on); the "
            "cross-validation above picks `misses=\"cpu\"`, a change of its decision digests left for a deliberate commit.",
            "", "## Command", "", f"    {command}", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="tokens per trace (default: all; synthetic 192)")
    ap.add_argument("--hardware", default=",".join(HARDWARE), help="hardware presets, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "docs" / "POLICIES.md"))
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.tokens is not None and a.tokens < 4:
        print(f"--tokens: {a.tokens}, expected >= 4 (the synthetic traces have 3 sequences)", file=sys.stderr)
        return 2
    hardware = [h for h in a.hardware.split(",") if h]
    from scheduler.hardware import load_hardware

    for h in hardware:
        try:
            load_hardware(h)
        except ValueError as e:
            print(f"--hardware: {e}", file=sys.stderr)
            return 2
    out = Path(a.out)
    if not out.resolve().parent.is_dir():
        print(f"--out {a.out}: its directory does not exist", file=sys.stderr)
        return 2
    cs = cases(a.tokens)
    log = None if a.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    res = run_set(cs, hardware, progress=log)
    chosen = select(res, cs, hardware)
    cmd = "python experiments/policies_eval.py" + (f" --tokens {a.tokens}" if a.tokens else "")
    if tuple(hardware) != HARDWARE:
        cmd += f" --hardware {a.hardware}"
    text = render(res, chosen, cs, hardware, cmd)
    fd, tmp = tempfile.mkstemp(prefix=".policies.", dir=out.resolve().parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, out)
    if log:
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
