"""The parts of experiments/policies_eval.py below its flow: the real held-out traces (``--real``) as cases, and
the tables and sentences its pages are made of (per run, per policy, per trace family; why 1.2x lru on half the
runs is missed; where one of oracle's variants outruns it)."""
from __future__ import annotations

import hashlib
import math
import statistics
from pathlib import Path

from simulate.evaluate import Case, summary, trace_model
from simulate.heldout import verdict
from traces.format import TraceError
from traces.importers import IMPORTERS, import_trace

ROWS = ("lru", "freq-lru", "hybrid", "hybrid-cost", "predict", "lookahead", "static", "belady", "oracle", "oracle-demand",
        "oracle-prefetch", "oracle-fills")
REAL = "real"  # the key of the real held-out set beside the seeds
FORECAST_FREE = ("lru", "freq-lru", "hybrid", "hybrid-cost")  # online policies that move no expert on a forecast
# real routing files known by their git blob id (not bundled: their repository carries no license)
KNOWN = {
    "ab67860b812ffde42d090b28c2db09441d15016a": "Mixtral-8x7B-Instruct-v0.1-FP8 served by vLLM, 2 GSM8K problems",
    "bdd16e7e589e4ef52f498439b96161ffc7197600": "Mixtral-8x7B-Instruct-v0.1-FP8 served by vLLM, 2 HumanEval problems",
}
KNOWN_FROM = ("github.com/Mario928/speculative-moe, routing_data_collected/{gsm8k,humaneval}_2_routing.jsonl (git blobs "
              "ab67860b, bdd16e7e: `git cat-file -p BLOB` in a clone)")


def blob_id(path: Path) -> str:
    """The file's git blob id (how ``KNOWN`` names a file)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def real_cases(specs, limit: int | None) -> tuple[list[Case], dict]:
    """``--real NAME=FORMAT:PATH`` each as a case (family "real") of its rows' tokens, caches of 1/4 and 1/2 of
    its experts (at least top-k); and {name: its file, blob id, provenance}. ValueError names what is wrong."""
    out, about = [], {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        fmt, colon, path = rest.partition(":")
        if not (eq and colon and name and path) or fmt not in IMPORTERS:
            raise ValueError(f"--real: {spec!r}, expected NAME=FORMAT:PATH with FORMAT one of {', '.join(IMPORTERS)}")
        if name in about or any(name == n for n in ("granite", "switch-base-8")):
            raise ValueError(f"--real: {spec!r}, the name {name!r} is already a trace of the evaluation")
        if not Path(path).is_file():
            raise ValueError(f"--real: {spec!r}, file {path} does not exist")
        try:
            t = import_trace(fmt, path)
            model = trace_model(t)
        except (TraceError, ValueError) as e:
            raise ValueError(f"--real: {spec!r}: {e}") from None
        toks = tuple(t.tokens())[:limit]
        if len(toks) < 4:
            raise ValueError(f"--real: {spec!r}, {len(toks)} tokens, expected >= 4")
        E, k = model.num_experts, model.top_k
        out.append(Case(name, "real", toks, model, (max(k, E // 4), max(k, E // 2))))
        bid = blob_id(Path(path))
        about[name] = {"file": str(path), "format": fmt, "blob": bid, "about": KNOWN.get(bid, "")}
    return out, about


def label(key) -> str:  # a held-out set's name
    return "real" if key == REAL else f"seed {key}"


def geo(xs) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def family_table(res, named, hardware, prec) -> list[str]:
    """One row per real trace and per synthetic set: lookahead's tokens/s over lru (geometric mean,
    range), the runs at or above max(lru, hybrid), at or above 1.2x lru (lookahead / oracle-demand /
    oracle), the median gap closed and the forecast precision (cross-layer / temporal, median)."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"
    out = ["| set | trace family | runs | lookahead / lru: geometric mean (range) | >= max(lru, hybrid) | >= 1.2x lru: "
           "lookahead / oracle-demand / oracle | median gap closed | forecast precision, cross / temporal |",
           "|---" * 8 + "|"]
    for set_label, cs in named:
        groups = [(c.name, [c]) for c in cs if c.family == "real"] + (
            [("synthetic, " + str(len(syn)) + " families", syn)] if (syn := [c for c in cs if c.family != "real"]) else [])
        for fam, g in groups:
            rows = summary(res, g, hardware)
            v, od = verdict(rows), verdict(summary(res, g, hardware, "oracle-demand"))
            xs = [r["x_lru"] for r in rows if r["x_lru"]]
            med = lambda k: statistics.median(p) if (p := [prec[c.name][k] for c in g if prec[c.name][k] is not None]) else None
            out.append(f"| {set_label} | {fam} | {v['runs']} | x{geo(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) | {v['best']} | "
                       f"{v['x12']} / {od['x12']} / {sum((r['oracle_x_lru'] or 0) >= 1.2 for r in rows)} | {pct(v['gap'])} | "
                       f"{pct(med('cross'))} / {pct(med('temporal'))} |")
    return out


