"""Prompt-length sweep: prompt tokens/s and time to first token of ``moelab run`` for prompts of
64, 256, 1024 and 4096 tokens (``--lengths``), every expert resident (``gpu``) and under expert
budgets (``--budgets-mib``, policy ``--policy``), side by side in one process; ``--old`` adds each
configuration on the previous prefill path (``MOELAB_PREFILL=0``, ``MOELAB_PREFILL_DENSE=0``, chunks
of 32) for the ratio; ``--device-ab`` runs each configuration with the chunk on the device
(``MOELAB_PREFILL_DEVICE=1``) and block by block (``0``); ``--ab VAR=V1,V2`` once per value of a
switch (e.g. ``MOELAB_PREFILL_MM=1,2``).

Writes ``rows.csv`` and ``result.json`` (rows + config), ``config.json``, ``README.md`` and
``prompt_sweep.png`` (when matplotlib is installed) into ``--out``. The logic is
``execute.prompt_bench``.

    python experiments/prompt_sweep.py MODEL.gguf --out experiments/out/prompt_sweep \
        --lengths 64,256,1024,4096 --budgets-mib 2048,4096 --old
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from execute.prompt_bench import Config, plot, sweep  # noqa: E402


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SystemExit(f"prompt_sweep: {flag} {text!r}: expected comma-separated positive integers")
    return vals


def configs(args) -> list[Config]:
    out = [Config("gpu", ("--policy", "gpu"))]
    out += [Config(f"{args.policy} {b} MiB", ("--policy", args.policy, "--cache-mib", str(b))) for b in args.budgets]
    if args.old:
        old = {"MOELAB_PREFILL": "0", "MOELAB_PREFILL_DENSE": "0"}
        out += [Config(c.label + " (old path)", (*c.argv, "--prefill-chunk", "32"), old) for c in list(out)]
    if args.device_ab:
        out = [Config(f"{c.label} ({name})", c.argv, {**c.env, "MOELAB_PREFILL_DEVICE": v}) for c in out
               for name, v in (("device", "1"), ("block by block", "0"))]
    if args.ab:
        var, values = _ab(args.ab)
        out = [Config(f"{c.label} ({var}={v})", c.argv, {**c.env, var: v}) for c in out for v in values]
    return out


def _ab(text: str) -> tuple[str, list[str]]:
    """``--ab VAR=V1,V2,..`` -> (VAR, [V1, V2, ..])."""
    var, _, vals = text.partition("=")
    values = [v.strip() for v in vals.split(",") if v.strip()]
    if not var.startswith("MOELAB_") or not values:
        raise SystemExit(f"prompt_sweep: --ab {text!r}: expected MOELAB_NAME=V1,V2")
    return var, values


def readme(config: dict, rows: list[dict]) -> str:
    lines = ["# Prompt-length sweep", "", f"Model `{config['model']}`; lengths {config['lengths']}; "
             f"{config['repeats']} repeat(s); command: `{config['command']}`.", "",
             "| config | prompt tokens | prompt tokens/s | first token s | chunk | hit rate |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['prompt_tokens']} | {r['prompt_tokens_per_s']:.1f} | "
                     f"{r['first_token_s']:.3f} | {r['prefill_chunk']} | {r['hit_rate'] or 0:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="64,256,1024,4096")
    ap.add_argument("--budgets-mib", default="", help="expert budgets (MiB) for --policy, comma-separated")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--old", action="store_true", help="also run each configuration on the previous prefill path")
    ap.add_argument("--device-ab", action="store_true",
                    help="each configuration with chunks on the device (MOELAB_PREFILL_DEVICE=1) and block by block (0)")
    ap.add_argument("--ab", default="", metavar="VAR=V1,V2",
                    help="each configuration once per value of a MOELAB_ switch, e.g. MOELAB_PREFILL_MM=1,2")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    if not args.model.is_file():
        raise SystemExit(f"prompt_sweep: {args.model}: no such file")
    lengths = _ints(args.lengths, "--lengths")
    args.budgets = _ints(args.budgets_mib, "--budgets-mib") if args.budgets_mib else []
    if args.repeats < 1:
        raise SystemExit(f"prompt_sweep: --repeats {args.repeats}: expected >= 1")
    if args.ab:
        _ab(args.ab)  # checked before any run
    cfgs = configs(args)
    config = {"model": str(args.model), "lengths": lengths, "repeats": args.repeats, "threads": args.threads,
              "configs": [{"label": c.label, "argv": list(c.argv), "env": c.env} for c in cfgs],
              "command": " ".join(["python", "experiments/prompt_sweep.py", *(argv or sys.argv[1:])])}

    def show(row):
        print(f"{row['config']:>28} {row['prompt_tokens']:>6} tokens {row['prompt_tokens_per_s']:>9.1f} tok/s "
              f"first token {row['first_token_s']:.3f} s", flush=True)

    rows = sweep(str(args.model), lengths, cfgs, args.threads, args.repeats, progress=show)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "rows.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (args.out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (args.out / "result.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n")
    (args.out / "README.md").write_text(readme(config, rows))
    try:
        plot(rows, str(args.out / "prompt_sweep.png"))
    except ImportError:
        print("prompt_sweep: matplotlib missing; no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
