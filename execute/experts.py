"""Host-resident expert weights in their GGUF quant type, as every executor module sees them.

Shapes are numpy order: a weight ``W`` of ``rows x cols`` computes ``y = W @ x`` with ``x`` of
length ``cols`` (GGUF lists the same tensor as ``[cols, rows]``; ``execute.gguf_io`` reverses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ExecutorError", "ExpertTensor", "LayerExperts", "random_layer"]


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


# byte offsets of each block type's f16 scale fields, for random_layer(exact=False)
_SCALE_FIELDS = {2: (0,), 8: (0,), 12: (0, 2), 14: (208,)}


def random_layer(rng: np.random.Generator, layer: int, num_experts: int, hidden: int, ffn: int,
                 qtype: int, down_qtype: int | None = None, exact: bool = True) -> LayerExperts:
    """A MoE layer of random experts in ``qtype`` (``down_qtype`` for down, default the same).

    ``exact``: quantize N(0, 1/cols) weights with ``execute.quant.quantize`` (tests). Otherwise fill
    the blocks with random bytes and set every f16 scale to a small valid value (fast, for
    benchmarks of tens of GB; float types still draw normal weights).
    """
    from . import quant as Q

    def tensor(rows: int, cols: int, qt: int, name: str) -> ExpertTensor:
        q = Q.quant_type(qt, name)
        rb = Q.row_bytes(qt, cols, name)
        if exact or q.block_weights == 1:
            w = rng.standard_normal((num_experts * rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
            data = Q.quantize(w, qt).reshape(num_experts, rows * rb)
        else:
            data = rng.integers(0, 256, (num_experts, rows * rb), dtype=np.uint8)
            blocks = data.reshape(-1, q.block_bytes)
            scale = np.float16(2.0 / (q.block_weights * np.sqrt(cols))).view(np.uint16)
            for off in _SCALE_FIELDS[qt]:
                blocks[:, off:off + 2].view(np.uint16)[:] = scale
        return ExpertTensor(data, qt, rows, cols, f"blk.{layer}.{name}")

    dq = qtype if down_qtype is None else down_qtype
    return LayerExperts(layer, tensor(ffn, hidden, qtype, "ffn_gate_exps"), tensor(ffn, hidden, qtype, "ffn_up_exps"),
                        tensor(hidden, ffn, dq, "ffn_down_exps"))
