"""The seeds' published decode rows as simulator runs: the data file, the engines, the fits.

A data file (``experiments/seed_tables.json``) holds tables of published decode rates; each row
names a configuration (``ROWS``) and, where it was used to fit a hardware parameter, that
parameter (``fits``). A row is replayed on synthetic traces of the model's geometry under the
policy and engine of its configuration:

- ``full``: every expert on the GPU, one captured graph per token (llama.cpp, policy ``gpu``);
- ``cpu``: ``--cpu-moe``, every expert on the CPU: llama.cpp splits each layer's graph at the
  experts (``split_sync_s`` per layer);
- ``lru``: upstream's cache, one LRU shared by every MoE layer, every miss uploaded before the
  layer's experts run; the host reads the route at every layer (a split, ``split_sync_s``). The
  published runs process their 63-token prompt as one batch, and upstream's cache serves batches
  of more than 32 tokens read-only: the prompt streams the experts it routes to without keeping
  them, so the cache starts empty at the first generated token;
- ``hybrid`` / ``hybrid-slow-fill``: the pull request's hybrid with adaptive fill: hits on the
  GPU, every miss on the CPU, the two meeting through the device mailbox (``mailbox_s`` each way,
  no host synchronisation); the cache (upstream's one budget, shared by the layers) starts empty
  before the faster fill; with it (``PROMPT_FILL`` fills per token) the experts the prompt routed
  to are uploaded after the prompt, most routed first while slots are free, before the first
  generated token (the seed: the hybrid "uploads the experts after the prompt", about 2 s on
  Qwen3-Coder-Next; ``prompt_fill``). Then the experts that missed are uploaded right after the
  token that missed them (at most 512, or 16 before the faster fill, while slots are free),
  before the next token runs; the periodic swap rounds run beside generation ("misses do not
  wait for PCIe uploads"): a swapped-in expert is resident a token after the next
  (``SWAP_LAG_TOKENS``) and holds no token (``Simulator(swaps="stream")``).

Routing: ``traces.synth`` with the data file's ``routing`` parameters, chosen on its published
routing statistics (``routing_stats``, none of them a table row) by ``fit_routing``; the prompt
and the generation are two sequences of one trace (one per-layer popularity, a topic each).

Every upload is a pageable copy (both builds upload from the host buffers the CPU computes from)
of three tensors (``EXPERT_TENSORS``), each paying ``copy_latency_s``.
A table with ``file_gib`` (a file whose experts mix quant types) charges each expert its share of
the file's bytes (``model_of``). A ``stated`` entry sets a machine's pageable rate from the seed's
stated prompt-time load of upstream's cache: the bytes of the distinct experts the prompt's batch
routes to (each streamed once; ``prompt_load``) over the stated seconds less those uploads' fixed
costs. The fitted parameters are solved jointly, each row's simulated rate meeting its published
one (Newton's method in log values, ``_solve_joint``: a row may depend on its machine's other
fitted parameters more than on its own); a parameter in the file's ``shared`` list is fitted on
one machine and used on every machine.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from scheduler import AwaitBackground, Capacity, StartBackground, drive, make_policy
from scheduler.core import Move, Step, Token
from scheduler.profile import Profile
from scheduler.costs import Costs, ExecConfig
from scheduler.hardware import Hardware, load_hardware
from scheduler.models import ModelSpec, load_model, quant_bytes

from traces.synth import SynthParams

from .engine import Simulator

__all__ = ["ROWS", "FIT_PARAMS", "FIT_ORDER", "PROMPT_TOKENS", "load_data", "model_of", "simulate_row",
           "derive_hosts", "fix_params", "predict_tables", "bounds", "warmups", "TOLERANCE", "routing_of", "fit_routing", "ROUTING_GRID"]

# configuration -> (label, policy, engine, fills per token (hybrid) or None)
ROWS = {
    "full": ("all on the GPU (-fit)", "gpu", "llama.cpp", None),
    "cpu": ("--cpu-moe", "cpu", "llama.cpp", None),
    "lru": ("cache (upstream LRU)", "lru", "llama.cpp", None),
    "hybrid": ("hybrid + adaptive", "hybrid", "mailbox", 512),
    "hybrid-slow-fill": ("hybrid + adaptive, 16 fills/token", "hybrid", "mailbox", 16),
}
# parameter -> (lower bound, upper bound) of its fit
FIT_PARAMS = {
    "graph_kernel_s": (1e-8, 1e-3),
    "split_sync_s": (1e-7, 5e-3),
    "mailbox_s": (1e-7, 1e-3),
    "pageable_gbps": (0.2, 100.0),
    "cpu_thread_gbps": (0.05, 100.0),
}
FIT_ORDER = tuple(FIT_PARAMS)
PROMPT_TOKENS = 63  # the published runs' prompt
PROMPT_FILL = 512  # fills per token from which the hybrid uploads the prompt's experts after it (the faster fill)
SWAP_LAG_TOKENS = 1  # the hybrid's background moves become resident a token after the next (drive's lag): its swap
# rounds run beside generation; the simulator still holds the next token for the fills (Simulator swaps="stream")
EXPERT_TENSORS = 3  # a GGUF MoE layer's expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps): copies per upload
TOLERANCE = 0.15


def load_data(path: Path) -> dict:
    """The published figures; a malformed file is a ValueError naming the field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    for key in ("source", "machines", "tables", "rows_measured", "shared", "left_out"):
        if key not in data:
            raise ValueError(f"{path}: missing field {key!r}")
    for p in data["shared"]:
        if p not in FIT_PARAMS:
            raise ValueError(f"{path}: shared: {p!r}, expected some of {', '.join(FIT_PARAMS)}")
    for i, c in enumerate(data.get("routing_stats", [])):
        ok = isinstance(c, dict) and c.get("what") in ("touched", "hit_rate") and c.get("about") and c.get("source")
        ok = ok and isinstance(c.get("tokens"), int) and c["tokens"] > PROMPT_TOKENS and 0 < c.get("published", -1) <= 1
        if ok and c["what"] == "hit_rate":
            ok = c.get("row") in ROWS and isinstance(c.get("cache_mib"), (int, float)) and "quant" in c
        if not ok:
            raise ValueError(f"{path}: routing_stats[{i}]: expected what (touched or hit_rate), about, source, model, "
                             f"tokens > {PROMPT_TOKENS}, published in (0, 1], and for hit_rate row, quant, cache_mib")
    r = data.get("routing", {})
    if not isinstance(r, dict) or not r.get("source"):
        raise ValueError(f"{path}: routing: expected an object of traces.synth.SynthParams fields with a source")
    unknown = sorted(set(r) - {f.name for f in dataclasses.fields(SynthParams)} - {"source"})
    if unknown:
        raise ValueError(f"{path}: routing: unknown field(s) {unknown}, expected traces.synth.SynthParams fields")
    try:
        routing_of(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: routing: {e}") from None
    fitted: dict = {}
    for i, st in enumerate(data.get("stated", [])):
        where = f"{path}: stated[{i}]"
        if not isinstance(st, dict) or st.get("param") != "pageable_gbps":
            raise ValueError(f"{where}.param: expected 'pageable_gbps' (from the prompt's load time)")
        if st.get("machine") not in data["machines"]:
            raise ValueError(f"{where}.machine: {st.get('machine')!r} is not in 'machines'")
        lo_hi = st.get("prompt_load_s")
        if (not isinstance(lo_hi, list) or len(lo_hi) != 2 or not all(isinstance(x, (int, float)) and x > 0 for x in lo_hi)
                or isinstance(st.get("cache_mib"), bool) or not isinstance(st.get("cache_mib"), (int, float))
                or not st.get("source")):
            raise ValueError(f"{where}: expected prompt_load_s [low, high] seconds > 0, cache_mib and source")
        fitted[("pageable_gbps", st["machine"])] = f"stated[{i}]"
    for i, t in enumerate(data["tables"]):
        for key in ("machine", "model", "quant", "cache_mib", "tokens", "rows", "note"):
            if key not in t:
                raise ValueError(f"{path}: tables[{i}] has no field {key!r}")
        if t["machine"] not in data["machines"]:
            raise ValueError(f"{path}: tables[{i}].machine {t['machine']!r} is not in 'machines'")
        if not isinstance(t["tokens"], int) or t["tokens"] < 1:
            raise ValueError(f"{path}: tables[{i}].tokens: {t['tokens']!r}, expected an integer >= 1")
        g = t.get("file_gib")
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not g > 0):
            raise ValueError(f"{path}: tables[{i}].file_gib: {g!r}, expected the model file's GiB > 0 or absent")
        seen = set()
        for j, r in enumerate(t["rows"]):
            where = f"{path}: tables[{i}].rows[{j}]"
            if not isinstance(r, dict) or r.get("row") not in ROWS:
                raise ValueError(f"{where}.row: expected one of {', '.join(ROWS)}")
            if r["row"] in seen:
                raise ValueError(f"{where}.row: {r['row']!r} twice in one table")
            seen.add(r["row"])
            v = r.get("tps")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{where}.tps: {v!r}, expected tokens/s > 0")
            f = r.get("fits")
            if f is not None:
                if f not in FIT_PARAMS:
                    raise ValueError(f"{where}.fits: {f!r}, expected null or one of {', '.join(FIT_PARAMS)}")
                key = f if f in data["shared"] else (f, t["machine"])
                if key in fitted:
                    raise ValueError(f"{where}.fits: {f} is already fitted by {fitted[key]}")
                fitted[key] = f"tables[{i}].rows[{j}]"
    for i, st in enumerate(data.get("stated", [])):
        if not any(t["machine"] == st["machine"] and t["cache_mib"] == st["cache_mib"]
                   and any(r["row"] == "lru" for r in t["rows"]) for t in data["tables"]):
            raise ValueError(f"{path}: stated[{i}].cache_mib: no {st['machine']} table with an lru row and that cache")
    for i, c in enumerate(data.get("routing_stats", [])):
        try:
            model_of(data, c.get("model", ""), c.get("quant", "Q8_0"))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: routing_stats[{i}].model: {e}") from None
    return data


