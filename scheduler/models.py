"""Model geometry: layer and expert shapes, quant types and their byte sizes.

A :class:`ModelSpec` describes what the simulator charges for: routed experts (bytes from the quant
type), the dense part of each layer (attention, router, shared expert) and the KV cache that
attention reads at the current context length. Built-in presets live in
``scheduler/presets/models.json`` with the source of every number. A GGUF file's geometry is read by
the executor (``execute.model_spec.model_spec``), which maps its tensor table onto a ModelSpec.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from .core import Geometry

__all__ = ["ModelSpec", "QUANT_BLOCKS", "quant_bytes", "MODEL_PRESETS", "load_model", "PRESETS_DIR"]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

# quant type -> (weights per block, bytes per block); GGML's block structs (ggml-common.h).
QUANT_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q8_1": (32, 40), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "Q8_K": (256, 292), "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
    "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
}


def quant_bytes(quant: str, num_weights: int) -> int:
    """Bytes of ``num_weights`` weights in ``quant`` (whole blocks; ValueError on unknown types)."""
    try:
        per_block, block_bytes = QUANT_BLOCKS[quant.upper()]
    except KeyError:
        raise ValueError(f"unknown quant type {quant!r}; expected one of {', '.join(QUANT_BLOCKS)}") from None
    return -(-int(num_weights) // per_block) * block_bytes


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a MoE model, as far as decode cost goes.

    Routed experts are SwiGLU FFNs (gate, up: ``expert_ffn x hidden``; down: ``hidden x
    expert_ffn``). Layers ``< first_dense_layers`` are dense (FFN ``dense_ffn``). One layer in
    ``full_attention_every`` keeps a growing KV cache; the others cost a constant per token.
    ``layer_expert_bytes`` (from a GGUF file) overrides the per-layer expert size.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden: int
    expert_ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    shared_ffn: int = 0
    dense_ffn: int = 0
    first_dense_layers: int = 0
    full_attention_every: int = 1
    kv_elems_per_token: int = 0  # 0: 2 * num_kv_heads * head_dim
    kv_elem_bytes: int = 2  # f16 KV cache
    expert_quant: str = "Q8_0"
    dense_quant: str = "Q8_0"
    layer_expert_bytes: tuple[int, ...] = ()
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "hidden", "expert_ffn", "num_heads", "num_kv_heads",
                     "head_dim", "vocab", "full_attention_every", "kv_elem_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelSpec {self.name}: {name} = {getattr(self, name)}, expected >= 1")
        for name in ("shared_ffn", "dense_ffn", "first_dense_layers", "kv_elems_per_token"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"ModelSpec {self.name}: {name} = {getattr(self, name)}, expected >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelSpec {self.name}: top_k {self.top_k} > num_experts {self.num_experts}")
        if self.first_dense_layers >= self.num_layers:
            raise ValueError(f"ModelSpec {self.name}: first_dense_layers {self.first_dense_layers} leaves no MoE layer")
        for name in ("expert_quant", "dense_quant"):
            q = str(getattr(self, name)).upper()
            if q not in QUANT_BLOCKS:
                raise ValueError(f"ModelSpec {self.name}: {name} = {q!r}, expected one of {', '.join(QUANT_BLOCKS)}")
            object.__setattr__(self, name, q)
        lb = tuple(int(b) for b in self.layer_expert_bytes)
        if lb and (len(lb) != self.num_layers or any(b < 0 for b in lb)):
            raise ValueError(f"ModelSpec {self.name}: layer_expert_bytes needs {self.num_layers} entries >= 0")
        object.__setattr__(self, "layer_expert_bytes", lb)

    # shapes ----------------------------------------------------------------------------------
    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate + up + down)."""
        return 3 * self.hidden * self.expert_ffn

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense_layers

    def expert_bytes(self, layer: int) -> int:
        """Bytes of one routed expert of ``layer`` (0 on a dense layer)."""
        if not self.is_moe(layer):
            return 0
        if self.layer_expert_bytes:
            return self.layer_expert_bytes[layer]
        return quant_bytes(self.expert_quant, self.expert_params)

    def geometry(self) -> Geometry:
        """The scheduler's view: experts and expert bytes per layer."""
        n = tuple(self.num_experts if self.is_moe(l) else 0 for l in range(self.num_layers))
        return Geometry(n, self.top_k, tuple(self.expert_bytes(l) for l in range(self.num_layers)))

    def attn_params(self) -> int:
        """Weights of one layer's attention projections (q, o and k, v)."""
        return 2 * self.hidden * self.num_heads * self.head_dim + 2 * self.hidden * self.num_kv_heads * self.head_dim

    def dense_bytes(self, layer: int) -> int:
        """Bytes the GPU reads per token for one layer's non-routed weights (attention, router,
        shared expert, or the dense FFN of a dense layer)."""
        params = self.attn_params()
        if self.is_moe(layer):
            params += self.hidden * self.num_experts + 3 * self.hidden * self.shared_ffn
        else:
            params += 3 * self.hidden * self.dense_ffn
        return quant_bytes(self.dense_quant, params)

    def kv_bytes_per_position(self, layer: int) -> int:
        """KV-cache bytes one context position adds to ``layer`` (0 where attention is linear or
        windowed: their per-token cost is in ``dense_bytes``)."""
        if (layer + 1) % self.full_attention_every:
            return 0
        elems = self.kv_elems_per_token or 2 * self.num_kv_heads * self.head_dim
        return elems * self.kv_elem_bytes

    def head_bytes(self) -> int:
        """Bytes of the output projection read once per token."""
        return quant_bytes(self.dense_quant, self.hidden * self.vocab)

    def total_expert_bytes(self) -> int:
        return sum(self.expert_bytes(l) * self.num_experts for l in range(self.num_layers))

    def with_quant(self, expert_quant: str | None = None, dense_quant: str | None = None) -> "ModelSpec":
        """The same model with other quant types (per-layer GGUF sizes are dropped)."""
        return replace(self, expert_quant=expert_quant or self.expert_quant,
                       dense_quant=dense_quant or self.dense_quant, layer_expert_bytes=())


@lru_cache(maxsize=1)
def _preset_data() -> dict:
    return json.loads((PRESETS_DIR / "models.json").read_text())["models"]


def _preset_names() -> tuple[str, ...]:
    return tuple(_preset_data())


MODEL_PRESETS = _preset_names()


def load_model(name: str) -> ModelSpec:
    """A built-in preset by name (a ``.gguf`` file's geometry: ``execute.model_spec``)."""
    data = _preset_data()
    key = str(name).lower()
    if key in data:
        fields = {k: v for k, v in data[key].items()}
        return ModelSpec(name=key, **fields)
    raise ValueError(f"unknown model {name!r}: expected a preset ({', '.join(data)}) or a .gguf file path")
