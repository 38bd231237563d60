"""The peer benchmark's runs: its configurations (llama-bench ``-ncmoe N`` values and moelab
policies), each one's command line, one run as a subprocess with its output parsed into a row,
and the interleaved rounds appended to ``raw.jsonl`` as they end (resumable, with a deadline)."""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path

from .peer_build import ROOT, Fail, child_env, moelab_cmd

__all__ = ["HARDWARE", "POLICIES", "BUDGET_POLICIES", "GRAPH_CPU", "PROMPT_WORDS", "MOELAB_FIELDS", "block_expert_bytes",
           "budget_blocks", "fit_prompt", "cells", "llama_command", "moelab_command", "parse_llama", "parse_moelab",
           "measure", "round_order", "run_rounds", "warmup", "read_rows"]

HARDWARE = ROOT / "docs" / "fidelity" / "h200-calibrated.json"
POLICIES = ("gpu", "lru", "hybrid", "hybrid-cost", "cpu")
BUDGET_POLICIES = ("lru", "hybrid", "hybrid-cost")
GRAPH_CPU = "+cpugraph"  # a cell's suffix: the policy run with ``moelab run --graph-cpu``
PROMPT_WORDS = (
    "A mixture of experts layer sends every token to a few of its many feed forward networks, "
    "chosen by a small router. Most of the weights sit in those experts, so a model that does not "
    "fit in the memory of one graphics card can still run when the experts live in host memory and "
    "only the ones a token needs are copied over the bus, or computed on the processor where they "
    "already are. Which experts to keep on the card, which to copy and which to leave on the host "
    "is a scheduling question with a budget of bytes and a clock that never stops: copies share "
    "one link, the processor has a fixed number of cores, and the card waits for whichever arrives "
    "last. A cache that keeps the most recently used experts works well when the same experts come "
    "back from one token to the next, and poorly when the router spreads its choices evenly. "
    "Splitting the work, so that some misses are copied while others run on the host at the same "
    "time, keeps both sides busy. The numbers that matter are the tokens per second of the prompt "
    "and of the answer, measured on the same machine with the same file.").split()



def block_expert_bytes(model: Path) -> list[int]:
    """Routed-expert bytes of every block of the GGUF (0 for dense blocks)."""
    from execute.gguf_io import read_model_info

    info = read_model_info(model)
    return [n * b for n, b in zip(info.num_experts, info.expert_bytes)]


def budget_blocks(blocks: list[int], budget_bytes: int) -> int:
    """The smallest N such that the expert bytes of blocks N.. (left in VRAM by ``-ncmoe N``) fit."""
    for n in range(len(blocks) + 1):
        if sum(blocks[n:]) <= budget_bytes:
            return n
    return len(blocks)


def fit_prompt(tokenizer, max_tokens: int) -> tuple[str, int]:
    """The longest prefix of PROMPT_WORDS (repeated as needed) that encodes to at most
    ``max_tokens`` tokens, and its token count."""
    from execute.prompt_bench import fit_prompt as fit

    try:
        return fit(tokenizer, max_tokens, PROMPT_WORDS)
    except ValueError:
        raise Fail(f"bench: no prefix of the prompt fits {max_tokens} tokens") from None


def cells(args, blocks: list[int], n_budget: int) -> list[dict]:
    """Every configuration of one round: llama-bench's -ncmoe values, then moelab's policies."""
    out = []
    for n in sorted({0, n_budget, len(blocks)}):
        out.append({"cell": f"llama.cpp -ncmoe {n}", "tool": "llama.cpp", "ncmoe": n,
                    "expert_bytes_vram": sum(blocks[n:])})
    runs = [(p, False) for p in args.policies] + [(p, True) for p in getattr(args, "graph_cpu", [])]
    for policy, graph_cpu in runs:
        extra = ["--policy", policy]
        if policy in BUDGET_POLICIES:
            extra += ["--cache-mib", str(args.budget_mib)]
        if policy == "hybrid-cost":
            extra += ["--hardware", str(args.hardware)]
        vram = sum(blocks) if policy == "gpu" else 0 if policy == "cpu" else args.budget_mib * 2**20
        out.append({"cell": f"moelab {policy}{GRAPH_CPU if graph_cpu else ''}", "tool": "moelab", "policy": policy,
                    "graph_cpu": graph_cpu, "extra": extra + (["--graph-cpu"] if graph_cpu else []),
                    "expert_bytes_vram": vram})
    return out


