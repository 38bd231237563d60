"""Predict the peer benchmark's moelab rows (``experiments/peer_llamacpp.py``'s ``result.json``).

The benchmark runs ``moelab run`` on a synthetic GGUF of the ``qwen3-30b-a3b`` preset's shape
(``moelab model synth``: Q8_0 experts, F16 dense matrices, ``num_blocks`` layers) at one expert budget per result, with the policies of its
config (``gpu``: every expert in VRAM; ``cpu``: every expert on the CPU pool), a prompt of
``prompt_tokens`` then ``decode_tokens`` generated. The prediction replays a synthetic trace of
the same geometry under the same policy and cache size (the row's own ``cache_mib``, else the
config's budget) on a hardware file: the routing the benchmark recorded (``trace``: its first
``gpu`` run's, every position of the prompt and the generation; greedy tokens route alike under
every policy), in the batches the run stepped them in (the trace's ``meta.batches``: the prompt
as ``moelab run``'s prefill chunks, then one token at a time), else decode tokens/s averaged over
``seeds`` synthetic traces (random weights do not route like a trained model: the measured hit
rates are then the check on the traces). Each row's policy is built as its command built it:
``hybrid`` without ``--hardware`` takes the fixed PCIe share (``--miss-fraction``, else
``MISS_FRAC_256`` / 256), not the cost model's; a ``POLICY+cpugraph`` row (``moelab run
--graph-cpu``) is simulated with the CPU graph (``simulate.run``'s ``graph_cpu``). The run reads its experts through the file's
memory map: where the hardware file measured it, the pool's calls take ``cpu_mapped_factor``
times their time on the calibration's anonymous buffers (``mapped_pool``). A row whose command gave
``--hardware F`` plans with F as the executor read it (``plan_hardware``: its tail under this
checkout, else the path), not with the file the prediction is timed on.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from scheduler import MISS_FRAC_256
from scheduler.hardware import Hardware, HardwareError, load_hardware
from scheduler.models import ModelSpec, load_model

from .run import SimConfig, SimError, load_tokens, run
from .speculative import merge_rows

__all__ = ["load_result", "peer_model", "predict_peer", "format_peer", "mapped_pool", "policy_of", "hardware_of",
           "plan_hardware"]


def load_result(path: Path) -> dict:
    """A peer benchmark's result.json; ValueError naming the file and field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable result.json ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key in ("config", "rows"):
        if key not in data:
            raise ValueError(f"{path}: missing field {key!r}")
    for key in ("num_blocks", "block_expert_bytes", "model_bytes", "budget_mib"):
        if key not in data["config"]:
            raise ValueError(f"{path}: config has no field {key!r}")
    return data


def peer_model(config: dict) -> ModelSpec:
    """The benchmark's model: ``qwen3-30b-a3b`` cut to ``num_blocks`` layers, Q8_0 experts and F16
    dense matrices (``moelab model synth``'s defaults), the vocabulary solved from the file size
    (embedding + output head are what is left)."""
    L = int(config["num_blocks"])
    m = replace(load_model("qwen3-30b-a3b"), num_layers=L, expert_quant="Q8_0", dense_quant="F16")
    expert = sum(int(b) for b in config["block_expert_bytes"])
    dense = sum(m.dense_bytes(l) for l in range(L))
    per_row = m.head_bytes() / m.vocab  # bytes per vocabulary row of one head
    vocab = int(round((int(config["model_bytes"]) - expert - dense) / (2 * per_row)))
    return replace(m, vocab=max(vocab, 1), name=f"peer/{L}L")


def _measured(rows: list[dict]) -> dict[str, dict]:
    """Per moelab cell: the median decode rate over its runs, its policy and cache MiB."""
    out: dict[str, dict] = {}
    for r in rows:
        cell = r.get("cell", "")
        if not cell.startswith("moelab "):
            continue
        policy, graph_cpu = policy_of(cell)
        e = out.setdefault(cell, {"policy": policy, "graph_cpu": graph_cpu, "decode": [], "cache_mib": None,
                                  "hit_rate": [], "miss_fraction": None})
        if e["policy"] == "hybrid" and e["miss_fraction"] is None:
            e["miss_fraction"] = miss_fraction_of(r.get("command") or [])
        if "plan_file" not in e:
            e["plan_file"] = hardware_of(r.get("command") or [])
        if r.get("decode_tokens_per_s"):
            e["decode"].append(float(r["decode_tokens_per_s"]))
            e["hit_rate"].append(float(r.get("hit_rate", 0.0)))
            e["cache_mib"] = r.get("cache_mib", e["cache_mib"])
            e["decode_tokens"] = int(r.get("decode_tokens", 63))
    return out