def model_of(data: dict, name: str, quant: str, file_gib: float | None = None) -> ModelSpec:
    """The model with ``quant`` experts; given the file's size (a mixed-type file), each expert's
    bytes are the file's bytes less the non-expert weights (at the dense type), shared evenly."""
    spec = data.get("models", {}).get(name)
    m = ModelSpec(name=name, **{k: v for k, v in spec.items() if k != "source"}) if spec else load_model(name)
    m = m.with_quant(quant)
    if file_gib is None:
        return m
    moe = [l for l in range(m.num_layers) if m.is_moe(l)]
    other = sum(m.dense_bytes(l) for l in range(m.num_layers)) + 2 * m.head_bytes()  # embeddings and head
    per = int((file_gib * 2**30 - other) / (len(moe) * m.num_experts))
    if per <= 0:
        raise ValueError(f"{name}: file_gib {file_gib} leaves no bytes for the experts")
    return dataclasses.replace(m, layer_expert_bytes=tuple(per if m.is_moe(l) else 0 for l in range(m.num_layers)))


def routing_of(data: dict) -> SynthParams:
    """The synthetic routing's parameters: the data file's ``routing`` (``traces.synth`` defaults
    for the fields it leaves out)."""
    return SynthParams(**{k: v for k, v in data.get("routing", {}).items() if k != "source"})


