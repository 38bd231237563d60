"""The peer benchmark's ``bench`` stage: moelab's executor against llama.cpp on the same GGUF and
GPU, run side by side (``experiments/peer_llamacpp.py`` describes the method).

Checks the arguments before any run, fixes the configuration (``config.json``; a second call with
the same configuration continues from ``raw.jsonl``), runs the rounds (``peer_runs``), then writes
``result.json`` (config with the moelab commit, rows, medians, comparisons), ``result.png`` and a
README (``peer_report``). The stages before it, ``pack`` and ``prepare``, are in ``peer_build``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .peer_build import ROOT, Fail, moelab_cmd
from .peer_report import comparisons, medians, plot, readme, tables
from .peer_runs import POLICIES, block_expert_bytes, budget_blocks, cells, fit_prompt, read_rows, run_rounds

__all__ = ["bench", "check_bench_args", "bench_config", "moelab_commit", "llama_source"]


def bench_config(args, blocks: list[int], n_budget: int, prompt_tokens: int) -> dict:
    return {"model": str(args.model), "model_bytes": Path(args.model).stat().st_size, "num_blocks": len(blocks),
            "block_expert_bytes": blocks, "budget_mib": args.budget_mib, "ncmoe_budget": n_budget,
            "rounds": args.rounds, "repetitions": args.repetitions, "prompt_tokens_llama": args.prompt_tokens,
            "prompt_tokens_moelab": prompt_tokens, "tokens": args.tokens, "llama_threads": args.llama_threads,
            "threads": args.threads, "policies": list(args.policies), "graph_cpu": list(args.graph_cpu),
            "hardware": str(args.hardware),
            "warmup": args.warmup,
            "moelab_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MOELAB_")},
            "llama_bench": str(args.llama_bench), "timeout_s": args.timeout_s,
            "llama_source": llama_source(Path(args.llama_bench)), "moelab_commit": moelab_commit()}


def moelab_commit() -> str | None:
    """The checkout's commit, when it is a git checkout, with ``+changes`` when the tracked files
    differ from it (a copied working tree whose .git is older than its files says so)."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if p.returncode != 0 or not p.stdout.strip():
            return None
        d = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--"], capture_output=True)
    except OSError:
        return None
    return p.stdout.strip() + ("+changes" if d.returncode == 1 else "")


def llama_source(llama_bench: Path) -> dict | None:
    """The sdist the llama-bench was built from (PEER_SOURCE.json beside its build folder)."""
    try:
        return json.loads((llama_bench.parents[2] / "llama.cpp" / "PEER_SOURCE.json").read_text())
    except (OSError, ValueError, IndexError):
        return None


def check_bench_args(args) -> None:
    args.work = Path(args.work)
    args.model = Path(args.model or args.work / "q8.gguf")
    args.llama_bench = Path(args.llama_bench or args.work / "build" / "bin" / "llama-bench")
    args.policies = [p for p in args.policies.split(",") if p]
    args.graph_cpu = [p for p in getattr(args, "graph_cpu", "").split(",") if p]
    for name in ("budget_mib", "rounds", "repetitions", "tokens", "prompt_tokens", "threads", "llama_threads"):
        if getattr(args, name) < 1:
            raise Fail(f"bench: --{name.replace('_', '-')} {getattr(args, name)}, expected >= 1")
    if args.timeout_s <= 0:
        raise Fail(f"bench: --timeout-s {args.timeout_s}, expected > 0")
    bad = [p for p in args.policies if p not in POLICIES]
    if bad or not args.policies:
        raise Fail(f"bench: --policies {','.join(bad) or '(empty)'}: expected some of {','.join(POLICIES)}")
    bad = [p for p in args.graph_cpu if p not in POLICIES or p == "cpu"]
    if bad or len(set(args.graph_cpu)) < len(args.graph_cpu):
        raise Fail(f"bench: --graph-cpu {','.join(bad) or ','.join(args.graph_cpu)}: expected distinct policies of "
                   f"{','.join(p for p in POLICIES if p != 'cpu')} (the CPU graph is a GPU token graph)")
    if not args.model.is_file():
        raise Fail(f"bench: model {args.model}: no such file (run prepare first)")
    if not (args.llama_bench.is_file() and os.access(args.llama_bench, os.X_OK)):
        raise Fail(f"bench: {args.llama_bench}: no llama-bench executable there (run prepare first)")
    exe = moelab_cmd(args)[0]
    if not shutil.which(exe):
        raise Fail(f"bench: --moelab {exe}: not an executable")
    if "hybrid-cost" in args.policies + args.graph_cpu and not Path(args.hardware).is_file():
        raise Fail(f"bench: --hardware {args.hardware}: no such file (needed by --policy hybrid-cost)")


def bench(args) -> int:
    from execute.gguf_io import GGUFError
    from execute.tokenizer import Tokenizer, TokenizerError

    check_bench_args(args)
    try:
        blocks = block_expert_bytes(args.model)
        prompt, prompt_tokens = fit_prompt(Tokenizer.from_gguf(args.model), args.prompt_tokens)
    except (GGUFError, TokenizerError) as exc:
        raise Fail(f"bench: {exc}") from None
    if not any(blocks):
        raise Fail(f"bench: {args.model}: no routed experts")
    n_budget = budget_blocks(blocks, args.budget_mib * 2**20)
    config = bench_config(args, blocks, n_budget, prompt_tokens)
    out = Path(args.out)
    done = []
    if (out / "config.json").is_file():
        if {**json.loads((out / "config.json").read_text()), "rounds": args.rounds} != config:
            raise Fail(f"bench: {out / 'config.json'} holds another configuration; give a new --out or remove {out}")
        done = read_rows(out / "raw.jsonl")
        print(f"bench: continuing {out}: {len(done)} runs already recorded")
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")  # --rounds may grow
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    round_cells = cells(args, blocks, n_budget)
    print(f"bench: {args.model}: {len(blocks)} blocks, {sum(blocks) / 2**30:.2f} GiB of experts; budget "
          f"{args.budget_mib} MiB -> -ncmoe {n_budget} ({sum(blocks[n_budget:]) / 2**20:,.0f} MiB in VRAM); "
          f"prompt {prompt_tokens} tokens (llama-bench pp{args.prompt_tokens}); "
          f"{args.rounds} rounds x {len(round_cells)} configurations", flush=True)
    complete = run_rounds(args, round_cells, prompt, out, done)
    med = medians(round_cells, done)
    comp = comparisons(args.policies, med, len(blocks), n_budget, args.graph_cpu)
    table = tables(med, comp, round_cells)
    result = {"config": config, "prompt": prompt, "complete": complete, "rows": done, "medians": med,
              "comparisons": comp}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(comp, out / "result.png")
    (out / "README.md").write_text(readme(args, config, done, table, complete))
    print(table)
    failed = [name for name, m in med.items() if m["errors"]]
    if not complete:
        print(f"bench: incomplete ({len(done)} of {args.rounds * len(round_cells)} runs); run the same command again")
        return 3
    if failed:
        print(f"bench: failed configurations: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)
        return 1
    return 0
