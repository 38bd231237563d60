"""Every supported architecture: tiny synthetic GGUFs with quantized experts, the executor's logits
against the float64 reference, metadata as llama.cpp reads it, clear errors for files moelab cannot
run, and (gpu) hybrid vs all-CPU vs all-GPU agreement."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from execute import model as M
from execute.archs import ARCHS
from execute.gguf_io import GGUFError, read_model_info, write_gguf
from execute.gguf_model import load_model
from execute.reference import reference_forward
from execute.synth import config_from_preset, metadata, synth_model, tensor_specs
from scheduler import Capacity, make_policy
from scheduler.audit import Audit

from .conftest import cupy_or_skip, run_json

ALL = tuple(ARCHS)
QUANT = {"qwen3moe": "Q8_0", "qwen2moe": "Q4_0", "olmoe": "Q8_0", "llama": "Q4_0", "granitemoe": "Q8_0",
         "gpt-oss": "Q8_0", "deepseek2": "Q4_0"}  # quantized experts; K-quants are covered by test_model
# gpt-oss as its real GGUF files store it: MXFP4 experts ("arch/QUANT" names a case with another quant)
OSS_MXFP4 = "gpt-oss/MXFP4"
CASES = ALL + (OSS_MXFP4,)
TOKENS = [5, 300, 17, 17, 42, 256, 1, 9, 100]  # longer than gpt-oss's window of 4


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def arch_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    made = {}

    def get(case: str):
        if case not in made:
            arch, _, quant = case.partition("/")
            made[case] = synth_model(root / f"{arch}_{quant}.gguf",
                                     config_from_preset("tiny", arch=arch, quant=quant or QUANT[arch], seed=11))
        return made[case]

    return get


@pytest.fixture(scope="module")
def arch_weights(arch_path):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load_model(arch_path(arch))
        return cache[arch]

    return get


def run_tokens(weights, backend=None, policy="cpu", slots=0, use_gpu=False, tokens=TOKENS):
    g = weights.info.geometry()
    pol = make_policy(policy, g, Capacity.per_layer(g, slots))
    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    audit = Audit(g, keep_log=True, record_routes=True)
    res = M.run(M.MoeModel(weights, use_gpu=use_gpu), backend or M.NumpyExperts(weights), pol, inputs,
                audit=audit, keep_logits=True)
    return np.stack(res.logits), audit


@pytest.mark.parametrize("arch", CASES)
def test_logits_match_float64_reference(arch, arch_weights):
    w = arch_weights(arch)
    got, audit = run_tokens(w)
    ref, used = reference_forward(w, TOKENS)
    assert np.isfinite(got).all() and got.shape == (len(TOKENS), w.info.vocab)
    assert nmse(got, ref) <= 1e-6
    routes = [[tuple(r[1]) for r in rec["routes"]] for rec in audit.records]
    assert routes == [[u[0] for u in row if u is not None] for row in used]
    weights = [[r[2] for r in rec["routes"]] for rec in audit.records]
    np.testing.assert_allclose(np.array(weights), np.array([[u[1] for u in row if u is not None] for row in used]), rtol=1e-5)


@pytest.mark.parametrize("arch, change", [
    ("gpt-oss", {"sliding_window": 0}), ("gpt-oss", {"rope_scaling": "none"}), ("granitemoe", {"residual_scale": 1.0}),
    ("granitemoe", {"logit_scale": 1.0}), ("deepseek2", {"expert_weights_scale": 0.0}), ("deepseek2", {"gating": "softmax"}),
    ("qwen2moe", {"norm_topk": True}), ("llama", {"rope_theta": 500.0}),
])
def test_reference_check_sees_each_feature(arch, change, arch_weights):
    """The agreement above is not vacuous: dropping one arch feature in the executor breaks it."""
    w = arch_weights(arch)
    off = dataclasses.replace(w, info=dataclasses.replace(w.info, **change))
    got, _ = run_tokens(off)
    ref, _ = reference_forward(w, TOKENS)
    assert nmse(got, ref) > 1e-5


@pytest.mark.parametrize("arch", ("qwen2moe", "llama", "deepseek2", "gpt-oss", OSS_MXFP4))
def test_engine_cpu_path_matches_reference(arch, arch_weights):
    w = arch_weights(arch)
    backend = M.EngineExperts(w, Capacity.per_layer(w.info.geometry(), 0), threads=2, use_gpu=False, timeout_s=120)
    try:
        got, _ = run_tokens(w, backend)
    finally:
        backend.close()
    assert nmse(got, reference_forward(w, TOKENS)[0]) <= 1e-6


def test_metadata_as_llama_cpp_reads_it(arch_path):
    info = {a: read_model_info(arch_path(a)) for a in ALL}
    assert info["qwen3moe"].norm_topk and not info["qwen2moe"].norm_topk and not info["olmoe"].norm_topk
    assert info["qwen2moe"].shared_ffn == 64 and info["deepseek2"].shared_ffn == 32
    assert info["gpt-oss"].gating == "softmax_topk" and info["gpt-oss"].sliding_window == 4
    assert info["gpt-oss"].is_swa(0) and not info["gpt-oss"].is_swa(1) and info["gpt-oss"].rope_scaling == "yarn"
    assert info["gpt-oss"].expert_bias and info["granitemoe"].tied_output
    g = info["granitemoe"]
    assert (g.embedding_scale, g.residual_scale, g.logit_scale) == pytest.approx((12.0, 0.22, 6.0))
    d = info["deepseek2"]
    assert d.num_experts == (0, 8) and d.gating == "sigmoid" and (d.expert_groups, d.expert_groups_used) == (4, 2)
    assert (d.q_lora_rank, d.kv_lora_rank, d.rope_dims, d.v_head_dim) == (32, 32, 8, 16)
    assert d.expert_weights_scale == pytest.approx(2.5) and d.norm_topk and d.leading_dense == 1
    assert info["llama"].spec.rope == "norm" and info["olmoe"].spec.qk_norm == "full"


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", [("mamba.block_count", 1, "u32")], [])
    with pytest.raises(GGUFError, match=r"mamba\.gguf.*'mamba'.*supported: qwen3moe"):
        read_model_info(path)


def test_missing_tensor_is_named(tmp_path):
    cfg = config_from_preset("tiny", arch="gpt-oss", quant="Q8_0")
    path = tmp_path / "nosinks.gguf"
    write_gguf(path, cfg.arch, metadata(cfg), [t for t in tensor_specs(cfg) if t.name != "blk.1.attn_sinks.weight"])
    with pytest.raises(GGUFError, match=r"nosinks\.gguf: tensor 'blk\.1\.attn_sinks\.weight' missing"):
        load_model(path)


def test_engine_cpu_path_runs_gpt_oss_experts_like_numpy(arch_weights):
    """gpt-oss's biased, clamped experts on the CPU pool agree with the numpy backend; the layers
    carry the biases and activation the pool computes with."""
    w = arch_weights("gpt-oss")
    lx = next(l for l in w.experts if l is not None)
    assert lx.activation == "swiglu_oai" and lx.has_bias and lx.down_bias.shape == (lx.num_experts, lx.hidden)
    backend = M.EngineExperts(w, Capacity.per_layer(w.info.geometry(), 0), threads=2, use_gpu=False, timeout_s=120)
    try:
        got, audit = run_tokens(w, backend)
    finally:
        backend.close()
    ref, ref_audit = run_tokens(w)
    assert nmse(got, ref) <= 1e-6 and audit.digest() == ref_audit.digest()


def test_moelab_run_mxfp4_gpt_oss_on_the_cpu_pool(arch_path, capsys):
    """``moelab run --policy cpu`` computes gpt-oss's MXFP4 experts on the Numba pool: the numpy
    backend's text and decisions; the experts really are MXFP4 with a 17-byte-block expert size."""
    path = arch_path(OSS_MXFP4)
    info = read_model_info(path)
    assert {q for n, q in info.expert_qtypes().items() if n.endswith("_exps.weight")} == {"MXFP4"}
    engine, fig = run_json(capsys, path, "-p", "Hello there", "-n", "6", "--backend", "engine", "--policy", "cpu")
    numpy, fig_np = run_json(capsys, path, "-p", "Hello there", "-n", "6", "--backend", "numpy")
    assert engine == numpy and fig["digest"] == fig_np["digest"] and fig["cpu"] > 0


