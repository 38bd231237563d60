"""A GGUF file's geometry as the simulator's and cost model's ``ModelSpec`` (no weights read)."""
from __future__ import annotations

from pathlib import Path

from scheduler.models import QUANT_BLOCKS, ModelSpec, load_model

from . import gguf_io

__all__ = ["model_spec", "resolve_model"]


def model_spec(path: str | Path) -> ModelSpec:
    """Geometry from a GGUF file's metadata and tensor table (quant types from the tensor table)."""
    path = Path(path)
    info = gguf_io.read_model_info(path)
    per_layer = list(info.num_experts)
    moe = [l for l, n in enumerate(per_layer) if n]
    if not moe:
        raise ValueError(f"{path}: no MoE layer in the tensor table")
    if moe != list(range(moe[0], info.num_layers)):
        raise ValueError(f"{path}: MoE layers {moe} are not a contiguous tail of the blocks; not supported")

    def common_type(pred, default):
        names = [t.qtype_name for t in info.tensors if pred(t.name)]
        return max(set(names), key=names.count) if names else default

    expert_quant = common_type(lambda n: "_exps" in n, "Q8_0")
    dense_quant = common_type(lambda n: ".attn_" in n and n.endswith(".weight") and "norm" not in n, "F16")
    known = lambda q: q if q.upper() in QUANT_BLOCKS else "F16"
    return ModelSpec(
        name=f"{info.arch}:{path.name}", num_layers=info.num_layers, num_experts=max(per_layer), top_k=info.top_k,
        hidden=info.hidden, expert_ffn=info.ffn, num_heads=info.num_heads, num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim, vocab=info.vocab, shared_ffn=info.shared_ffn, dense_ffn=info.dense_ffn,
        first_dense_layers=moe[0], expert_quant=known(expert_quant), dense_quant=known(dense_quant),
        layer_expert_bytes=tuple(info.expert_bytes), source=str(path),
    )


def resolve_model(name_or_path: str) -> ModelSpec:
    """A built-in preset by name, or an existing ``.gguf`` file's geometry."""
    if str(name_or_path).endswith(".gguf") and Path(name_or_path).exists():
        return model_spec(name_or_path)
    return load_model(name_or_path)
