"""Hardware descriptions: the costs of the GPU, the PCIe link and the CPU pool, loaded from JSON.

A hardware file is one JSON object with the fields of :class:`Hardware` and, optionally,
``"sources": {field: "where the number comes from"}``. Presets live in
``scheduler/presets/hardware/<name>.json``; ``load_hardware`` takes a preset name or a path.
Bandwidths are in GB/s (1e9 bytes per second), times in seconds. A file written by ``moelab
calibrate`` also carries ``"_calibration"`` (the raw measurements, medians and spread), ignored here.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

__all__ = ["Hardware", "HardwareError", "load_hardware", "hardware_presets", "HARDWARE_DIR", "EXECUTOR_KEYS"]

HARDWARE_DIR = Path(__file__).resolve().parent / "presets" / "hardware"


# Costs of moelab's own executor (``execute/``) on this machine, in seconds, measured by ``moelab
# calibrate``. When a hardware file has them the simulator adds a host lane (the Python thread that
# issues all work); see docs/FIDELITY.md. ``plan_s`` is per scheduler policy name.
EXECUTOR_KEYS = {
    "host_dense_s": "host time to issue one layer's dense part (and the output head)",
    "dense_fixed_s": "GPU time of one layer's dense part beyond its bytes (kernel floors)",
    "readback_s": "router-logits / sampled-token read-back once the GPU is done (copy + sync)",
    "host_gpu_layer_s": "engine host time of a layer whose experts all run on the GPU (one expert), all phases",
    "host_gpu_expert_s": "engine host time per further GPU expert of a layer",
    "host_copy_s": "host time to queue one expert upload",
    "host_copy_round_s": "host time to open a layer's copy round (copies begun, compute made to wait for them), "
                         "once per layer with uploads or streams, beyond host_copy_s per copy",
    "host_plan_copy_s": "engine plan time per upload or stream of the previous layer (its copies still in flight)",
    "host_cpu_s": "older files: engine host time and hand-offs of a layer with CPU experts (charged half before "
                  "the pool starts, half after it ends) where the split keys below are absent",
    "host_layer_plan_s": "engine host time of a layer before anything is queued (pairs, sources, metadata copy)",
    "host_layer_combine_s": "engine host time of a GPU-only layer's combine (part of host_gpu_layer_s)",
    "host_cpu_submit_s": "engine host time from the end of planning to the CPU job's submit (input fetch, row gather)",
    "host_cpu_handoff_s": "engine host time from the CPU submit to the GPU queueing (GIL hand-off to the pool)",
    "host_cpu_queue_s": "engine host time to queue a one-expert GPU part while the CPU pool computes",
    "host_cpu_combine_s": "engine host time after the CPU result (its upload and the combine queued)",
    "cpu_start_s": "CPU job submitted -> pool worker starts computing",
    "cpu_return_s": "pool worker done -> the waiting caller resumes",
    "handoff_in_s": "present when the executor hands one token's CPU experts off through host-mapped memory (no "
                    "host wait): the GPU writes the call's input and gate -> the first pool worker through it",
    "handoff_out_s": "hand-off: the pool's last output written -> the GPU's waiting combine kernel sees it",
    "host_head_s": "host time to issue the output head and sampling (host_dense_s where absent)",
    "gpu_batch_s": "GPU time of one expert batch beyond its bytes (metadata copy, two kernels)",
    "combine_s": "GPU time of the combine of a layer's expert outputs",
    "wait_poll_s": "host polling interval while it waits for a background copy (half is charged)",
    "plan_s": "scheduler time per layer step, per policy name (object)",
    "graph_block_s": "token graph (execute.token_graph): GPU time of one block in the graph (dense part and the "
                     "routed experts of one token), beyond the head",
    "graph_step_s": "token graph: host time per step the graph computed (driver, planning under policy gpu, "
                    "settling, audit); other policies add their plan_s difference to gpu's",
    "graph_token_s": "token graph: host time per token tried as a graph beyond its steps (embedding, launch, "
                     "read-back of its routes, sampling)",
    "gpu_one_s": "GPU time of a one-token step's experts on the one-token path (hits and uploads only: gate/up, "
                 "then down and the combine in one launch) beyond its experts' bytes; where absent such a step "
                 "is charged as a batch (gpu_batch_s) and its combine (combine_s)",
    "gpu_one_expert_scale": "that path's GPU time per expert / a batch's (gpu_quant_efficiency's) (a ratio, "
                            "not seconds)",
    "cpu_mapped_factor": "CPU pool time of a call on experts read through a file's memory map (as moelab run reads "
                         "a GGUF file) / on the calibration's anonymous buffers (a ratio; simulate.peer applies it)",
    "host_stream_layer_s": "engine host time a one-token step with streamed experts and none on the CPU takes on the "
                           "engine's general path beyond the lane's other terms, once per such step",
    "host_stream_s": "the same, per streamed expert of such a step",
}
RATIO_KEYS = ("gpu_one_expert_scale", "cpu_mapped_factor")  # executor keys that are ratios in (0, 4], not seconds


class HardwareError(ValueError):
    """A hardware file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Hardware:
    """One GPU, its PCIe link and the host's CPU pool, as the simulator charges them.

    ``gpu_mem_gbps`` and ``pcie_h2d_gbps`` are achievable rates (not spec-sheet peaks).
    CPU pool: ``cpu_threads`` threads, each streaming expert weights at ``cpu_thread_gbps`` times
    the quant type's ``cpu_quant_efficiency`` (1.0 where absent), all together at most
    ``cpu_mem_gbps``; each parallel call costs ``cpu_task_s``. ``cpu_call_factor`` (optional, from a
    calibration replay): per expert count n of a call, the measured mean call time / (``cpu_task_s`` +
    n x the per-expert time); counts not in it use the linear cost (factor 1).

    Fixed costs, each a term of its own (0 where a file does not give it): ``launch_s`` per kernel
    launched from Python (moelab's executor); ``graph_kernel_s`` GPU time per kernel node of a
    captured CUDA graph (llama.cpp); ``split_sync_s`` one round trip of a graph-split engine at a
    layer whose experts or decision are on the host (device synchronised, activations out, the
    next split launched); ``mailbox_s`` one hand-off through flags in mapped host memory (the
    seed's mailbox), per direction. ``costs.ExecConfig.engine`` picks which of them apply.
    """

    name: str
    gpu_name: str
    gpu_mem_bytes: int
    gpu_mem_gbps: float
    gpu_tflops: float
    launch_s: float
    pcie_h2d_gbps: float
    pageable_gbps: float
    copy_latency_s: float
    cpu_name: str
    cpu_threads: int
    cpu_mem_gbps: float
    cpu_thread_gbps: float
    cpu_task_s: float
    graph_kernel_s: float = 0.0
    split_sync_s: float = 0.0
    mailbox_s: float = 0.0
    cpu_quant_efficiency: dict = field(default_factory=dict, hash=False)
    gpu_quant_efficiency: dict = field(default_factory=dict, hash=False)
    executor: dict = field(default_factory=dict, hash=False)
    cpu_call_factor: dict = field(default_factory=dict, hash=False)
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for f in ("gpu_mem_bytes", "cpu_threads"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: {v!r}, expected an integer >= 1")
        for f in ("gpu_mem_gbps", "gpu_tflops", "pcie_h2d_gbps", "pageable_gbps", "cpu_mem_gbps", "cpu_thread_gbps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f}: {v!r}, expected a number > 0")
        for f in ("launch_s", "copy_latency_s", "cpu_task_s", "graph_kernel_s", "split_sync_s", "mailbox_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1:
                raise ValueError(f"{f}: {v!r}, expected seconds in [0, 1)")
        for f in ("cpu_quant_efficiency", "gpu_quant_efficiency"):
            table = getattr(self, f)
            if not isinstance(table, dict):
                raise ValueError(f"{f}: expected an object of quant type -> factor")
            for q, v in table.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 4:
                    raise ValueError(f"{f}.{q}: {v!r}, expected a factor in (0, 4]")
            object.__setattr__(self, f, {str(q).upper(): float(v) for q, v in table.items()})
        object.__setattr__(self, "executor", _check_executor(self.executor))
        object.__setattr__(self, "cpu_call_factor", _check_call_factor(self.cpu_call_factor))

    def cpu_gbps(self, quant: str, threads: int | None = None) -> float:
        """Rate (GB/s of weights) at which the pool computes one token's experts of ``quant``."""
        n = self.cpu_threads if threads is None else threads
        return min(self.cpu_mem_gbps, n * self.cpu_thread_gbps * self.cpu_quant_efficiency.get(quant, 1.0))

    def gpu_gbps(self, quant: str) -> float:
        """Rate (GB/s of weights) of a GPU expert/dense GEMV on ``quant`` weights."""
        return self.gpu_mem_gbps * self.gpu_quant_efficiency.get(quant, 1.0)

    def h2d_gbps(self, pinned: bool = True) -> float:
        return self.pcie_h2d_gbps if pinned else self.pageable_gbps


def _seconds(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v < 1:
        raise ValueError(f"{name}: {v!r}, expected seconds in [0, 1)")
    return float(v)


def _check_executor(table) -> dict:
    if not isinstance(table, dict):
        raise ValueError("executor: expected an object of executor costs")
    unknown = sorted(set(table) - set(EXECUTOR_KEYS))
    if unknown:
        raise ValueError(f"executor: unknown key(s) {unknown}; expected {sorted(EXECUTOR_KEYS)}")
    out = {}
    for k, v in table.items():
        if k == "plan_s":
            if not isinstance(v, dict) or not v:
                raise ValueError("executor.plan_s: expected an object of policy name -> seconds")
            out[k] = {str(p): _seconds(f"executor.plan_s.{p}", x) for p, x in v.items()}
        elif k in RATIO_KEYS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 4:
                raise ValueError(f"executor.{k}: {v!r}, expected a ratio in (0, 4]")
            out[k] = float(v)
        else:
            out[k] = _seconds(f"executor.{k}", v)
    return out


def _check_call_factor(table) -> dict:
    """``cpu_call_factor`` as {expert count (int >= 1): factor in (0, 4]}; JSON keys are strings."""
    if not isinstance(table, dict):
        raise ValueError("cpu_call_factor: expected an object of expert count -> factor on the linear pool cost")
    out = {}
    for n, v in table.items():
        try:
            k = int(n)
        except (TypeError, ValueError):
            k = 0
        if isinstance(n, bool) or k < 1 or str(k) != str(n).strip():
            raise ValueError(f"cpu_call_factor: key {n!r}, expected an expert count (integer >= 1)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 4:
            raise ValueError(f"cpu_call_factor.{k}: {v!r}, expected a factor in (0, 4]")
        out[k] = float(v)
    return out


_NAMES = {f.name for f in fields(Hardware)}
_REQUIRED = {f.name for f in fields(Hardware) if f.default is MISSING and f.default_factory is MISSING}


def hardware_presets() -> tuple[str, ...]:
    """Names of the bundled hardware presets."""
    return tuple(sorted(p.stem for p in HARDWARE_DIR.glob("*.json")))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A preset by name, or a JSON file by path; ``HardwareError`` names the file and field."""
    p = Path(name_or_path)
    if not p.suffix and not p.exists():
        p = HARDWARE_DIR / f"{name_or_path}.json"
        if not p.exists():
            raise HardwareError(f"unknown hardware {str(name_or_path)!r}: expected a preset "
                                f"({', '.join(hardware_presets())}) or a path to a JSON file")
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise HardwareError(f"{p}: no such hardware file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HardwareError(f"{p}: not a readable JSON hardware file ({e})") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{p}: expected a JSON object of hardware fields, got {type(data).__name__}")
    unknown = sorted(set(data) - _NAMES - {"_about", "_calibration"})
    if unknown:
        raise HardwareError(f"{p}: unknown field(s) {unknown}; expected fields of Hardware: {sorted(_NAMES)}")
    missing = sorted(_REQUIRED - set(data))
    if missing:
        raise HardwareError(f"{p}: missing field(s) {missing}")
    data.pop("_about", None)
    data.pop("_calibration", None)
    try:
        return Hardware(**data)
    except (TypeError, ValueError) as e:
        raise HardwareError(f"{p}: field {e}") from None