def test_expert_size_counts_the_biases(arch_weights):
    """An upload moves a gpt-oss expert's biases too: the file's expert size (the scheduler's and
    the simulator's) is the loaded layer's."""
    for arch in ("gpt-oss", "qwen3moe", OSS_MXFP4):
        w = arch_weights(arch)
        moe = [l for l in w.experts if l is not None]
        assert [l.expert_bytes for l in moe] == [b for b in w.info.expert_bytes if b]
        assert all((l.bias_bytes > 0) == arch.startswith("gpt-oss") for l in moe)


# GPU: hybrid vs all-CPU vs all-GPU --------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("arch", CASES)
def test_hybrid_cpu_gpu_agree(arch, arch_weights):
    cupy_or_skip()
    w = arch_weights(arch)
    g = w.info.geometry()
    out = {}
    for policy, slots in (("cpu", 0), ("gpu", 8), ("hybrid", 3), ("lru", 2)):
        cap = Capacity.per_layer(g, slots)
        backend = M.EngineExperts(w, cap, threads=2, use_gpu=policy != "cpu", timeout_s=120)
        try:
            out[policy], _ = run_tokens(w, backend, policy, slots, use_gpu=policy != "cpu")
        finally:
            backend.close()
    ref = reference_forward(w, TOKENS)[0]
    for policy in ("gpu", "hybrid", "lru"):
        assert nmse(out[policy], out["cpu"]) <= 1e-4, policy
    assert nmse(out["cpu"], ref) <= 1e-4
