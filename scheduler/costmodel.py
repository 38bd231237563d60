"""Per-layer costs of running experts, for policies that split misses by a cost model.

The numbers are plain seconds, given by whoever knows the hardware (the simulator's hardware
description, or a calibration on a real machine); the scheduler only compares sums of them.
A layer's time is modelled as the largest of its GPU, PCIe and CPU work (perfect overlap), as in
HybriMoE's per-layer split.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work, per layer (one entry per layer; dense layers are ignored).

    gpu: ``gpu_expert_s + work`` per expert run on the GPU, where ``work`` is
    ``tokens * gpu_token_s``, or with ``gpu_read_s`` given the roofline
    ``max(gpu_read_s, tokens * gpu_token_s)`` (weights read once, compute per token);
    pcie: ``upload_s`` per expert copied host -> device;
    cpu: likewise ``cpu_expert_s`` + ``tokens * cpu_token_s`` or ``max(cpu_read_s, tokens *
    cpu_token_s)`` per expert run on the CPU pool, whose ``cpu_task_s`` is paid once per layer
    that uses it;
    layer: ``layer_s`` of GPU work before the layer's experts (dense part, router read-back), during
    which earlier copies queued on the link keep moving (None: 0);
    ``cpu_delay_s``: in a layer that uses the CPU pool, how much later its GPU work and uploads
    are queued (an executor submits the CPU job first; 0: no delay).

    Hand-off terms (read by ``lookahead``, ``oracle`` and ``hybrid``'s share; 0: left out, as before them):
    ``cpu_copy_s``: in a layer that uses the CPU pool, the pool's result is ready this much later
    than its work (the hidden state copied to the host and the result back); ``cpu_combine_s``: GPU
    time after such a layer (the CPU result added in); ``gpu_batch_s``: fixed GPU cost of each batch
    of experts (a layer's hits are one batch, its uploaded experts another, run once they land).
    """

    gpu_expert_s: tuple[float, ...]
    gpu_token_s: tuple[float, ...]
    upload_s: tuple[float, ...]
    cpu_expert_s: tuple[float, ...]
    cpu_token_s: tuple[float, ...]
    cpu_task_s: float = 0.0
    gpu_read_s: tuple[float, ...] | None = None
    cpu_read_s: tuple[float, ...] | None = None
    layer_s: tuple[float, ...] | None = None
    cpu_delay_s: float = 0.0
    cpu_copy_s: float = 0.0
    cpu_combine_s: float = 0.0
    gpu_batch_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.upload_s)
        names = ["gpu_expert_s", "gpu_token_s", "upload_s", "cpu_expert_s", "cpu_token_s"]
        names += [k for k in ("gpu_read_s", "cpu_read_s", "layer_s") if getattr(self, k) is not None]
        for name in names:
            v = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, v)
            if len(v) != n:
                raise ValueError(f"CostModel.{name}: {len(v)} entries, expected {n} (one per layer)")
            if any(x < 0 or x != x for x in v):
                raise ValueError(f"CostModel.{name}: every entry must be a number >= 0")
        if self.cpu_task_s < 0:
            raise ValueError("CostModel.cpu_task_s: expected >= 0")
        for name in ("cpu_delay_s", "cpu_copy_s", "cpu_combine_s", "gpu_batch_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name}: expected >= 0")

    def of_layers(self, layers) -> "CostModel":
        """The costs of ``layers`` only, in that order (layer ``layers[i]`` becomes layer ``i``)."""
        pick = lambda v: None if v is None else tuple(v[l] for l in layers)
        return CostModel(pick(self.gpu_expert_s), pick(self.gpu_token_s), pick(self.upload_s),
                         pick(self.cpu_expert_s), pick(self.cpu_token_s), self.cpu_task_s,
                         pick(self.gpu_read_s), pick(self.cpu_read_s), pick(self.layer_s), self.cpu_delay_s,
                         self.cpu_copy_s, self.cpu_combine_s, self.gpu_batch_s)

    def gpu_s(self, layer: int, tokens: int) -> float:
        work = tokens * self.gpu_token_s[layer]
        if self.gpu_read_s is not None:
            work = max(self.gpu_read_s[layer], work)
        return self.gpu_expert_s[layer] + work

    def cpu_s(self, layer: int, tokens: int) -> float:
        work = tokens * self.cpu_token_s[layer]
        if self.cpu_read_s is not None:
            work = max(self.cpu_read_s[layer], work)
        return self.cpu_expert_s[layer] + work

