"""Plain vs speculative decode, and chunked prefill, for lru, fixed-fraction hybrid and hybrid-cost.

In simulation: a Qwen3-30B-A3B-shaped model (traces.synth's calibrated qwen3-30b-a3b routing) on
a hardware preset, a verification batch of draft_len + 1 tokens per step with per-draft acceptance
``--acceptance`` (simulate.speculative). Tokens/s = tokens produced / simulated time. Checks, each
printed PASS/FAIL:

1. speculative hybrid is never slower than speculative lru (the seed systems' failure);
2. speculative hybrid beats plain hybrid wherever speculative lru beats plain lru;
3. hybrid-cost is at least as fast as the best fixed miss fraction in every configuration;
4. prefill tokens/s on the hybrid path is at least the upload-everything (lru) path's.

    python experiments/speculative.py [--hardware rtx4070super-5950x] [--cache-mib 5632] [--out DIR]

Writes results.csv, results.json, config.json and speculative.png into --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from simulate.run import SimConfig, run
from simulate.speculative import merge_rows, verify_batches

FRACTIONS = (0.1, 44 / 256, 0.25, 0.5)


def policies():
    yield "lru", None
    for f in FRACTIONS:
        yield "hybrid", f
    yield "hybrid-cost", None


def simulate(tokens, produced, policy, frac, args) -> float:
    cfg = SimConfig(model=args.model, hardware=args.hardware, policy=policy, miss_fraction=frac,
                    cache_mib=args.cache_mib, phase="all")
    result, _ = run(cfg, tokens=tuple(tokens))
    return produced / result.total_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--hardware", default="rtx4070super-5950x")
    ap.add_argument("--cache-mib", type=float, default=5632.0, help="5.5 GiB, as the seed's MTP report")
    ap.add_argument("--tokens", type=int, default=256, help="decode rows replayed")
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="experiments/out/speculative")
    args = ap.parse_args()

    from traces import synth

    preset = synth.PRESETS["qwen3-30b-a3b"]
    trace = synth.generate(preset.num_layers, preset.num_experts, preset.top_k, args.tokens, preset.params,
                           np.random.default_rng(args.seed))
    rows = list(trace.tokens())
    results = []
    for draft in range(args.max_draft + 1):
        batches, produced = verify_batches(rows, draft, args.acceptance, np.random.default_rng(args.seed + draft))
        for policy, frac in policies():
            tps = simulate(batches, produced, policy, frac, args)
            results.append({"mode": "decode", "draft_len": draft, "policy": policy,
                            "miss_fraction": "" if frac is None else round(frac, 4), "tokens_per_s": tps})
            print(f"draft {draft}  {policy:<11} {'' if frac is None else f'{frac:.3f}':>6}  {tps:8.2f} tok/s",
                  file=sys.stderr)
    chunks = [merge_rows(rows[i:i + args.prefill_chunk], n)
              for n, i in enumerate(range(0, len(rows), args.prefill_chunk))]
    for policy, frac in policies():
        tps = simulate(chunks, len(rows), policy, frac, args)
        results.append({"mode": "prefill", "draft_len": "", "policy": policy,
                        "miss_fraction": "" if frac is None else round(frac, 4), "tokens_per_s": tps})

    checks = evaluate(results, args.max_draft)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "results.csv", lambda f: _csv(f, results))
    _write(out / "results.json", lambda f: json.dump({"results": results, "checks": checks}, f, indent=1))
    _write(out / "config.json", lambda f: json.dump(vars(args), f, indent=1))
    plot(results, args, out / "speculative.png")
    print_table(results, args.max_draft)
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0


def best(results, mode, draft, policy):
    vals = [r["tokens_per_s"] for r in results if r["mode"] == mode and r["draft_len"] == draft and r["policy"] == policy]
    return max(vals)


def evaluate(results, max_draft):
    checks = []
    drafts = range(1, max_draft + 1)
    lru = {d: best(results, "decode", d, "lru") for d in range(max_draft + 1)}
    hyb = {d: max(best(results, "decode", d, "hybrid"), best(results, "decode", d, "hybrid-cost"))
           for d in range(max_draft + 1)}
    worst = min(hyb[d] / lru[d] for d in drafts)
    checks.append(("speculative hybrid >= speculative lru", worst >= 1.0, f"min ratio {worst:.2f}"))
    gains = [(d, lru[d] > lru[0], hyb[d] > hyb[0]) for d in drafts]
    ok = all(h for d, l, h in gains if l)
    checks.append(("spec hybrid beats plain hybrid where spec lru beats plain lru", ok,
                   ", ".join(f"d{d}: lru {'+' if l else '-'} hybrid {'+' if h else '-'}" for d, l, h in gains)))
    modes = [("decode", d) for d in range(max_draft + 1)] + [("prefill", "")]
    short = [(m, d) for m, d in modes if best(results, m, d, "hybrid-cost") < best(results, m, d, "hybrid") * (1 - 1e-9)]
    checks.append(("hybrid-cost >= best fixed miss fraction", not short,
                   "all configs" if not short else f"short in {short}"))
    pf = max(best(results, "prefill", "", "hybrid"), best(results, "prefill", "", "hybrid-cost"))
    pl = best(results, "prefill", "", "lru")
    checks.append(("prefill hybrid path >= upload-everything", pf >= pl, f"{pf:.1f} vs {pl:.1f} tok/s"))
    return checks


def print_table(results, max_draft):
    cols = [("lru", None)] + [("hybrid", round(f, 4)) for f in FRACTIONS] + [("hybrid-cost", None)]
    head = "mode     draft " + " ".join(f"{p if f is None else f'h{f:.3f}':>11}" for p, f in cols)
    print(head)
    for mode, d in [("decode", d) for d in range(max_draft + 1)] + [("prefill", "")]:
        vals = []
        for p, f in cols:
            r = [x for x in results if x["mode"] == mode and x["draft_len"] == d and x["policy"] == p
                 and (f is None or x["miss_fraction"] == f)]
            vals.append(f"{r[0]['tokens_per_s']:>11.2f}")
        print(f"{mode:<8} {str(d):>5} " + " ".join(vals))


def plot(results, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pol, frac in [("lru", "lru", None), ("hybrid 44/256", "hybrid", round(44 / 256, 4)),
                             ("hybrid best fixed", "hybrid", "best"), ("hybrid-cost", "hybrid-cost", None)]:
        xs, ys = [], []
        for d in range(args.max_draft + 1):
            rs = [r for r in results if r["mode"] == "decode" and r["draft_len"] == d and r["policy"] == pol
                  and (frac in (None, "best") or r["miss_fraction"] == frac)]
            xs.append(d)
            ys.append(max(r["tokens_per_s"] for r in rs))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("draft length (tokens verified per step - 1)")
    ax.set_ylabel("decode tokens/s (simulated)")
    ax.set_title(f"{args.model} on {args.hardware}, {args.cache_mib:.0f} MiB cache, acceptance {args.acceptance}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)


def _csv(f, rows):
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
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
