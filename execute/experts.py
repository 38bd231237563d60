"""Host-resident expert weights in their GGUF quant type, as every executor module sees them.

Shapes are numpy order: a weight ``W`` of ``rows x cols`` computes ``y = W @ x`` with ``x`` of
length ``cols`` (GGUF lists the same tensor as ``[cols, rows]``; ``execute.gguf_io`` reverses it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ACTIVATIONS", "ExecutorError", "ExpertTensor", "LayerExperts", "random_layer"]

ACTIVATIONS = ("silu", "swiglu_oai")  # index = the CPU kernels' activation code


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
    """A MoE layer's routed experts: ``down(act(gate x + gate_bias, up x + up_bias)) + down_bias``.

    gate, up: (ffn, hidden); down: (hidden, ffn). Biases are float32, one row per expert:
    gate_bias, up_bias (experts, ffn), down_bias (experts, hidden); all three or none (none: zero).
    ``activation`` (see ``ACTIVATIONS``): "silu" is ``silu(g) * u``; "swiglu_oai" (gpt-oss) is
    ``g = min(g, 7)``, ``u = clip(u, -7, 7)``, ``g * sigmoid(1.702 g) * (u + 1)``.
    """

    layer: int
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"LayerExperts {self.layer}: activation {self.activation!r}, expected one of {ACTIVATIONS}")
        biases = (self.gate_bias, self.up_bias, self.down_bias)
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError(f"LayerExperts {self.layer}: gate_bias, up_bias, down_bias must be all given or all None")
        shapes = {"gate_bias": (self.num_experts, self.ffn), "up_bias": (self.num_experts, self.ffn),
                  "down_bias": (self.num_experts, self.hidden)}
        for name, shape in shapes.items():
            b = getattr(self, name)
            if b is not None and (b.dtype != np.float32 or b.shape != shape or not b.flags.c_contiguous):
                raise ValueError(f"LayerExperts {self.layer}: {name} must be C-contiguous float32 {shape}, "
                                 f"got {b.dtype} {b.shape}")

    @property
    def has_bias(self) -> bool:
        return self.gate_bias is not None

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
    def bias_bytes(self) -> int:
        """Bytes of one expert's float32 biases (gate, up, down); 0 without biases."""
        return 4 * (2 * self.ffn + self.hidden) if self.has_bias else 0

    def device_offsets(self) -> tuple[int, int, int]:
        """Byte offsets of gate, up and down in an expert laid out [biases] | gate | up | down (GPU
        slots); a ValueError where a projection would start misaligned for the GPU kernels' loads
        (F32: 4 bytes; 16-bit fields: 2; MXFP4: 1), i.e. after an odd-sized projection."""
        from . import quant as Q

        off_g = self.bias_bytes
        offs = (off_g, off_g + self.gate.expert_bytes, off_g + self.gate.expert_bytes + self.up.expert_bytes)
        for t, off in zip((self.gate, self.up, self.down), offs):
            need = 4 if t.qtype == Q.F32 else 1 if t.qtype == Q.MXFP4 else 2
            if off % need:
                raise ValueError(f"{t.name or f'layer {self.layer}'}: {Q.LAYOUTS[t.qtype].name} would start at byte "
                                 f"{off} of an expert in GPU memory, not {need}-byte aligned (an odd-sized projection "
                                 "before it); use one type for all three projections")
        return offs

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (biases + gate + up + down), what an upload moves."""
        return self.bias_bytes + self.gate.expert_bytes + self.up.expert_bytes + self.down.expert_bytes


# byte offsets of each block type's f16 scale fields, for random_layer(exact=False) (MXFP4: its exponent byte)
_SCALE_FIELDS = {2: (0,), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_layer(rng: np.random.Generator, layer: int, num_experts: int, hidden: int, ffn: int,
                 qtype: int, down_qtype: int | None = None, exact: bool = True) -> LayerExperts:
    """A MoE layer of random experts in ``qtype`` (``down_qtype`` for down, default the same).

    ``exact``: quantize N(0, 1/cols) weights with ``execute.quant.quantize`` (tests). Otherwise fill
    the blocks with random bytes and set every f16 scale to a small valid value (fast, for
    benchmarks of tens of GB; float types still draw normal weights).
    """
    from . import quant as Q

    def tensor(rows: int, cols: int, qt: int, name: str) -> ExpertTensor:
        q = Q.quant_type(qt, name, Q.LAYOUTS)  # any stored layout (the GPU's generic kernels read them all)
        rb = Q.row_bytes(qt, cols, name, Q.LAYOUTS)
        if exact or q.block_weights == 1:
            w = rng.standard_normal((num_experts * rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
            data = Q.quantize(w, qt).reshape(num_experts, rows * rb)
        else:
            data = rng.integers(0, 256, (num_experts, rows * rb), dtype=np.uint8)
            blocks = data.reshape(-1, q.block_bytes)
            scale = 2.0 / (q.block_weights * np.sqrt(cols))
            if qt == Q.MXFP4:  # one E8M0 exponent byte: 2^(e - 128), codes up to 12
                blocks[:, 0] = np.uint8(round(np.log2(scale)) + 128)
            for off in _SCALE_FIELDS.get(qt, ()):
                blocks[:, off:off + 2].view(np.uint16)[:] = np.float16(scale).view(np.uint16)
        return ExpertTensor(data, qt, rows, cols, f"blk.{layer}.{name}")

    dq = qtype if down_qtype is None else down_qtype
    return LayerExperts(layer, tensor(ffn, hidden, qtype, "ffn_gate_exps"), tensor(ffn, hidden, qtype, "ffn_up_exps"),
                        tensor(hidden, ffn, dq, "ffn_down_exps"))