def _shape(model: ModelSpec) -> tuple:
    """What a synthetic trace of ``model`` depends on: layers, MoE layers, experts, top-k (not the
    quant type: models of one geometry share their traces)."""
    return model.num_layers, tuple(model.geometry().moe_layers), model.num_experts, model.top_k


def _routes(model: ModelSpec, num_tokens: int, seed: int, params: SynthParams = SynthParams()) -> np.ndarray:
    """(prompt + tokens, layers, top_k) expert ids of a synthetic trace of ``model``'s geometry: the
    prompt and the generation are two sequences of one trace (same per-layer popularity, a topic
    each: a prompt is not the text it asks for), the prompt's first ``PROMPT_TOKENS`` rows then the
    generation's first ``num_tokens``. Shared between calls: read only."""
    return _shape_routes(_shape(model), num_tokens, seed, params)


@lru_cache(maxsize=32)
def _shape_routes(shape: tuple, num_tokens: int, seed: int, params: SynthParams) -> np.ndarray:
    from traces import synth

    num_layers, moe, num_experts, top_k = shape
    n = max(PROMPT_TOKENS, num_tokens)
    t = synth.generate(len(moe), num_experts, top_k, 2 * n, params, np.random.default_rng(seed), num_seqs=2)
    e = np.concatenate([t.expert_ids[:PROMPT_TOKENS], t.expert_ids[n:n + num_tokens]])
    ids = np.full((len(e), num_layers, top_k), -1, dtype=np.int32)
    ids[:, list(moe)] = e
    ids.flags.writeable = False
    return ids


@lru_cache(maxsize=32)
def _shape_tokens(shape: tuple, num_tokens: int, seed: int, params: SynthParams) -> tuple[Token, ...]:
    """The generated tokens of ``_shape_routes``: rows from ``PROMPT_TOKENS`` on, one token each
    (immutable, so every policy replays the same objects)."""
    ids, moe = _shape_routes(shape, num_tokens, seed, params), shape[1]
    rows = ids.tolist()
    out = []
    for n in range(PROMPT_TOKENS, len(rows)):
        r = rows[n]
        out.append(Token(n - PROMPT_TOKENS, 0, n, "decode", tuple(Step(l, tuple(r[l])) for l in moe)))
    return tuple(out)


@lru_cache(maxsize=64)
def _items(model: ModelSpec, row: str, cache_mib: float, num_tokens: int, seed: int,
           params: SynthParams = SynthParams()) -> tuple[tuple, float]:
    """The driver's work items of one row on one trace (they do not depend on the hardware) and
    the generated tokens' hit rate."""
    _, policy, _, fills = ROWS[row]
    g = model.geometry()
    cap = Capacity.from_mib(g, cache_mib)
    opts: dict = {}
    if row == "full":
        cap = Capacity.per_layer(g, g.max_experts)
    else:  # upstream's cache is one pool shared by every MoE layer (all have the same layout); the pull
        # request's hybrid keeps that one budget (its fills take the pool's free slots)
        cap = Capacity.shared(g, [g.moe_layers], [cap.pools[0][1] * len(g.moe_layers)])
        if fills is not None:
            opts = {"adaptive": True, "miss_fraction": 0.0, "max_fills": fills, "swap_while_filling": fills >= 512}
    ids = _routes(model, num_tokens, seed, params)
    tokens = _shape_tokens(_shape(model), num_tokens, seed, params)  # every cache starts empty (the module docstring)
    profile = prompt_fill(ids, g) if fills is not None and fills >= PROMPT_FILL else None
    pol = make_policy(policy, g, cap, profile=profile, **opts)
    # the prompt's experts (the profile's residents), uploaded before the first generated token
    moves = tuple(Move(l, e, pol.cache.slot[l, e]) for l, e in pol.residents()) if profile is not None else ()
    items = tuple(drive(pol, tokens, lag_tokens=SWAP_LAG_TOKENS if fills is not None else 0))
    if moves:
        items = (StartBackground(tokens[0], moves), AwaitBackground(moves)) + items
    hits = total = 0
    for it in items:
        d = getattr(it, "decision", None)
        if d is not None and it.token.phase == "decode":
            hits += len(d.hits)
            total += len(d.step.experts)
    return items, hits / max(total, 1)


def prompt_fill(ids: np.ndarray, g) -> Profile:
    """The faster fill's start (the seed: the hybrid "uploads the experts after the prompt"): the
    experts the prompt routed to, most routed first, as the profile the cache starts from (its free
    slots take them in that order); ``_items`` charges their uploads before the first token."""
    counts = np.zeros((g.num_layers, g.max_experts))
    for l in g.moe_layers:
        np.add.at(counts[l], ids[:PROMPT_TOKENS, l].ravel(), 1)
    return Profile.from_counts(counts)


