"""The peer benchmark's results: medians over rounds per configuration, each moelab policy
compared with its llama.cpp peer (ratios moelab / llama.cpp), and the tables, plot and README."""
from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from .peer_runs import BUDGET_POLICIES, GRAPH_CPU

__all__ = ["medians", "comparisons", "best_of", "label", "tables", "plot", "readme", "SPEEDS"]


def medians(round_cells: list[dict], rows: list[dict]) -> dict:
    """Per cell: median prompt and decode tokens/s over its successful rounds, errors, extras."""
    out = {}
    for cell in round_cells:
        mine = [r for r in rows if r["cell"] == cell["cell"]]
        ok = [r for r in mine if "error" not in r]
        m = {"expert_bytes_vram": cell["expert_bytes_vram"], "runs": len(ok),
             "errors": [r["error"] for r in mine if "error" in r]}
        for k in ("prompt_tokens_per_s", "decode_tokens_per_s", "first_token_s", "prompt_tokens", "decode_tokens",
                  "cache_mib"):
            vals = [r[k] for r in ok if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if vals:
                m[k] = statistics.median(vals)
                if k.endswith("_per_s") and len(vals) > 1:
                    m[k.replace("tokens_per_s", "spread")] = (max(vals) - min(vals)) / m[k] if m[k] else 0.0
        if cell["tool"] == "moelab" and "cache_mib" in m and cell.get("policy") in BUDGET_POLICIES:
            m["expert_bytes_vram"] = int(m["cache_mib"] * 2**20)
        out[cell["cell"]] = m
    return out


SPEEDS = ("prompt_tokens_per_s", "decode_tokens_per_s")


def best_of(med: dict, names: list[str], key: str) -> tuple[float | None, str | None]:
    """The highest median ``key`` among the cells ``names``, and that cell."""
    vals = [(med[n][key], n) for n in names if key in med.get(n, {})]
    return max(vals) if vals else (None, None)


def comparisons(policies: list[str], med: dict, num_blocks: int, n_budget: int,
                graph_cpu: list[str] = ()) -> list[dict]:
    """Each moelab policy (and the best budget policy) against its llama.cpp peer: gpu vs -ncmoe 0,
    cpu vs -ncmoe all blocks, a budget policy vs the best -ncmoe N >= the budget's N (no more
    expert bytes in VRAM), prompt and decode each on its own; ratios moelab / llama.cpp. The
    ``graph_cpu`` policies' rows (``POLICY+cpugraph``) follow, with their own best at budget."""
    def llama(n):
        return f"llama.cpp -ncmoe {n}"

    peers = {"gpu": [llama(0)], "cpu": [llama(num_blocks)]}
    lower = [llama(n) for n in sorted({n_budget, num_blocks})]
    subjects = []
    for names, tag in ((policies, ""), (graph_cpu, GRAPH_CPU)):
        at_budget = [f"moelab {p}{tag}" for p in names if p in BUDGET_POLICIES]
        subjects += [(f"moelab {p}{tag}", [f"moelab {p}{tag}"]) for p in names]
        subjects += [(f"moelab best at budget{tag}", at_budget)] if at_budget else []
    rows = []
    for label, mine in subjects:
        theirs = peers.get(label.removeprefix("moelab ").removesuffix(GRAPH_CPU), lower)
        row = {"moelab": label, "peer": theirs[0].removeprefix("llama.cpp ") if len(theirs) == 1 else
               "best of " + ", ".join(n.removeprefix("llama.cpp ") for n in theirs),
               "expert_bytes_vram": max(med.get(c, {}).get("expert_bytes_vram", 0) for c in mine),
               "peer_expert_bytes_vram": max(med.get(c, {}).get("expert_bytes_vram", 0) for c in theirs),
               "first_token_s": med.get(mine[0], {}).get("first_token_s") if len(mine) == 1 else None,
               "moelab_cells": {}, "peer_cells": {}}
        for key in SPEEDS:
            (me, my_cell), (peer, peer_cell) = best_of(med, mine, key), best_of(med, theirs, key)
            row[key], row[f"peer_{key}"] = me, peer
            row["moelab_cells"][key], row["peer_cells"][key] = my_cell, peer_cell
            row[f"ratio_{key.split('_')[0]}"] = me / peer if me and peer else None
        rows.append(row)
    return rows


def label(row: dict) -> str:
    """The table's name of a comparison row (the best-at-budget row says which policy won)."""
    name = row["moelab"].removeprefix("moelab ")
    if name.removesuffix(GRAPH_CPU) != "best at budget":
        return name
    won = [(c or "-").removeprefix("moelab ").removesuffix(GRAPH_CPU) for c in row["moelab_cells"].values()]
    return f"{name} ({won[0]} / {won[1]})"


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def tables(med: dict, comp: list[dict], round_cells: list[dict]) -> str:
    """The llama.cpp table (one row per -ncmoe) and the moelab table (each policy vs its peer)."""
    lines = ["| llama.cpp | expert MiB in VRAM | pp tokens/s | tg tokens/s | runs | errors |",
             "|---|---:|---:|---:|---:|---|"]
    for c in (c for c in round_cells if c["tool"] == "llama.cpp"):
        m = med[c["cell"]]
        lines.append(f"| -ncmoe {c['ncmoe']} | {m['expert_bytes_vram'] / 2**20:,.0f} | "
                     f"{fmt(m.get('prompt_tokens_per_s'))} | {fmt(m.get('decode_tokens_per_s'))} | {m['runs']} | "
                     f"{'; '.join(m['errors'])} |")
    lines += ["", "| moelab | expert MiB in VRAM | prompt tokens/s | decode tokens/s | first token s | "
              "llama.cpp peer | peer pp / tg | moelab / llama.cpp prompt | decode |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in comp:
        lines.append(f"| {label(r)} | {r['expert_bytes_vram'] / 2**20:,.0f} | {fmt(r['prompt_tokens_per_s'])} | "
                     f"{fmt(r['decode_tokens_per_s'])} | {fmt(r['first_token_s'], '.3f')} | {r['peer']} | "
                     f"{fmt(r['peer_prompt_tokens_per_s'])} / {fmt(r['peer_decode_tokens_per_s'])} | "
                     f"{fmt(r['ratio_prompt'], '.3f')} | {fmt(r['ratio_decode'], '.3f')} |")
    errs = [f"- {name}: {'; '.join(m['errors'])}" for name, m in med.items()
            if m["errors"] and name.startswith("moelab")]
    return "\n".join(lines + (["", "moelab errors:", *errs] if errs else [])) + "\n"


def plot(comp: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [r["moelab"].removeprefix("moelab ") for r in comp]
    x = range(len(comp))
    for ax, key, title in ((axes[0], "prompt_tokens_per_s", "prompt (pp) tokens/s"),
                           (axes[1], "decode_tokens_per_s", "decode (tg) tokens/s")):
        theirs, mine = [r[f"peer_{key}"] or 0 for r in comp], [r[key] or 0 for r in comp]
        for dx, vals, name in ((-0.2, theirs, "llama.cpp (peer)"), (0.2, mine, "moelab")):
            bars = ax.bar([i + dx for i in x], vals, 0.4, label=name)
            ax.bar_label(bars, [f"{v:.3g}" if v else "-" for v in vals], fontsize=7)
        ax.set_xticks(list(x), labels, rotation=20)
        ax.set_yscale("log")
        ax.set_ylim(bottom=min([v for v in theirs + mine if v] or [1]) / 3)  # every bar starts below the smallest
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme(args, config: dict, rows: list[dict], table: str, complete: bool) -> str:
    cmd = "python experiments/peer_llamacpp.py " + shlex.join(args.argv)
    src = config["llama_source"] or {}
    builds = sorted({r["build_commit"] for r in rows if r.get("build_commit")})
    env = "".join(f" `{k}={v}`" for k, v in config.get("moelab_env", {}).items())
    env = f" with{env}" if env else ""
    return (f"# moelab vs llama.cpp (generated by experiments/peer_llamacpp.py)\n\n"
            f"{'' if complete else '**Incomplete: some runs are missing; run the command again.**' + chr(10) + chr(10)}"
            f"Model `{config['model']}` ({config['model_bytes'] / 2**30:.2f} GiB, {config['num_blocks']} blocks, "
            f"{sum(config['block_expert_bytes']) / 2**30:.2f} GiB of experts); llama.cpp from "
            f"{src.get('sdist', 'an unknown source')} (build {', '.join(builds) or '?'}), moelab at "
            f"{config['moelab_commit'] or '?'}; budget {config['budget_mib']} MiB = `-ncmoe "
            f"{config['ncmoe_budget']}`; prompt {config['prompt_tokens_moelab']} tokens for moelab "
            f"(pp{config['prompt_tokens_llama']} for llama-bench), {config['tokens']} generated; "
            f"llama-bench `-t {config['llama_threads']} -r {config['repetitions']}`, moelab `--threads "
            f"{config['threads']}`{env}; medians of {config['rounds']} interleaved rounds. "
            f"Ratios: moelab / llama.cpp.\n\n"
            f"{table}\n![result](result.png)\n\n```\n{cmd}\n```\n")