def llama_command(args, cell: dict) -> list[str]:
    return [str(args.llama_bench), "-m", str(args.model), "-o", "json", "-ngl", "99", "-fa", "on",
            "-p", str(args.prompt_tokens), "-n", str(args.tokens), "-r", str(args.repetitions),
            "-t", str(args.llama_threads), "-ncmoe", str(cell["ncmoe"])]


def moelab_command(args, cell: dict, prompt: str) -> list[str]:
    """``moelab run`` of ``cell``; the first ``gpu`` run also records its routing as OUT/trace (every
    policy routes the same greedy tokens: ``simulate.peer`` replays it to predict each row)."""
    trace = Path(args.out) / "trace"
    record = (["--record-trace", str(trace)] if cell.get("policy") == "gpu" and not cell.get("graph_cpu")
              and not trace.exists() else [])
    return [*moelab_cmd(args), "run", str(args.model), "-p", prompt, "-n", str(args.tokens), "--raw",
            "--threads", str(args.threads), *cell["extra"], *record, "--json"]


def parse_llama(stdout: str, ncmoe: int) -> dict:
    """pp and tg tokens/s of one llama-bench ``-o json`` run at ``-ncmoe ncmoe`` (its array starts
    with a line holding ``[``; anything printed before it is skipped)."""
    lines = stdout.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == "["), 0)
    rows = json.loads("".join(lines[start:]))
    got = {}
    for r in rows:
        if r.get("n_cpu_moe") != ncmoe:
            raise ValueError(f"llama-bench reported n_cpu_moe {r.get('n_cpu_moe')}, expected {ncmoe}")
        kind = "pp" if r["n_prompt"] and not r["n_gen"] else "tg" if r["n_gen"] and not r["n_prompt"] else None
        if kind:
            got[kind] = {"tokens": r[f"n_{'prompt' if kind == 'pp' else 'gen'}"], "avg_ts": r["avg_ts"],
                         "stddev_ts": r["stddev_ts"], "samples_ts": r.get("samples_ts", [])}
    if set(got) != {"pp", "tg"}:
        raise ValueError(f"llama-bench output has {sorted(got)} tests, expected pp and tg")
    return {"prompt_tokens_per_s": got["pp"]["avg_ts"], "decode_tokens_per_s": got["tg"]["avg_ts"], "llama": got,
            "build_commit": rows[0].get("build_commit")}


def parse_moelab(stdout: str) -> dict:
    """The JSON object ``moelab run --json`` prints after the generated text."""
    lines = stdout.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].rstrip("\n") == "{":
            try:
                return json.loads("".join(lines[i:]))
            except ValueError:
                continue
    raise ValueError("no JSON object at the end of moelab run's output")


MOELAB_FIELDS = ("prompt_tokens", "prompt_tokens_per_s", "decode_tokens", "decode_tokens_per_s", "generated",
                 "stopped_at_eos", "cache_mib", "hit_rate", "uploads", "upload_mib", "first_token_s",
                 "first_token_breakdown")


def measure(args, cell: dict, prompt: str, log: Path) -> dict:
    """One run of ``cell``: a row with its figures, or with ``error``."""
    cmd = llama_command(args, cell) if cell["tool"] == "llama.cpp" else moelab_command(args, cell, prompt)
    row = {"cell": cell["cell"], "command": cmd}
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=child_env())
    except subprocess.TimeoutExpired as exc:  # its output arrives as bytes, text=True or not
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
        log.write_text(f"$ {shlex.join(cmd)}\n{out}\n--- stderr\n{err}")
        return {**row, "wall_s": time.monotonic() - t0, "error": f"timed out after {args.timeout_s} s"}
    except OSError as exc:
        return {**row, "wall_s": time.monotonic() - t0, "error": str(exc)}
    row["wall_s"] = time.monotonic() - t0
    log.write_text(f"$ {shlex.join(cmd)}\n{p.stdout}\n--- stderr\n{p.stderr}")
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {**row, "error": f"exit {p.returncode}: {last[:200]}"}
    try:
        if cell["tool"] == "llama.cpp":
            return {**row, **parse_llama(p.stdout, cell["ncmoe"])}
        out = parse_moelab(p.stdout)
        return {**row, **{k: out[k] for k in MOELAB_FIELDS if k in out}}
    except (ValueError, KeyError, TypeError) as exc:
        return {**row, "error": f"unreadable output: {exc}"}