def best_ceiling(res, named, hardware) -> str:
    """A sentence, per set: on how many runs one of oracle's own variants (``oracle-demand``, ``-prefetch``,
    ``-fills``) runs faster than ``oracle``, and lookahead's median gap closed (overall, per preset) against
    the fastest of the four per run instead of ``oracle``."""
    parts = []
    for set_label, cs in named:
        n, above, gaps = 0, 0, {h: [] for h in hardware}
        for c in cs:
            for h in hardware:
                for s in c.slots:
                    t = {p: (res.get((c.name, h, s, p)) or {}).get("tokens_per_s") for p in
                         ("lru", "lookahead", "oracle", "oracle-demand", "oracle-prefetch", "oracle-fills")}
                    if None in t.values():
                        continue
                    best = max(t[p] for p in ("oracle", "oracle-demand", "oracle-prefetch", "oracle-fills"))
                    n += 1
                    above += best > t["oracle"] * (1 + 1e-9)
                    if best > t["lru"]:
                        gaps[h].append((t["lookahead"] - t["lru"]) / (best - t["lru"]))
        every = [g for h in hardware for g in gaps[h]]
        med = lambda xs: f"{100 * statistics.median(xs):.0f}%" if xs else "n/a"
        parts.append(f"{set_label}: {above} of {n}, gap closed {med(every)} ("
                     + ", ".join(f"{h} {med(gaps[h])}" for h in hardware) + ")")
    return ("`oracle` is not the fastest of its own variants everywhere (there, its two kinds of early move together "
            "ran slower than one alone): a variant runs faster on " + "; ".join(parts) + ", lookahead's median gap "
            "closed measured against the fastest of the four per run.")


def why_half(res, named, hardware) -> str:
    """A sentence, per set: on how many runs 1.2x lru is reached by the best forecast-free online policy of
    the run (``FORECAST_FREE``, the best one picked per run after the fact), by ``oracle-demand`` (foresight
    without early moves), by lookahead and by oracle; and the median share of the lru -> oracle gap that
    the best forecast-free policy closes."""
    parts = []
    for set_label, cs in named:
        n = free12 = od12 = la12 = or12 = 0
        gaps = []
        for c in cs:
            for h in hardware:
                for s in c.slots:
                    t = {p: (res.get((c.name, h, s, p)) or {}).get("tokens_per_s") for p in
                         FORECAST_FREE + ("oracle-demand", "lookahead", "oracle")}
                    if not t["lru"] or not t["oracle"]:
                        continue
                    free = max(t[p] or 0 for p in FORECAST_FREE)
                    n += 1
                    free12 += free >= 1.2 * t["lru"]
                    od12 += (t["oracle-demand"] or 0) >= 1.2 * t["lru"]
                    la12 += (t["lookahead"] or 0) >= 1.2 * t["lru"]
                    or12 += t["oracle"] >= 1.2 * t["lru"]
                    if t["oracle"] > t["lru"]:
                        gaps.append((free - t["lru"]) / (t["oracle"] - t["lru"]))
        med = f"{100 * statistics.median(gaps):.0f}%" if gaps else "n/a"
        parts.append(f"{set_label}: {free12} / {od12} / {la12} / {or12} of {n} (half: {(n + 1) // 2}), gap closed {med}")
    return ("Why 1.2x lru on half the runs is missed, per set: runs at or above 1.2x lru by the best forecast-free "
            "online policy of each run (" + ", ".join(f"`{p}`" for p in FORECAST_FREE) + ", picked per run after the "
            "fact) / by `oracle-demand` (foresight, no early moves) / by lookahead / by oracle, and the median share of "
            "the lru -> oracle gap that best forecast-free policy closes: " + "; ".join(parts) + ". Where the "
            "forecast-free count is below half, the rest has to come from moves made on a forecast, and their "
            "precision (above: forecast precision) bounds them.")