def simulate_row(hw: Hardware, model: ModelSpec, table: dict, row: str, seeds: int, scale: float,
                 routing: SynthParams = SynthParams()) -> dict:
    """Mean decode tokens/s and hit rate of one row over ``seeds`` synthetic traces (``routing``)."""
    _, policy, engine, _ = ROWS[row]
    n_tok = max(8, int(round(table["tokens"] * scale)))
    if model.layer_expert_bytes:  # a mixed-type file: the CPU's i-quant kernels take about the same time per
        # weight across types (the presets' efficiencies say so), so its experts cost the nominal type's CPU time
        q, l = model.expert_quant, list(model.geometry().moe_layers)[0]
        ratio = model.expert_bytes(l) / quant_bytes(q, model.expert_params)
        eff = dict(hw.cpu_quant_efficiency)
        hw = dataclasses.replace(hw, cpu_quant_efficiency={**eff, q: eff.get(q, 1.0) * ratio})
    # uploads are pageable; rows without uploads copy only activations, through pinned buffers
    costs = Costs(model, hw, ExecConfig(pinned=row in ("full", "cpu"), policy=policy, engine=engine))
    # llama.cpp holds a layer's experts in three tensors (gate, up, down): an expert's upload is three
    # copies, each paying the copy's fixed cost (Costs charges one per expert)
    costs.upload_s = [u + (EXPERT_TENSORS - 1) * hw.copy_latency_s for u in costs.upload_s]
    # the pull request's swap rounds run beside generation (its runtime's: a swapped-in expert is resident once
    # its copy lands; "misses do not wait for PCIe uploads"); its fills, right after the token that missed, hold the next
    sim = Simulator(costs, swaps="stream" if ROWS[row][3] is not None else "await")
    tps, hits = [], []
    for seed in range(seeds):
        items, hit = _items(model, row, float(table["cache_mib"]), n_tok, seed, routing)
        res = sim.run(iter(items), _UNCOUNTED)  # the hit rate is _items': the replay needs no audit
        t = res.token_s[res.decode] if res.decode.any() else res.token_s
        tps.append(len(t) / float(t.sum()))
        hits.append(hit)
    return {"tps": float(np.mean(tps)), "hit_rate": float(np.mean(hits))}


class _Uncounted:
    """An audit that counts nothing (``Simulator.run`` observes every item; ``_items`` has
    already counted the hits of these replays)."""

    @staticmethod
    def observe(item) -> None:
        pass


_UNCOUNTED = _Uncounted()


def _solve_joint(rate, targets: list[float], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 depends: np.ndarray, tol: float = 2e-4, iterations: int = 16) -> np.ndarray:
    """Parameters (log values ``x``, within [``lo``, ``hi``]) at which ``rate(x, i)`` meets every
    ``targets[i]``: Newton's method on log(rate / target) with a forward-difference Jacobian,
    entry (i, j) only where ``depends[i, j]`` (row i's machine holds parameter j), steps at most
    a factor e per parameter; after the first step the Jacobian follows Broyden's update (each
    recomputation costs a simulation per dependent pair), recomputed only after a step that made
    the largest error grow."""
    x = x0.copy()
    n = len(targets)
    f = lambda x, i: math.log(rate(x, i) / targets[i])
    J, last, prev = None, math.inf, None
    for _ in range(iterations):
        F = np.array([f(x, i) for i in range(n)])
        size = float(np.max(np.abs(F)))
        if size < tol:
            break
        if J is None or size > last:  # a step that made things worse: a fresh Jacobian
            J = np.zeros((n, n))
            for j in range(n):
                xj = x.copy()
                xj[j] += 0.02
                for i in range(n):
                    if depends[i, j]:
                        J[i, j] = (f(xj, i) - F[i]) / 0.02
        elif prev is not None:  # Broyden's update from the last step, on the entries that can be non-zero
            step, change = x - prev[0], F - prev[1]
            if step @ step > 0:
                J = np.where(depends, J + np.outer(change - J @ step, step) / (step @ step), 0.0)
        last, prev = size, (x.copy(), F)
        dx = np.linalg.lstsq(J, -F, rcond=None)[0]
        x = np.clip(x + np.clip(dx, -1.0, 1.0), lo, hi)
    return x


def _fit_rows(data: dict) -> list[tuple[str, dict, dict]]:
    """(parameter, table, row) of every fitting row, in ``FIT_ORDER``."""
    rows = [(r["fits"], t, r) for t in data["tables"] for r in t["rows"] if r.get("fits")]
    return sorted(rows, key=lambda x: FIT_ORDER.index(x[0]))


def prompt_load(data: dict, machine: str, cache_mib: float, seeds: int, scale: float) -> tuple[float, float]:
    """Mean bytes and count of the distinct (layer, expert) pairs the prompt routes to (its batch
    streams each once) in ``machine``'s tables with an ``lru`` row and ``cache_mib`` (the same
    synthetic traces as the rows)."""
    out, count = [], []
    for t in data["tables"]:
        if t["machine"] != machine or t["cache_mib"] != cache_mib or not any(r["row"] == "lru" for r in t["rows"]):
            continue
        model = model_of(data, t["model"], t["quant"], t.get("file_gib"))
        n_tok = max(8, int(round(t["tokens"] * scale)))
        for seed in range(seeds):
            ids = _routes(model, n_tok, seed, routing_of(data))[:PROMPT_TOKENS]
            ups = [(l, len(np.unique(ids[:, l]))) for l in model.geometry().moe_layers]
            out.append(sum(model.expert_bytes(l) * n for l, n in ups))
            count.append(sum(n for _, n in ups))
    if not out:
        raise ValueError(f"stated: no {machine} table with an lru row and a {cache_mib} MiB cache")
    return float(np.mean(out)), float(np.mean(count))