def policy_of(cell: str) -> tuple[str, bool]:
    """A moelab cell's policy, and whether its run took ``--graph-cpu`` (cells ``moelab POLICY`` and
    ``moelab POLICY+cpugraph``); ValueError naming the cell for another suffix."""
    name = cell.split(" ", 1)[1] if " " in cell else ""
    policy, plus, mode = name.partition("+")
    if not policy or (plus and mode != "cpugraph"):
        raise ValueError(f"result.json rows: cell {cell!r}, expected 'moelab POLICY' or 'moelab POLICY+cpugraph'")
    return policy, bool(plus)


def miss_fraction_of(command: list[str]) -> float | None:
    """``hybrid``'s fixed PCIe share as a ``moelab run`` command line sets it: ``--miss-fraction``,
    else ``MISS_FRAC_256`` / 256 without ``--hardware``; None (the cost model's share) with it."""
    args = [str(a) for a in command]
    for i, a in enumerate(args):
        if a == "--miss-fraction" and i + 1 < len(args):
            return float(args[i + 1])
        if a.startswith("--miss-fraction="):
            return float(a.split("=", 1)[1])
    if any(a == "--hardware" or a.startswith("--hardware=") for a in args):
        return None
    return MISS_FRAC_256 / 256


def hardware_of(command: list[str]) -> str | None:
    """The ``--hardware`` path of a ``moelab run`` command line (its cost model's file), else None."""
    args = [str(a) for a in command]
    for i, a in enumerate(args):
        if a == "--hardware" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--hardware="):
            return a.split("=", 1)[1]
    return None


def plan_hardware(path: str | None, root: Path = Path(".")) -> Path | None:
    """The file a row's policy planned with: the longest tail of ``path`` that exists under ``root``
    (a checkout's path on the benchmark's machine: ``/work/main/docs/x.json`` -> ``docs/x.json``,
    the recording's own copy even where another checkout has that path here), else ``path`` where
    it exists, else None (a file that is not kept, e.g. ``/tmp/cal.json``)."""
    if not path:
        return None
    p = Path(path)
    parts = p.parts[1:] if p.is_absolute() else p.parts
    for i in range(len(parts) - 1):  # a bare file name is not matched: too easily another file
        q = Path(root, *parts[i:])
        if q.is_file():
            return q
    return p if p.is_file() else None


def mapped_pool(hw: Hardware) -> Hardware:
    """``hw`` with its CPU pool as ``moelab run`` drives it on a GGUF file's memory map: every pool
    call ``executor.cpu_mapped_factor`` times as long (task and rates scaled); ``hw`` where the
    file has no such factor."""
    f = (hw.executor or {}).get("cpu_mapped_factor")
    if not f:
        return hw
    return replace(hw, cpu_task_s=hw.cpu_task_s * f, cpu_thread_gbps=hw.cpu_thread_gbps / f,
                   cpu_mem_gbps=hw.cpu_mem_gbps / f)


def batched_tokens(tokens, batches) -> list:
    """The trace's tokens grouped as the run stepped them (``batches``: rows per step, in order;
    a step of several rows becomes one token of that many, as ``simulate.speculative.merge_rows``
    builds it, in the phase of its first row); the rows past the batches one by one."""
    rows = list(tokens)
    out, i = [], 0
    for n in batches:
        n = int(n)
        if n < 1 or i + n > len(rows):
            raise ValueError(f"trace meta.batches: a batch of {n} rows at row {i} of {len(rows)}")
        out.append(replace(rows[i], index=len(out)) if n == 1
                   else replace(merge_rows(rows[i:i + n], len(out)), phase=rows[i].phase))
        i += n
    out.extend(replace(t, index=len(out) + j) for j, t in enumerate(rows[i:]))
    return out


