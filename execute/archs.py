"""What differs between the MoE architectures moelab runs, as llama.cpp's loader reads them.

One :class:`ArchSpec` per ``general.architecture`` value, in :data:`ARCHS`. The forward pass
(``execute.model``), the float64 reference (``execute.reference``), the GGUF reader
(``execute.gguf_io``) and the synthetic writer (``execute.synth``) all read these fields; nothing
else branches on the architecture name.

Routing (``gating``), as llama.cpp's ``build_moe_ffn`` does it:

- ``softmax``: probabilities = softmax over all experts; top-k of them; weights = their
  probabilities (renormalised to sum 1 when ``norm_topk``).
- ``softmax_topk``: top-k of the logits; weights = softmax over those k logits (gpt-oss; Mixtral and
  granitemoe are ``softmax`` + renormalisation, which is the same thing).
- ``sigmoid``: scores = sigmoid(logits); selection may add a per-expert bias (``exp_probs_b``) and
  be restricted to the best expert groups; weights = the unbiased scores (deepseek2 / V3).

Then, if the file says so, weights are multiplied by ``expert_weights_scale``. Ties in a top-k go
to the lower expert id.

RoPE ``neox`` rotates dims (i, i + d/2) of a head; ``norm`` rotates (2i, 2i + 1). YaRN scaling
(``rope.scaling.type = yarn``) changes the angle of each pair and multiplies cos and sin by
``1 + 0.1 ln(factor)`` (ggml's ``rope_yarn`` with beta_fast 32, beta_slow 1, ext_factor 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ArchSpec", "ARCHS", "GATING_FUNCS", "rope_angles", "yarn_mscale"]

# llama.cpp's llama_expert_gating_func_type values, as written in {arch}.expert_gating_func
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_topk"}


@dataclass(frozen=True)
class ArchSpec:
    """Fixed traits of one architecture (file metadata may override ``gating`` and ``norm_topk``).

    ``qk_norm``: "none", "head" (an RMSNorm per head, weight ``(head_dim,)``) or "full" (one RMSNorm
    over all of q and of k, weights ``(heads*head_dim,)``). ``ffn_norm``: the tensor that norms the
    MoE input. ``shared``: "none", "plain" (a shared SwiGLU expert added to the routed output) or
    "gated" (multiplied by ``sigmoid(ffn_gate_inp_shexp . x)``). ``attn``: "gqa" or "mla".
    ``activation``: "silu" (``silu(g) * u``) or "swiglu_oai" (gpt-oss: ``g = min(g, 7)``,
    ``u = clip(u, -7, 7)``, ``g * sigmoid(1.702 g) * (u + 1)``). ``swa_pattern`` n > 0: block l uses
    the sliding window when ``l % n < n - 1``. ``granite_scales``: embedding, residual, attention
    and logit multipliers from the metadata. ``tokenizer`` and ``chat`` are what ``synth`` writes.

    How llama.cpp's loader of the architecture sizes tensors from the metadata (a file that
    disagrees is refused): ``expert_width`` is where it takes the routed experts' width from:
    "ffn" (``{arch}.feed_forward_length``), "expert" (``{arch}.expert_feed_forward_length``,
    required) or "expert_or_ffn_k" (that key, else ``feed_forward_length / expert_used_count``).
    ``q_width`` "hidden": q and the output projection are ``embedding_length`` wide, not
    ``head_count * key_length``.
    """

    name: str
    gating: str = "softmax"
    norm_topk: bool = False
    rope: str = "neox"
    qk_norm: str = "none"
    ffn_norm: str = "ffn_norm"
    shared: str = "none"
    attn: str = "gqa"
    activation: str = "silu"
    attn_bias: bool = False
    sinks: bool = False
    swa_pattern: int = 0
    granite_scales: bool = False
    tokenizer: str = "gpt2"
    chat: str = "chatml"
    expert_width: str = "expert_or_ffn_k"
    q_width: str = "heads"

    def __post_init__(self) -> None:
        for name, allowed in (("gating", ("softmax", "softmax_topk", "sigmoid")), ("rope", ("neox", "norm")),
                              ("qk_norm", ("none", "head", "full")), ("shared", ("none", "plain", "gated")),
                              ("attn", ("gqa", "mla")), ("activation", ("silu", "swiglu_oai")),
                              ("tokenizer", ("gpt2", "llama")), ("chat", ("chatml", "mistral", "harmony")),
                              ("expert_width", ("ffn", "expert", "expert_or_ffn_k")), ("q_width", ("heads", "hidden"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ArchSpec.{name}: {getattr(self, name)!r}, expected one of {allowed}")


ARCHS = {
    "qwen3moe": ArchSpec("qwen3moe", norm_topk=True, qk_norm="head"),
    "qwen2moe": ArchSpec("qwen2moe", shared="gated", attn_bias=True, q_width="hidden"),
    "olmoe": ArchSpec("olmoe", qk_norm="full", expert_width="ffn", q_width="hidden"),
    "llama": ArchSpec("llama", norm_topk=True, rope="norm", tokenizer="llama", chat="mistral", expert_width="ffn"),
    "granitemoe": ArchSpec("granitemoe", norm_topk=True, rope="norm", granite_scales=True, expert_width="ffn"),
    "gpt-oss": ArchSpec("gpt-oss", gating="softmax_topk", ffn_norm="post_attention_norm", activation="swiglu_oai",
                        attn_bias=True, sinks=True, swa_pattern=2, chat="harmony", expert_width="expert"),
    "deepseek2": ArchSpec("deepseek2", rope="norm", shared="plain", attn="mla", expert_width="expert"),
}


def yarn_mscale(factor: float, log_mul: float = 1.0) -> float:
    """YaRN's magnitude correction ``1 + 0.1 * log_mul * ln(factor)`` (1 for factor <= 1)."""
    return 1.0 + 0.1 * log_mul * math.log(factor) if factor > 1.0 else 1.0


def _yarn_ramp(dims: int, theta: float, orig_ctx: int) -> np.ndarray:
    """Per rotated pair, the share of the unscaled angle (1: keep, 0: interpolate fully)."""
    def corr(n_rot: float) -> float:
        return dims * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(0.0, math.floor(corr(32.0)))
    high = min(dims - 1.0, math.ceil(corr(1.0)))
    y = (np.arange(dims // 2) - low) / max(0.001, high - low)
    return 1.0 - np.clip(y, 0.0, 1.0)


def rope_angles(positions, dims: int, theta: float, scaling: str = "none", factor: float = 1.0,
                orig_ctx: int = 0) -> np.ndarray:
    """Rotation angles ``(len(positions), dims/2)`` float64 of pair i at each position.

    ``scaling``: "none", "linear" (positions divided by ``factor``) or "yarn" (see the module
    docstring; the magnitude factor is :func:`yarn_mscale`, applied by the caller)."""
    pos = np.asarray(positions, dtype=np.float64)[:, None]
    inv = theta ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)[None, :]  # (1, dims/2)
    if scaling == "none" or factor == 1.0:
        return pos * inv
    if scaling == "linear":
        return pos * inv / factor
    if scaling == "yarn":
        keep = _yarn_ramp(dims, theta, orig_ctx or 4096)[None, :]
        return pos * inv * (keep + (1.0 - keep) / factor)
    raise ValueError(f"rope scaling {scaling!r}: expected none, linear or yarn")