def run_table(rows, res, extra=None) -> list[str]:
    """Per run: tokens/s of lru, hybrid, lookahead and oracle; lookahead over max(lru, hybrid) and over
    lru; oracle over lru (marked where 1.2x lru is out of its reach); gap closed; tokens followed."""
    head = ("| trace | hardware | slots | lru | hybrid | lookahead | oracle | lookahead / max(lru, hybrid) | lookahead "
            "/ lru | oracle / lru | gap closed | followed hybrid |")
    out = [head + (f" {extra[0]} |" if extra else ""), "|---" * (12 + bool(extra)) + "|"]
    for r in rows:
        get = lambda p: res.get((r["case"], r["hardware"], r["slots"], p))
        t = lambda p: f"{get(p)['tokens_per_s']:.0f}" if get(p) else "n/a"
        x = lambda v: "n/a" if v is None else f"{v:.3f}"
        o = r["oracle_x_lru"]
        fol = (get("lookahead") or {}).get("followed")
        cells = [r["case"], r["hardware"], str(r["slots"]), t("lru"), t("hybrid"), t("lookahead"), t("oracle"),
                 x(r["x_best"]) if (r["x_best"] or 1) >= 1 else f"**{x(r['x_best'])}**", x(r["x_lru"]),
                 x(o) + (" (1.2x out of reach)" if o is not None and o < 1.2 else ""),
                 "n/a" if r["gap"] is None else f"{100 * r['gap']:.0f}%", "n/a" if fol is None else f"{100 * fol:.0f}%"]
        out.append("| " + " | ".join(cells + ([extra[1](r)] if extra else [])) + " |")
    return out


def full_tables(res, cs, hardware, prec) -> list[str]:
    cols, out = [(h, i) for h in hardware for i in (0, 1)], []
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"
    for c in cs:
        f = prec[c.name]
        out += [f"**{c.name}** ({len(c.tokens)} tokens, {c.model.num_layers} layers x {c.model.num_experts} experts "
                f"top-{c.model.top_k}; forecast precision at {c.slots[0]} slots, cross-layer / temporal / random: "
                f"{pct(f['cross'])} / {pct(f['temporal'])} / {pct(f['random'])}, steps with a miss {pct(f['miss'])})", "", "| policy | " + " | ".join(f"{h} {c.slots[i]}" for h, i in cols) + " |",
                "|---" * (len(cols) + 1) + "|"]
        for p in ROWS:
            cells = []
            for h, i in cols:
                r, lru = res.get((c.name, h, c.slots[i], p)), res.get((c.name, h, c.slots[i], "lru"))
                cells.append("n/a" if r is None else f"{r['tokens_per_s']:.0f}" + (
                    f" (x{r['tokens_per_s'] / lru['tokens_per_s']:.2f})" if lru else "")
                    + f" {r['hit_rate']:.2f}/{r['demand_hit_rate']:.2f} {r['moved_per_token']:.1f}")
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        out.append("")
    return out