def round_order(round_cells: list[dict], r: int) -> list[dict]:
    """Round r's order: llama.cpp then moelab on even rounds, reversed on odd ones."""
    return round_cells if r % 2 == 0 else round_cells[::-1]


def run_rounds(args, round_cells: list[dict], prompt: str, out: Path, done: list[dict]) -> bool:
    """Measure every (round, cell) not in ``done``, appending rows to raw.jsonl; -> True when
    every cell was measured (False: stopped by the deadline)."""
    t0 = time.monotonic()
    have = {(d["round"], d["cell"]) for d in done}
    walls = {d["cell"]: d["wall_s"] for d in done}
    (out / "logs").mkdir(exist_ok=True)
    raw = out / "raw.jsonl"
    if raw.is_file() and not raw.read_bytes().endswith(b"\n") and raw.stat().st_size:
        with open(raw, "a") as f:  # after a line cut short by a kill
            f.write("\n")
    total = args.rounds * len(round_cells)
    warm = not args.warmup
    for r in range(args.rounds):
        for cell in round_order(round_cells, r):
            if (r, cell["cell"]) in have:
                continue
            expected = walls.get(cell["cell"], statistics.median(walls.values()) if walls else 0.0)
            if cell["tool"] == "moelab" and not warm:
                expected *= 2  # the warm-up takes about as long
            if args.deadline_s and time.monotonic() - t0 + expected > args.deadline_s:
                print(f"bench: deadline: {cell['cell']} (round {r}) would end after {args.deadline_s:.0f} s; "
                      "stopping here; run the same command again to continue", flush=True)
                return False
            if cell["tool"] == "moelab" and not warm:
                warmup(args, round_cells, prompt, out / "logs" / "warmup.log")
                warm = True
            slug = cell["cell"].replace(" ", "_").replace("-", "")
            row = {"round": r, **measure(args, cell, prompt, out / "logs" / f"{slug}_r{r}.log")}
            with open(raw, "a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
            walls[cell["cell"]] = row["wall_s"]
            what = row.get("error") or (f"{row['prompt_tokens_per_s']:.1f} / {row['decode_tokens_per_s']:.1f} tokens/s")
            print(f"bench: [{len(done)}/{total}] round {r} {cell['cell']}: {what} ({row['wall_s']:.0f} s)", flush=True)
    return True


def warmup(args, round_cells: list[dict], prompt: str, log: Path) -> None:
    """Unrecorded moelab runs (``-n 4``, hybrid's options when hybrid is measured; again with
    ``--graph-cpu`` when a cell takes it) before this invocation's first moelab run: kernel
    compilation and caches are not charged to round 0."""
    for graph_cpu in sorted({c.get("graph_cpu", False) for c in round_cells if c["tool"] == "moelab"}):
        names = [c for c in round_cells if c["tool"] == "moelab" and c.get("graph_cpu", False) == graph_cpu]
        cell = next((c for c in names if c["policy"] == "hybrid"), names[0])
        path = log.with_name(f"{log.stem}_cpugraph{log.suffix}") if graph_cpu else log
        row = measure(argparse.Namespace(**{**vars(args), "tokens": 4}), cell, prompt, path)
        print(f"bench: warm-up {cell['cell']} -n 4: {row.get('error', 'done')} ({row['wall_s']:.0f} s, not recorded)",
              flush=True)


def read_rows(path: Path) -> list[dict]:
    """The rows of raw.jsonl; a line cut short by a kill is dropped (that run is made again)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