def fix_params(data: dict, fixed: dict[str, float]) -> dict:
    """``data`` with each parameter of ``fixed`` given, not fitted, on every machine: the rows that
    fitted it become predicted rows (their ``fits`` cleared) and ``derive_hosts`` sets the values
    (kept under ``"fixed"``). ValueError naming a parameter that is not fittable or out of its bounds."""
    for p, v in fixed.items():
        if p not in FIT_PARAMS:
            raise ValueError(f"--fixed {p}: expected one of {', '.join(FIT_PARAMS)}")
        lo, hi = FIT_PARAMS[p]
        if not lo <= v <= hi:
            raise ValueError(f"--fixed {p}={v}: expected a value in [{lo}, {hi}]")
    tables = [{**t, "rows": [{**r, "fits": None} if r.get("fits") in fixed else r for r in t["rows"]]}
              for t in data["tables"]]
    return {**data, "tables": tables, "fixed": {**data.get("fixed", {}), **fixed}}


def derive_hosts(data: dict, seeds: int, scale: float, presets: dict | None = None) -> dict[str, Hardware]:
    """Each machine's preset (or ``presets[name]``) with the given parameters (``fix_params``), the
    stated ones (``stated``: the pageable rate = the bytes the prompt loads into upstream's cache /
    the seed's stated load time) and the fitted ones solved from their rows; ``shared`` parameters
    are copied to every machine."""
    hosts = {m: (presets or {}).get(m) or load_hardware(m) for m in data["machines"]}
    hosts = {m: dataclasses.replace(h, **data.get("fixed", {})) for m, h in hosts.items()}
    for st in data.get("stated", []):
        secs = float(np.mean(st["prompt_load_s"]))
        loaded, experts = prompt_load(data, st["machine"], st["cache_mib"], seeds, scale)
        fixed = experts * EXPERT_TENSORS * hosts[st["machine"]].copy_latency_s  # each copy's fixed cost
        if fixed >= secs:
            raise ValueError(f"stated: {experts:.0f} expert uploads' fixed costs leave no time of {secs} s for their bytes")
        rate = loaded / (secs - fixed) / 1e9
        hosts[st["machine"]] = dataclasses.replace(hosts[st["machine"]], pageable_gbps=float(f"{rate:.3g}"))
    routing = routing_of(data)
    fits = _fit_rows(data)
    if not fits:
        return hosts
    # one unknown per fitting row: its parameter on its machine, or on every machine when shared
    owners = [data["machines"] if p in data["shared"] else [t["machine"]] for p, t, _ in fits]
    models = [model_of(data, t["model"], t["quant"], t.get("file_gib")) for _, t, _ in fits]
    depends = np.array([[t["machine"] in owners[j] for j in range(len(fits))] for _, t, _ in fits])

    def at(x) -> dict[str, Hardware]:
        out = dict(hosts)
        for (p, _, _), names, v in zip(fits, owners, x):
            for name in names:
                out[name] = dataclasses.replace(out[name], **{p: float(math.exp(v))})
        return out

    def rate(x, i: int) -> float:
        p, t, r = fits[i]
        return simulate_row(at(x)[t["machine"]], models[i], t, r["row"], seeds, scale, routing)["tps"]

    x0 = np.array([math.log(getattr(hosts[t["machine"]], p)) for p, t, _ in fits])
    lo = np.log([FIT_PARAMS[p][0] for p, _, _ in fits])
    hi = np.log([FIT_PARAMS[p][1] for p, _, _ in fits])
    x = _solve_joint(rate, [r["tps"] for _, _, r in fits], x0, lo, hi, depends)
    hosts = at(np.log([float(f"{math.exp(v):.3g}") for v in x]))
    return hosts


def predict_tables(data: dict, hosts: dict[str, Hardware], seeds: int, scale: float) -> list[dict]:
    """Per table: each row's published and predicted rate, error and hit rate, and the
    hybrid-over-cache speedup published and predicted (None where the table lacks either)."""
    out = []
    for t in data["tables"]:
        model = model_of(data, t["model"], t["quant"], t.get("file_gib"))
        rows = []
        for r in t["rows"]:
            p = simulate_row(hosts[t["machine"]], model, t, r["row"], seeds, scale, routing_of(data))
            rows.append({"row": r["row"], "label": ROWS[r["row"]][0], "published": r["tps"], "predicted": p["tps"],
                         "error": p["tps"] / r["tps"] - 1, "hit_rate": p["hit_rate"], "fits": r.get("fits")})
        by = {x["row"]: x for x in rows}
        h = "hybrid" if "hybrid" in by else "hybrid-slow-fill" if "hybrid-slow-fill" in by else None
        speedup = None
        if h and "lru" in by:
            pub = by[h]["published"] / by["lru"]["published"]
            pred = by[h]["predicted"] / by["lru"]["predicted"]
            speedup = {"row": h, "published": pub, "predicted": pred, "error": pred / pub - 1,
                       "sign_right": (pub > 1) == (pred > 1), "fitted": bool(by[h]["fits"] and by["lru"]["fits"])}
        out.append({"table": t, "rows": rows, "speedup": speedup,
                    "simulated_tokens": max(8, int(round(t["tokens"] * scale)))})
    return out


