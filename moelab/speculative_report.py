"""The speculative-decoding sweep's checks and outputs: the four PASS/FAIL checks on its rows
(``evaluate``, with a note on whether a measured shortfall lies inside the runs' spread), the
tables printed, the plot, and results.csv/json and config.json written atomically."""
from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

from scheduler import MISS_FRAC_256

from .speculative import FRACTIONS

__all__ = ["best_row", "noise", "evaluate", "executor_checks", "print_table", "plot", "write_results", "write_csv",
           "write_atomic"]


def best_row(results, mode, draft, policy):
    """The fastest row of ``policy`` (of its fixed fractions, for hybrid) in ``mode`` at ``draft``."""
    rows = [r for r in results if r["mode"] == mode and r["draft_len"] == draft and r["policy"] == policy]
    return max(rows, key=lambda r: r["tokens_per_s"])


def noise(detail: str, ratio: float, *rows) -> str:
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
                   noise(f"min ratio {ratio[worst]:.2f}", ratio[worst], hyb[worst], lru[worst])))
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
            short.append(noise(f"{m} {d}: {r:.2f}", r, hc, fx))
    checks.append(("hybrid-cost >= best fixed miss fraction", not short,
                   "all configs" if not short else "short in " + "; ".join(short)))
    pf = max(best_row(results, "prefill", "", "hybrid"), best_row(results, "prefill", "", "hybrid-cost"),
             key=lambda r: r["tokens_per_s"])
    pl = best_row(results, "prefill", "", "lru")
    r = pf["tokens_per_s"] / pl["tokens_per_s"]
    checks.append(("prefill hybrid path >= upload-everything", r >= 1.0,
                   noise(f"{pf['tokens_per_s']:.1f} vs {pl['tokens_per_s']:.1f} tok/s", r, pf, pl)))
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
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def write_csv(f, rows):
    """The rows' scalar columns (per-run lists stay in results.json)."""
    w = csv.DictWriter(f, fieldnames=[k for k, v in rows[0].items() if not isinstance(v, list)], extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def write_atomic(path: Path, fill, binary: bool = False) -> None:
    """``fill(f)`` writes the file through a temporary name in the same folder, then renamed."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"newline": ""})) as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def executor_checks(results, max_draft) -> list:
    """The measured sweep's checks: every speculative run gave the plain run's tokens, then (with
    lru, hybrid and hybrid-cost measured) ``evaluate``'s four."""
    decode = [r for r in results if r["mode"] == "decode"]
    checks = [("speculative greedy gives plain greedy's tokens", all(r["same_tokens"] for r in decode),
               f"{len(decode)} runs")]
    if {"lru", "hybrid", "hybrid-cost"} <= {r["policy"] for r in results}:
        checks += evaluate(results, max_draft)
    return checks


def write_results(out: Path, results: list[dict], checks: list, args) -> None:
    """results.csv (scalar columns), results.json (rows and checks) and config.json (the arguments)."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.csv", lambda f: write_csv(f, results))
    write_atomic(out / "results.json", lambda f: json.dump({"results": results, "checks": checks}, f, indent=1))
    write_atomic(out / "config.json", lambda f: json.dump(vars(args), f, indent=1))
