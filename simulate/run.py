"""One simulation from a config: trace + model + hardware + policy + cache -> result summary.

The glue between ``traces`` (tokens), ``scheduler`` (policy, capacity, driver loop, audit) and
the SimPy engine. A trace's geometry must match the model's (layers, experts per layer, top-k);
``trace="synth"`` generates a synthetic trace for the model's geometry instead (dense layers
masked). A trace file is checked entry by entry when opened.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from scheduler import POLICIES, Audit, Capacity, drive, make_policy, pad_slot_bytes

from scheduler.costs import DEFAULT_HARDWARE, DEFAULT_MODEL, Costs, ExecConfig
from scheduler.graph import CpuMisses
from .engine import SimResult, Simulator
from scheduler.hardware import Hardware, load_hardware
from scheduler.models import ModelSpec, load_model

__all__ = ["SimConfig", "SimError", "run", "build_capacity", "load_tokens", "TraceTokens", "AUTO_RESERVE_BYTES"]

AUTO_RESERVE_BYTES = 700 * 2**20  # VRAM kept free by the "auto" cache size (as Strata's auto mode)


class SimError(ValueError):
    """A configuration that cannot be simulated (mismatched trace, bad cache size, ...)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything that determines one simulation; equal configs give equal results.

    ``cache_mib`` may be a number or ``"auto"`` (free VRAM after the dense weights, the KV cache
    at ``context`` and a 700 MiB reserve); ``cache_slots`` (slots per MoE layer) wins when set.
    ``miss_fraction`` is hybrid's share of distinct misses sent over PCIe (to 1/256).
    ``trace``: None = bundled granite trace, a path, or ``"synth"`` (``synth_tokens`` tokens for the
    model's geometry, from ``seed``). ``phase``: which trace rows run ("decode", "prefill", "all").
    ``token_graph``: decode tokens may run as one CUDA graph, as ``moelab run`` does when any expert
    can be resident (charged only with a hardware file that has the graph's costs; off for the
    engine-only trace replay of ``experiments/sim_vs_real.py``).
    """

    model: str = DEFAULT_MODEL
    hardware: str = DEFAULT_HARDWARE
    policy: str = "hybrid"
    cache_slots: int | None = None
    cache_mib: float | str | None = 512.0
    miss_fraction: float | None = None
    adaptive: bool = True
    tokens: int | None = None
    trace: str | None = None
    phase: str = "decode"
    expert_quant: str | None = None
    synth_tokens: int = 1024
    seed: int = 0
    lag_tokens: int = 1
    pinned: bool = True
    context: int = 4096
    token_graph: bool = True

    def __post_init__(self) -> None:
        if self.cache_slots is not None and self.cache_slots < 0:
            raise ValueError(f"cache_slots: {self.cache_slots}, expected >= 0")
        if isinstance(self.cache_mib, str) and self.cache_mib != "auto":
            raise ValueError(f"cache_mib: {self.cache_mib!r}, expected a number of MiB or 'auto'")
        if isinstance(self.cache_mib, (int, float)) and not 0 <= self.cache_mib < float("inf"):
            raise ValueError(f"cache_mib: {self.cache_mib}, expected a finite number >= 0")
        if self.miss_fraction is not None and not 0.0 <= self.miss_fraction <= 1.0:
            raise ValueError(f"miss_fraction: {self.miss_fraction}, expected 0..1")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens: {self.tokens}, expected >= 1")
        if self.phase not in ("decode", "prefill", "all"):
            raise ValueError(f"phase: {self.phase!r}, expected decode, prefill or all")
        if self.lag_tokens < 0:
            raise ValueError(f"lag_tokens: {self.lag_tokens}, expected >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown {self.policy!r}; expected one of {', '.join(POLICIES)}")
        if self.synth_tokens < 1:
            raise ValueError(f"synth_tokens: {self.synth_tokens}, expected >= 1")
        if self.seed < 0:
            raise ValueError(f"seed: {self.seed}, expected >= 0")
        if self.context < 1:
            raise ValueError(f"context: {self.context}, expected >= 1")

    def as_row(self) -> dict:
        """The config's fields as a flat dict (one CSV row's config part)."""
        return {k: ("" if v is None else v) for k, v in asdict(self).items()}


def _model(cfg: SimConfig) -> ModelSpec:
    m = load_model(cfg.model)
    return m.with_quant(cfg.expert_quant) if cfg.expert_quant else m


class TraceTokens:
    """The scheduler tokens of a trace's rows, re-iterable: each pass reads them from the (memory
    mapped) trace as the simulation consumes them, so memory does not grow with the trace's length
    (``Trace.tokens``; small traces keep their steps, see ``traces.format``)."""

    def __init__(self, trace, phase: str | None, limit: int | None):
        self.trace, self.phase, self.limit = trace, phase, limit
        n = len(trace.rows(phase))
        self._len = n if limit is None else min(n, limit)

    def __iter__(self):
        return self.trace.tokens(phase=self.phase, limit=self.limit)

    def __len__(self) -> int:
        return self._len


def load_tokens(cfg: SimConfig, model: ModelSpec, progress: bool = False) -> TraceTokens:
    """The trace rows of ``cfg`` as re-iterable scheduler tokens (``TraceTokens``); the geometry is
    checked against ``model``. ``progress``: a bar on stderr while a synthetic trace is generated.

    Cached per process (the trace is opened and checked once), so a sweep loads each trace once
    per worker."""
    return _load_tokens(cfg.trace, cfg.phase, cfg.tokens, cfg.synth_tokens, cfg.seed, model, progress)


@lru_cache(maxsize=4)
def _load_tokens(trace_arg, phase_arg, limit, synth_tokens, seed, model: ModelSpec, progress: bool = False):
    import traces

    cfg = SimConfig(trace=trace_arg, phase=phase_arg, tokens=limit, synth_tokens=synth_tokens, seed=seed)

    geometry = model.geometry()
    if cfg.trace == "synth":
        trace = _synth_trace(model, geometry, cfg.synth_tokens, cfg.seed, progress)
    else:
        try:
            trace = traces.load(cfg.trace, check=True)
        except traces.TraceError as e:
            raise SimError(f"--trace: {e}") from None
    got = (tuple(trace.num_experts), trace.top_k)
    want = (geometry.num_experts, geometry.top_k)
    if got != want:
        where = cfg.trace or "bundled trace"
        raise SimError(
            f"{where}: trace geometry {len(got[0])} layers x {max(got[0])} experts top-{got[1]} does not match "
            f"model {model.name} ({len(want[0])} layers x {max(want[0])} experts top-{want[1]}); pick the model "
            f"the trace was recorded on, or --trace synth for a synthetic trace of the model's geometry")
    toks = TraceTokens(trace, None if cfg.phase == "all" else cfg.phase, cfg.tokens)
    if not len(toks):
        raise SimError(f"{cfg.trace or 'bundled trace'}: no {cfg.phase} rows to simulate")
    rows = trace.rows(toks.phase)[:len(toks)]
    if not any(int(np.max(trace.expert_ids[rows[i:i + 65536]])) >= 0 for i in range(0, len(rows), 65536)):
        raise SimError(f"{cfg.trace or 'bundled trace'}: every expert id of its {cfg.phase} rows is masked (-1); "
                       f"nothing is routed, nothing to simulate")
    return toks


def _synth_trace(model: ModelSpec, geometry, num_tokens: int, seed: int, progress: bool = False):
    """A synthetic trace of ``model``'s geometry: generated for its MoE layers, its dense layers
    masked (all -1), as a recorded trace of the model would have them."""
    import traces
    from traces import synth

    moe = [l for l, n in enumerate(geometry.num_experts) if n]
    t = synth.generate(len(moe), model.num_experts, model.top_k, num_tokens, synth.SynthParams(),
                       np.random.default_rng(seed), progress=progress)
    if len(moe) == model.num_layers:
        return t
    ids = np.full((len(t), model.num_layers, model.top_k), -1, dtype=t.expert_ids.dtype)  # (T, L, k)
    ids[:, moe] = t.expert_ids
    return traces.Trace(t.model, geometry.num_experts, t.top_k, ids, t.seq, t.pos, t.phase, None, t.meta)


def build_capacity(cfg: SimConfig, model: ModelSpec, hw: Hardware) -> Capacity:
    """Cache slots from ``cache_slots``, ``cache_mib`` or the hardware's free VRAM ("auto").

    Refused (SimError) before any work: a cache that does not fit the GPU beside the dense weights
    and the KV cache at ``context`` (``gpu``: every expert resident), and a budget of MiB too small
    for one expert per layer under a policy that caches."""
    geometry = model.geometry()
    dense = sum(model.dense_bytes(l) for l in range(model.num_layers)) + 2 * model.head_bytes()
    kv = cfg.context * sum(model.kv_bytes_per_position(l) for l in range(model.num_layers))
    if cfg.policy == "gpu":  # every expert resident
        capacity = Capacity.per_layer(geometry, geometry.max_experts)
        what = "policy gpu (every expert resident)"
    elif cfg.cache_slots is not None:
        capacity = Capacity.per_layer(geometry, cfg.cache_slots)
        what = f"--cache-slots {cfg.cache_slots}"
    elif cfg.cache_mib is None or cfg.cache_mib == "auto":
        free = hw.gpu_mem_bytes - dense - kv - AUTO_RESERVE_BYTES
        if free <= 0:
            raise SimError(f"cache auto: the dense weights and KV cache of {model.name} do not fit {hw.name}")
        return Capacity.from_mib(geometry, free / 2**20)
    else:
        capacity = Capacity.from_mib(geometry, float(cfg.cache_mib))
        what = f"--cache-mib {cfg.cache_mib:g}"
        row = sum(pad_slot_bytes(geometry.expert_bytes[l]) for l in geometry.moe_layers)
        if cfg.cache_mib > 0 and cfg.policy != "cpu" and capacity.min_slots_per_layer(geometry) == 0:
            raise SimError(f"{what}: 0 of {model.num_experts} experts per layer of {model.name} (one expert in "
                           f"every MoE layer takes {row / 2**20:.0f} MiB); give at least {math.ceil(row / 2**20)} "
                           f"MiB, 'auto', or --cache-mib 0 / --policy cpu for no cache")
    need = capacity.slot_bytes(geometry) + dense + kv
    if need > hw.gpu_mem_bytes:
        raise SimError(f"{what}: the cache ({capacity.slot_bytes(geometry) / 2**20:.0f} MiB) with the dense "
                       f"weights and the KV cache at context {cfg.context} ({(dense + kv) / 2**20:.0f} MiB) needs "
                       f"{need / 2**20:.0f} MiB, more than the {hw.gpu_mem_bytes / 2**20:.0f} MiB of GPU memory of "
                       f"{hw.name}; give a smaller cache or 'auto'")
    return capacity


def run(cfg: SimConfig, record: bool = False, hardware: Hardware | None = None,
        model: ModelSpec | None = None, tokens=None, options: dict | None = None,
        graph_cpu: bool = False, graph_cpu_block_s: float | None = None,
        policy_hardware: Hardware | None = None, graph_cpu_pair_s: float = 0.0) -> tuple[SimResult, dict]:
    """Simulate ``cfg``; returns the result and a dict of derived facts (slots, MiB, bytes).
    ``options``: the policy family's config fields (``make_policy``), beside the config's.
    ``graph_cpu``: as ``moelab run --graph-cpu``: the policy wrapped in ``scheduler.graph.CpuMisses``
    (a one-token step's misses on the CPU inside the token graph, its uploads deferred as fills),
    charged by the simulator's ``graph_cpu`` chain at the token graph's block time, or at
    ``graph_cpu_block_s`` (a CPU graph's measured block time: its blocks launch more kernels) plus
    ``graph_cpu_pair_s`` a CPU pair (``Simulator``'s).
    ``policy_hardware``: the file a cost-model policy plans with (``moelab run --hardware``'s, as the
    executor builds it: ``Costs(model, file, ExecConfig(pinned)).cost_model()``) where it is not the
    one the run is timed on."""
    model = model or _model(cfg)
    hw = hardware or load_hardware(cfg.hardware)
    if tokens is None:
        tokens = load_tokens(cfg, model)
    geometry = model.geometry()
    capacity = build_capacity(cfg, model, hw)
    options = {**({"adaptive": cfg.adaptive} if cfg.policy == "hybrid" else {}), **(options or {})}
    costs = Costs(model, hw, ExecConfig(pinned=cfg.pinned, policy=cfg.policy))
    cost_model = None
    if cfg.policy in ("hybrid", "hybrid-cost", "lookahead", "oracle"):
        cost_model = (costs if policy_hardware is None else
                      Costs(model, policy_hardware, ExecConfig(pinned=cfg.pinned))).cost_model()
    try:  # static: the replayed tokens' own counts (an oracle); belady: every step, held
        policy = make_policy(cfg.policy, geometry, capacity, tokens=tokens, cost_model=cost_model,
                             miss_fraction=cfg.miss_fraction, **options)
    except ValueError as e:
        raise SimError(f"policy {cfg.policy}: {e}") from None
    if graph_cpu and cfg.policy == "cpu":
        raise SimError("graph_cpu: policy cpu has no GPU cache; the CPU graph runs a cache's misses on the CPU")
    audit = Audit(geometry, keep_records=False)
    slots = capacity.min_slots_per_layer(geometry) if cfg.policy != "gpu" else geometry.max_experts
    # the executor's: some expert can be resident, and no shared expert (execute.backends.token_graph)
    graph = cfg.token_graph and capacity.slot_bytes(geometry) > 0 and not model.shared_ffn
    if graph_cpu:
        policy, graph = CpuMisses(policy), True
    result = Simulator(costs, record=record, token_graph=graph, graph_cpu=graph_cpu,
                       graph_cpu_block_s=graph_cpu_block_s if graph_cpu else None,
                       graph_cpu_pair_s=graph_cpu_pair_s if graph_cpu else 0.0).run(
        drive(policy, tokens, cfg.lag_tokens), audit)
    info = {"slots_per_layer": slots, "cache_mib": capacity.slot_bytes(geometry) / 2**20,
            "expert_bytes": model.expert_bytes(model.num_layers - 1), "num_experts": model.num_experts,
            "model_expert_mib": model.total_expert_bytes() / 2**20}
    return result, info