def bounds(data: dict, hosts: dict[str, Hardware], seeds: int, scale: float, results: list[dict]) -> list[dict]:
    """Per table (in ``results``' order), two rates the model's costs put around its hybrid rows:
    ``free``, each hybrid row with every upload free (no link time, no copy latency: the most the
    hybrid can reach on this CPU rate and routing), and ``cpu``, ``--cpu-moe`` on the table's file
    (every expert on the CPU: what a hybrid that hits nothing falls back to; the table's own
    prediction where it has that row)."""
    out = []
    for res in results:
        t = res["table"]
        model = model_of(data, t["model"], t["quant"], t.get("file_gib"))
        hw = hosts[t["machine"]]
        free_hw = dataclasses.replace(hw, pageable_gbps=1e4, pcie_h2d_gbps=1e4, copy_latency_s=0.0)
        free = {r["row"]: simulate_row(free_hw, model, t, r["row"], seeds, scale, routing_of(data))["tps"]
                for r in t["rows"] if ROWS[r["row"]][3] is not None}
        own = {r["row"]: r["predicted"] for r in res["rows"]}
        cpu = own["cpu"] if "cpu" in own else simulate_row(hw, model, t, "cpu", seeds, scale, routing_of(data))["tps"]
        out.append({"free": free, "cpu": cpu})
    return out


def routing_checks(data: dict, seeds: int, routing: SynthParams | None = None) -> list[dict]:
    """The synthetic routing against the published routing statistics of ``routing_stats``: the
    share of (layer, expert) pairs touched within ``tokens`` tokens (``touched``), or a row's
    hit rate over ``tokens`` generated tokens with a ``cache_mib`` cache (``hit_rate``); under
    ``routing`` (default: the data file's)."""
    routing = routing_of(data) if routing is None else routing
    out = []
    for c in data.get("routing_stats", []):
        model = model_of(data, c["model"], c.get("quant", "Q8_0"))
        vals = []
        for seed in range(seeds):
            if c["what"] == "touched":
                ids = _routes(model, c["tokens"] - PROMPT_TOKENS, seed, routing)[: c["tokens"]]
                moe = list(model.geometry().moe_layers)
                vals.append(sum(len(np.unique(ids[:, l])) for l in moe) / (len(moe) * model.num_experts))
            else:
                vals.append(_items(model, c["row"], float(c["cache_mib"]), c["tokens"], seed, routing)[1])
        out.append({**c, "simulated": float(np.mean(vals))})
    return out


# the grid ``fit_routing`` searches by default (``--fit-routing``): popularity skew x topic width
ROUTING_GRID = {"zipf_s": (0.4, 0.5, 0.6, 0.7, 0.8), "topic_concentration": (0.2, 0.3, 0.4, 0.6, 1.0)}


def fit_routing(data: dict, seeds: int, grid: dict = ROUTING_GRID) -> list[dict]:
    """Every point of ``grid`` (``SynthParams`` field -> values; the data file's ``routing`` for the
    other fields) with its simulated ``routing_stats`` and their RMS error against the published
    ones, least first: the routing is chosen on those statistics, none of them a table row."""
    if not data.get("routing_stats"):
        raise ValueError("fit_routing: the data file has no routing_stats")
    base = routing_of(data)
    names = list(grid)
    out = []
    for values in itertools.product(*(grid[n] for n in names)):
        params = dataclasses.replace(base, **dict(zip(names, values)))
        checks = routing_checks(data, seeds, params)
        rms = math.sqrt(sum((c["simulated"] - c["published"]) ** 2 for c in checks) / len(checks))
        out.append({"params": dict(zip(names, values)), "simulated": [c["simulated"] for c in checks], "rms": rms})
    return sorted(out, key=lambda x: x["rms"])


