"""Host-resident expert weights in their GGUF quant type, as every executor module sees them.

Shapes are numpy order: a weight ``W`` of ``rows x cols`` computes ``y = W @ x`` with ``x`` of
length ``cols`` (GGUF lists the same tensor as ``[cols, rows]``; ``execute.gguf_io`` reverses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ExecutorError", "ExpertTensor", "LayerExperts"]


class ExecutorError(RuntimeError):
    """A step that could not run (timeout, failed copy, bad weights); the process lives on."""


@dataclass(frozen=True)
class ExpertTensor:
    """One projection for all experts of a layer: raw GGUF blocks, one row per expert."""

    data: np.ndarray  # uint8 (num_experts, bytes_per_expert), C-contiguous
    qtype: int  # gguf.GGMLQuantizationType value
    rows: int  # output features
    cols: int  # input features
    name: str = ""

    def __post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 2:
            raise ValueError(f"ExpertTensor {self.name}: data must be uint8 (experts, bytes), got {self.data.dtype} {self.data.shape}")

    @property
    def num_experts(self) -> int:
        return self.data.shape[0]

    @property
    def expert_bytes(self) -> int:
        return self.data.shape[1]


@dataclass(frozen=True)
class LayerExperts:
    """A MoE layer's routed experts: ``down(silu(gate x) * up x)``.

    gate, up: (ffn, hidden); down: (hidden, ffn).
    """

    layer: int
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def hidden(self) -> int:
        return self.gate.cols

    @property
    def ffn(self) -> int:
        return self.gate.rows

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down), what an upload moves."""
        return self.gate.expert_bytes + self.up.expert_bytes + self.down.expert_bytes