def predict_peer(result: dict, hw: Hardware, seeds: int = 3, trace: Path | None = None,
                 graph_cpu_block_s: float | None = None, root: Path = Path("."),
                 upload_factor: float = 1.0, graph_cpu_pair_s: float = 0.0) -> list[dict]:
    """Per moelab row of ``result``: measured (median; None where every run failed) and predicted
    decode tokens/s, hit rates, and the relative error; ``trace``: the run's recorded routing
    (prompt and generation, replayed once), else ``seeds`` synthetic traces; ``graph_cpu_block_s``:
    a CPU graph's block time for the ``+cpugraph`` rows (None: the file's ``graph_block_s``), and
    ``graph_cpu_pair_s`` more a CPU pair (``simulate.engine.Simulator``'s). A row
    whose command gave ``--hardware`` plans (``hybrid-cost``'s cost model, ``hybrid``'s share) with
    that file as the executor read it (``plan_hardware`` under ``root``), else with ``hw``; each row
    says which (``plan_file``). ``upload_factor``: every host -> device copy of the run takes that many
    times the file's (``moelab run``'s copies out of the model file's map, against the calibration's
    pinned buffers; a ratio tuned on other sessions' rows, not measured), in the timing only."""
    if not 0 < upload_factor <= 4:
        raise ValueError(f"upload_factor: {upload_factor}, expected a ratio in (0, 4]")
    cfg = result["config"]
    model = peer_model(cfg)
    plain, hw = hw, mapped_pool(hw)
    if upload_factor != 1.0:
        hw = replace(hw, pcie_h2d_gbps=hw.pcie_h2d_gbps / upload_factor)
    plans: dict = {}
    out = []
    recorded = None
    if trace is not None:  # the recorded rows, stepped as the run stepped them
        try:
            recorded = load_tokens(SimConfig(model=model.name, trace=str(trace), phase="all"), model)
        except SimError as err:
            raise ValueError(str(err)) from None
        batches = (recorded.trace.meta or {}).get("batches")
        recorded = batched_tokens(recorded, batches) if batches else list(recorded)
    for cell, e in _measured(result["rows"]).items():
        mib = e["cache_mib"] if e["cache_mib"] is not None else float(cfg["budget_mib"])
        n = e.get("decode_tokens", int(cfg.get("tokens", 64)) - 1)
        tps, hits = [], []
        given = e.get("plan_file")
        found = plan_hardware(given, root)
        if found is not None and found not in plans:
            try:
                plans[found] = load_hardware(found)
            except HardwareError as err:
                raise ValueError(f"{cell}: --hardware {given} (read as {found}): {err}") from None
        plan_hw = plans[found] if found is not None else plain
        for seed in range(1 if trace is not None else seeds):
            sc = SimConfig(model=model.name, hardware=hw.name, policy=e["policy"], cache_mib=mib if e["policy"] != "cpu"
                           else 0.0, trace="synth" if trace is None else str(trace), synth_tokens=n, seed=seed,
                           phase="decode" if trace is None else "all", miss_fraction=e["miss_fraction"])
            try:
                s = run(sc, hardware=hw, model=model, tokens=recorded, graph_cpu=e["graph_cpu"],
                        graph_cpu_block_s=graph_cpu_block_s, policy_hardware=plan_hw,
                        graph_cpu_pair_s=graph_cpu_pair_s)[0].summary()
            except SimError as err:
                raise ValueError(f"{cell}: {err}") from None
            tps.append(s["tokens_per_s"])
            hits.append(s["hit_rate"])
        meas = float(np.median(e["decode"])) if e["decode"] else None
        pred = float(np.mean(tps))
        out.append({"row": cell, "policy": e["policy"], "cache_mib": mib, "measured_tokens_per_s": meas,
                    "predicted_tokens_per_s": pred, "error": None if meas is None else pred / meas - 1,
                    "measured_hit_rate": float(np.median(e["hit_rate"])) if e["hit_rate"] else None,
                    "predicted_hit_rate": float(np.mean(hits)),
                    "plan_file": None if given is None else (str(found) if found is not None else f"{given} (absent)")})
    return out


def format_peer(rows: list[dict], budget_mib: float) -> str:
    """The rows as a text table, then the count within 15%."""
    f = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"peer benchmark budget {budget_mib:g} MiB",
             f"{'row':<22}{'cache MiB':>10}{'measured':>10}{'predicted':>10}{'error':>8}{'hits m':>8}{'hits p':>8}"]
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"{r['row']:<22}{r['cache_mib']:10.1f}{f(r['measured_tokens_per_s'], '.1f'):>10}"
                     f"{r['predicted_tokens_per_s']:10.1f}{err:>8}{f(r['measured_hit_rate'], '.3f'):>8}"
                     f"{r['predicted_hit_rate']:8.3f}")
    got = [r for r in rows if r["error"] is not None]
    lines.append(f"rows within 15%: {sum(abs(r['error']) <= 0.15 for r in got)} of {len(got)} measured")
    return "\n".join(lines)