def report(data: dict, hosts: dict[str, Hardware], results: list[dict], seeds: int, command: str,
           checks: list[dict] = (), bound_rows: list[dict] | None = None) -> str:
    """The markdown reference of a reproduction; its last line counts the predicted rows."""
    lines = ["# The seeds' decode rows, predicted by the simulator", "", f"Command: `{command}`", "",
             "## Method", "", _METHOD.format(seeds=seeds, prompt=PROMPT_TOKENS), "",
             "| machine | gpu_mem_gbps | graph_kernel_s | split_sync_s | mailbox_s | cpu_thread_gbps | pageable_gbps |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m, h in hosts.items():
        lines.append(f"| {m} | {h.gpu_mem_gbps:.1f} | {h.graph_kernel_s * 1e6:.2f} us | {h.split_sync_s * 1e6:.0f} us | "
                     f"{h.mailbox_s * 1e6:.0f} us | {h.cpu_thread_gbps:.2f} | {h.pageable_gbps:.2f} |")
    lines += ["", "Machines: " + "; ".join(f"{m}, {v['about']}" for m, v in data["machines"].items()) + ".", ""]
    if data.get("fixed"):
        lines += ["Given on every machine, not fitted (`--fixed`; the rows that fit them are predicted rows here): "
                  + ", ".join(f"{p} = {v:.3g}" for p, v in data["fixed"].items()) + ".", ""]
    if checks:
        lines += ["Routing: the synthetic traces against published routing statistics (none of them a table row):", "",
                  "| statistic | published | synthetic |", "|---|---:|---:|"]
        lines += [f"| {c['about']} | {c['published']:.1%} | {c['simulated']:.1%} |" for c in checks]
        lines.append("")
    predicted, fitted, speedups, outside = [], [], [], []
    for i, res in enumerate(results):
        t = res["table"]
        lines += [f"## {t['machine']}: {t['model']} {t['quant']}, {t['cache_mib']} MiB cache, {t['tokens']} tokens", "",
                  f"{t['note']} ({res['simulated_tokens']} tokens simulated).", "",
                  "| row | published t/s | predicted | error | hit rate | fits |", "|---|---:|---:|---:|---:|---|"]
        for r in res["rows"]:
            (fitted if r["fits"] else predicted).append((r, t))
            lines.append(f"| {r['label']} | {r['published']:.1f} | {r['predicted']:.1f} | {r['error']:+.1%} | "
                         f"{r['hit_rate']:.1%} | {r['fits'] or ''} |")
        s = res["speedup"]
        if s:
            if not s["fitted"]:
                speedups.append((s, t))
            how = ("both rows fitted: not counted" if s["fitted"] else
                   f"error {s['error']:+.1%}, sign {'right' if s['sign_right'] else 'WRONG'}")
            lines += ["", f"Hybrid / cache ({ROWS[s['row']][0]}): published {s['published']:.2f}x, predicted "
                          f"{s['predicted']:.2f}x ({how})."]
        if bound_rows:
            lines += ["", _bound_line(bound_rows[i], {r["row"]: r["published"] for r in res["rows"]})]
            b = bound_rows[i]
            outside += [(r, t) for r in res["rows"] if not r["fits"] and r["row"] in b["free"]
                        and not b["cpu"] <= r["published"] <= b["free"][r["row"]]]
        lines.append("")
    within = [x for x in predicted if abs(x[0]["error"]) <= TOLERANCE]
    per_machine = {m: (sum(1 for r, t in within if t["machine"] == m), sum(1 for r, t in predicted if t["machine"] == m))
                   for m in data["machines"]}
    signs = sum(1 for s, _ in speedups if s["sign_right"])
    worst = max(speedups, key=lambda x: abs(x[0]["error"])) if speedups else None
    lines += ["## Errors", "",
              f"- Predicted rows (no parameter fitted on them) within {TOLERANCE:.0%}: {len(within)} of {len(predicted)} ("
              + ", ".join(f"{m} {a} of {b}" for m, (a, b) in per_machine.items()) + f"); {len(fitted)} rows fitted a "
              "parameter and are not counted."]
    if bound_rows:
        lines.append(f"- Outside their table's bounds (no modelled cost gives them): {len(outside)} of the predicted rows ("
                     + (", ".join(f"{t['machine']} {t['model']} {t['tokens']} tokens {r['label']}" for r, t in outside)
                        or "none") + f"); within {TOLERANCE:.0%}: "
                     f"{sum(1 for r, _ in within if all(r is not o for o, _ in outside))} of the {len(predicted) - len(outside)} others.")
    ws = warmups(results)
    if ws:
        lines += ["- Warm-up: t/s over the shorter run's tokens and over those after it, published / predicted:", "",
                  "| table | row | early | later |", "|---|---|---:|---:|"]
        lines += [f"| {w['machine']} {w['model']} {w['quant']}, {w['split']} / {w['tokens']} | {w['label']} | "
                  f"{w['published'][0]:.1f} / {w['predicted'][0]:.1f} | {w['published'][1]:.1f} / {w['predicted'][1]:.1f} |"
                  for w in ws]
        lines.append("")
    lines += [f"- Hybrid / cache speedup (tables with a predicted row of the two): sign right in {signs} of "
              f"{len(speedups)}; errors "
              + ", ".join(f"{s['error']:+.0%}" for s, _ in speedups)
              + (f" (largest {abs(worst[0]['error']):.0%})." if worst else "."),
              f"- Left out: {len(data['left_out'])} groups of published rows with no matching configuration (their "
              "reasons: `left_out` in the data file).", "", "## Known limits", "", _LIMITS, "",
              f"predicted rows within {TOLERANCE:.0%}: {len(within)} of {len(predicted)}; fitted: {len(fitted)}"]
    return "\n".join(lines) + "\n"


def warmups(results: list[dict]) -> list[dict]:
    """Each row that two tables of one machine, model, quant and cache give at two lengths: its
    rate over the shorter run's tokens and over the tokens after them, published and predicted
    (from the two runs' rates: the later tokens' time is the longer run's less the shorter's)."""
    out = []
    for a, b in itertools.combinations(results, 2):
        ta, tb = a["table"], b["table"]
        if any(ta[k] != tb[k] for k in ("machine", "model", "quant", "cache_mib")) or ta["tokens"] == tb["tokens"]:
            continue
        (short, n), (long, m) = sorted(((a, ta["tokens"]), (b, tb["tokens"])), key=lambda x: x[1])
        by = {r["row"]: r for r in long["rows"]}
        for r in short["rows"]:
            if r["row"] in by:
                later = lambda k: (m - n) / (m / by[r["row"]][k] - n / r[k])
                out.append({"machine": ta["machine"], "model": ta["model"], "quant": ta["quant"],
                            "cache_mib": ta["cache_mib"], "label": r["label"], "split": n, "tokens": m,
                            "published": (r["published"], later("published")),
                            "predicted": (r["predicted"], later("predicted"))})
    return out


def _bound_line(b: dict, pub: dict) -> str:
    """One table's ``bounds`` as a sentence, flagging published hybrid rows outside them."""
    parts = [f"{ROWS[k][0]} with every upload free {v:.1f} t/s (published {pub[k]:.1f}"
             + (", above this bound)" if pub[k] > v else ")") for k, v in b["free"].items()]
    low = [f"{ROWS[k][0]} published {pub[k]:.1f}" for k in b["free"] if pub[k] < b["cpu"]]
    parts.append(f"--cpu-moe on this file {b['cpu']:.1f} t/s" + (f" ({', '.join(low)}: below it)" if low else ""))
    return "Bounds: " + "; ".join(parts) + "."


_METHOD = (
    "Each row of `experiments/seed_tables.json` is replayed on {seeds} synthetic traces of its model's geometry "
    "(mean reported) under its configuration's policy and engine (`simulate.seeds.ROWS`): `--cpu-moe` = `cpu` and "
    "upstream's cache = `lru` over one shared pool on the `llama.cpp` engine (captured graphs, a graph-split round "
    "trip per layer); the pull request's hybrid = `hybrid`, every miss on the CPU, its slots from the same budget, "
    "on the `mailbox` engine (a mapped-flag hand-off each way per layer). Upstream's cache starts empty at the "
    "first generated token: the {prompt}-token prompt is one batch, which it serves read-only (over 32 tokens). The "
    "hybrid with the faster fill uploads the experts the prompt routed to (most routed first, while slots are free) "
    "before the first generated token, as the seed describes (\"it uploads the experts after the prompt\"); before "
    "it, the hybrid starts empty. Each then fills right after the token that missed (at most 512 per token, 16 "
    "before the faster fill), before the next token; its swap rounds (the runtime's: every 4 tokens, at most 96 moves) "
    "run beside generation: a swapped-in expert is resident a token after the next, a hit on it waits for its copy, "
    "and no token waits for a swap. An upload is a pageable copy of three tensors, each paying `copy_latency_s`; the"
    " UD file's experts are charged their share of its size and the nominal type's CPU time.\n\n"
    "Routing: `traces.synth` at the grid point nearest the published routing statistics below (`--fit-routing "
    "--seeds 5`; none is a table row); prompt and generation a topic each. Hosts: the presets' spec-sheet numbers "
    "(their `sources`); the L4's pageable rate from the seed's stated prompt time (the bytes of the distinct "
    "experts the prompt routes to over 1.65 s); the parameters in `fits`, solved jointly on their rows "
    "(`simulate.seeds.derive_hosts`), which are then not counted. The laptop's graph split per layer is fitted on "
    "its hybrid row, which has none, through the CPU and upload rates it shares with its `--cpu-moe` and cache rows"
    " (the L4's is llama.cpp's on the H200 host); the mailbox hand-off on the L4's longest hybrid run, for both "
    "machines. Error = predicted / published - 1. A bounds line gives a table's hybrid rows with every upload free "
    "and `--cpu-moe` on its file: a published hybrid row outside them is one no modelled cost gives.")

_LIMITS = (
    "- No recorded routing of these models exists here: the synthetic routing meets the published statistics. The "
    "faster fill's warm-up (its first 256 tokens at 58% of its later rate) is simulated with the prompt's experts "
    "uploaded before the first token (Warm-up table); which of them the real fill takes first is not published.\n"
    "- The L4's Qwen3-Coder-Next slow-fill 256-token row lies below `--cpu-moe` on its file: the synthetic routing "
    "gives that fill more hits than the row allows. The L4's 5000 MiB cache row comes out fast at the stated "
    "pageable rate, which the 16 GB cache rows follow, and takes its table's speedup (published 1.37x) below 1: "
    "it moves about the 16 GB Q6_K cache's miss bytes a token, yet published 33.5 against 37.8 t/s. Taking the "
    "tester's LRU statistic over 1024 tokens instead of 256 moves the routing's hit rates by under 2.5 points.\n"
    "- Fitted values (hosts table): the laptop's pageable rate under its x8 link's 15.8 GB/s; its graph split is an "
    "order of magnitude above llama.cpp's on the H200 host (17-34 us), and the mailbox above moelab's own mapped-flag "
    "hand-off there (1.2, 2.5 us, docs/fidelity/h200-calibrated.json): each absorbs what a split or hand-off costs "
    "these builds beyond the modelled terms (thread wake-ups, barriers). Given instead of fitted, from measured "
    "terms (`--fixed mailbox_s=1.7e-05`: moelab's two hand-offs and llama.cpp's 30 us CPU split per layer, halved "
    "each way), no hybrid row fits anything: 11 of 18 rows within 15%, every speedup error within 24% and the 5000 "
    "MiB table's sign right (1.10x), the two 1024-token tables' wrong (1.14x and 1.11x against 0.99x and 0.91x). No "
    "one hand-off gives every sign (one trace each: the 5000 MiB table's needs it under about 47 us, the 1024-token "
    "Q6_K table's over about 72), and a per-CPU-layer cost is not what tells them apart: the 5000 MiB hybrid runs "
    "CPU experts in 38 of its 40 layers a token, the 16 GB Q6_K hybrid in 25. Its cache row is (+31%): at its "
    "published rate the fitted model's speedup would be 1.21x. The laptop's preset keeps its earlier CPU and upload "
    "rates, on which other experiments ran.\n"
    "- The laptop's Qwen3-Coder-Next rows are one round each (non-hybrid rounds varied by up to ~5 t/s, the seed "
    "says); swap rounds use the runtime's published parameters (every 4 tokens, at most 96 moves).")
