"""Expert types the arena's kernels do not read (Q5_K, IQ4_XS, ...) on the GPU expert path: kept
as stored at load (the gate, ``quant.GPU_EXPERT_QTYPES``), run by gpu_quant.cu's ``qmoe_*``
kernels with the arena kernels' arguments; CPU tests for the gate and the kernels' interface, GPU
tests against the float64 reference of gguf's dequantized weights."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from execute import quant as Q
from execute.gpu_quant import source as gpu_quant_source
from execute.experts import ExpertTensor, LayerExperts

from .conftest import biased, biased_reference, cupy_or_skip, tiny_config

pytest.importorskip("gguf")
from execute import gguf_io, gguf_model, synth  # noqa: E402

ROOT = Path(__file__).parents[2]
GENERIC = sorted(set(Q.LAYOUTS) - set(Q.QTYPES))  # the types gpu_quant's expert kernels run
# the qmoe_* kernels dot int8 inputs of two levels per 32 values (x within d / 512, d = max|x| /
# 127: ~3e-5 relative on random blocks), the CPU pool's bound; the one-token down path is float32
REL_ERR = 2e-4


def _params(src: str, name: str) -> list[str]:
    """Parameter list of kernel ``name`` in CUDA source ``src``, whitespace and comments dropped."""
    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?' + name + r"(?:##SUFFIX)?\((.*?)\)\s*\{",
                  src, re.S)
    assert m, name
    text = m.group(1).strip()
    if re.fullmatch(r"\w+", text):  # a macro's parameter list (kernels stamped out per tiling)
        d = re.search(r"#define " + text + r" (.*?)(?<!\\)\n", src, re.S)
        assert d, text
        text = d.group(1).replace("\\\n", " ")
    text = re.sub(r"//[^\n]*", "", text).replace("unsigned char", "uint8_t")
    return [" ".join(p.split()) for p in text.split(",")]


@pytest.mark.parametrize("name", ["moe_gate_up", "moe_down", "moe1_gate_up", "moe1_down_combine"])
def test_expert_kernels_take_the_arena_kernels_arguments(name):
    """GpuExperts launches qmoe_* with the argument blocks it builds for moe_*: same parameters (or,
    for batches, gpu_quant.GENERIC_BATCH's Int8Batch: below)."""
    arena = (ROOT / "execute" / "gpu_kernels.cu").read_text()
    generic = gpu_quant_source()
    assert _params(generic, "q" + name) == _params(arena, name)
    nargs = {"moe_gate_up": 18, "moe_down": 12, "moe1_gate_up": 13, "moe1_down_combine": 10}[name]
    assert len(_params(arena, name)) == nargs + name.startswith("moe1")  # + the by-value pair table
    src = (ROOT / "execute" / "gpu_experts.py").read_text()
    assert f'qk("q{name}"), {nargs}' in src and "(Int8Batch(GENERIC_BATCH), None)" in src


def test_int8_batch_launches_take_the_kernels_arguments():
    """gpu_quant.Int8Batch launches qx8 and every int8 variant's gate/up and down kernels
    (GATE_UP_Q8_ARGS, DOWN_Q8_ARGS) with as many arguments as they take."""
    src, py = gpu_quant_source(), (ROOT / "execute" / "gpu_quant.py").read_text()
    for macro, kernel, nargs in [("GATE_UP_Q8_ARGS", '"qmoe_gate_up" + variant', 18), ("DOWN_Q8_ARGS", '"qmoe_down" + variant', 13)]:
        d = re.search(r"#define " + macro + r" (.*?)(?<!\\)\n", src, re.S)
        assert d and len(d.group(1).replace("\\\n", " ").split(",")) == nargs, macro
        assert f"kernel({kernel}, defines), {nargs})" in py
    assert len(_params(src, "qx8")) == 5 and 'kernel("qx8", defines), 5)' in py


def test_gate_keeps_gpu_read_cpu_types_raw(tmp_path, monkeypatch):
    """Every CPU type is kept as stored for runs that may use the GPU (the GPU expert path reads
    it); a type without a CPU kernel is still dequantized to F16 at load."""
    assert set(Q.QTYPES) <= Q.GPU_EXPERT_QTYPES and set(Q.CPU_QTYPES) <= Q.GPU_EXPERT_QTYPES
    path = synth.synth_model(tmp_path / "q5km.gguf", tiny_config("Q5_K", down_quant="Q6_K", num_layers=1,
                                                                 hidden=256, ffn=256))
    w = gguf_model.load_model(path)
    layer = w.experts[0]
    assert (layer.gate.qtype, layer.up.qtype, layer.down.qtype) == (Q.Q5_K, Q.Q5_K, Q.Q6_K)
    assert np.shares_memory(layer.gate.data, w.reader.data)
    assert w.info.expert_bytes == gguf_io.read_model_info(path).expert_bytes  # what moves is what is stored
    paths = gguf_io.qtype_paths(gguf_io.read_model_info(path))
    assert paths["Q5_K"] == "experts: CPU kernel, generic GPU kernel (no token graph)"
    monkeypatch.setattr(Q, "CPU_QTYPES", {t: q for t, q in Q.CPU_QTYPES.items() if t != Q.IQ1_S})  # every layout has one
    iq = synth.synth_model(tmp_path / "iq.gguf", tiny_config("Q4_K", down_quant="IQ1_S", num_layers=1,
                                                             hidden=256, ffn=256))
    assert gguf_model.load_model(iq).experts[0].down.qtype == Q.F16


def test_a_type_left_out_of_the_gate_is_converted_at_load(tmp_path, monkeypatch):
    path = synth.synth_model(tmp_path / "q5k.gguf", tiny_config("Q5_K", num_layers=1, hidden=256, ffn=256))
    monkeypatch.setattr(Q, "GPU_EXPERT_QTYPES", Q.GPU_EXPERT_QTYPES - {Q.Q5_K})
    assert gguf_model.load_model(path).experts[0].gate.qtype == Q.F16
    assert gguf_model.load_model(path, cpu_only=True).experts[0].gate.qtype == Q.Q5_K


def layer_of(rng, qt: int, down_qt: int | None = None, n: int = 5, hidden: int = 512, ffn: int = 256,
             layer: int = 0) -> LayerExperts:
    """Random valid blocks of ``qt`` (gate, up) and ``down_qt`` (down; default ``qt``), their f16
    scales chosen for weights of RMS about 2 / sqrt(cols) (outputs of order 1)."""
    def tensor(rows, cols, t, name):
        probe = Q.dequantize(Q.random_blocks(np.random.default_rng(0), t, 16, cols, 1.0), t, cols)
        scale = 2.0 / np.sqrt(cols) / np.sqrt((probe.astype(np.float64) ** 2).mean())
        return ExpertTensor(Q.random_blocks(rng, t, n * rows, cols, scale).reshape(n, -1), t, rows, cols, name=name)

    d = qt if down_qt is None else down_qt
    return LayerExperts(layer, tensor(ffn, hidden, qt, "gate"), tensor(ffn, hidden, qt, "up"),
                        tensor(hidden, ffn, d, "down"))


def test_layer_of_matches_the_cpu_kernels(rng, reference):
    """The random layers the GPU tests use are valid (the CPU pool's kernels agree on them)."""
    from execute.cpu_experts import run_experts

    layer = layer_of(rng, Q.Q5_K, Q.Q6_K)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    ref = reference(layer, [0, 4, 4], x)
    y = run_experts(layer, [0, 4, 4], x, threads=2)
    assert np.isfinite(ref).all() and np.linalg.norm(y - ref) <= 2e-4 * np.linalg.norm(ref)


# GPU --------------------------------------------------------------------------------------------
def make(layers, slots, scratch=2):
    from execute.gpu_experts import GpuExperts
    from scheduler.core import Capacity, Geometry

    geo = Geometry(tuple(l.num_experts for l in layers), 2, tuple(l.expert_bytes for l in layers))
    return GpuExperts(layers, Capacity.per_layer(geo, slots), scratch_slots=scratch)


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _both_paths(gx, layer, rng, reference, ref_fn=None):
    """Batch path (slots and scratch, 5 tokens on one expert) and one-token path of layer 0 of
    ``gx`` against the float64 reference."""
    import cupy as cp

    from execute.gpu_experts import scratch_source

    ref_fn = ref_fn or (lambda e, x: reference(layer, e, x))
    gx.begin_copies()
    for e, s in [(4, 0), (1, 1)]:
        gx.upload(layer.layer, e, s)
    k = gx.stream(layer.layer, 3)
    ev = gx.copies_event()
    src = {4: 0, 1: 1, 3: scratch_source(k)}
    experts = [4, 1, 4, 3, 4, 4, 3, 4]
    x = rng.standard_normal((3, layer.hidden)).astype(np.float32)
    xrow = [0, 1, 2, 0, 1, 2, 2, 0]
    out = cp.full((len(experts), layer.hidden), cp.nan, cp.float32)
    y = gx.run(layer.layer, [src[e] for e in experts], cp.asarray(x), xrow, wait=[ev], out=out)
    assert rel_err(y.get(), ref_fn(experts, x[xrow])) < REL_ERR
    ids, w = [3, 4, 1], [0.5, 0.3, 0.2]
    gx.compute_after_copies()
    gx.pack1([gx.source_ptr(layer.layer, src[e]) for e in ids], w, [0, 1, 2])
    xd = gx.as_input(cp.asarray(x[:1]))
    gx.after_caller()  # the one-token calls leave the caller's stream to the caller
    gx.gate_up1(layer.layer, xd, len(ids), len(ids))
    one = gx.down_combine1(layer.layer, len(ids))
    gx.to_caller()
    one = one.get()
    want = (np.asarray(w)[:, None] * ref_fn(ids, np.repeat(x[:1], 3, axis=0))).sum(axis=0, keepdims=True)
    assert rel_err(one, want) < REL_ERR


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", GENERIC, ids=[Q.LAYOUTS[t].name for t in GENERIC])
def test_generic_layer_matches_reference(qtype, rng, reference):
    cupy_or_skip()
    layer = layer_of(rng, qtype)
    gx = make([layer], slots=2)
    try:
        assert gx.generic_layers == {0}
        assert gx.slot_bytes[0] == -(-layer.expert_bytes // 256) * 256  # stored bytes, not F16's
        _both_paths(gx, layer, rng, reference)
    finally:
        gx.close()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.IQ4_XS, Q.Q2_K], ids=["Q5_K", "IQ4_XS", "Q2_K"])
def test_generic_layer_int8_batches(qtype, rng, reference, monkeypatch):
    """gpu_quant.GENERIC_BATCH set to an int8 variant: the generic layer's batches run Int8Batch (its
    inputs as two int8 levels, the one-token path's bound) against the float64 reference."""
    cupy_or_skip()
    import execute.gpu_quant as GQ

    monkeypatch.setattr(GQ, "GENERIC_BATCH", "_q8m2")
    layer = layer_of(rng, qtype)
    gx = make([layer], slots=2)
    try:
        assert isinstance(gx._kl[0][0], GQ.Int8Batch) and gx._kl[0][1] is None
        _both_paths(gx, layer, rng, reference)
    finally:
        gx.close()


@pytest.mark.gpu
def test_generic_and_arena_layers_side_by_side(rng, reference):
    """A Q5_K/Q6_K layer (Q5_K_M-style) beside a Q4_K/Q6_K one: each runs on its kernels, the
    arena layer keeps the arena's launches, and the token graph refuses the generic layer."""
    cupy_or_skip()
    from execute.experts import ExecutorError

    arena = layer_of(rng, Q.Q4_K, Q.Q6_K, layer=0)
    generic = layer_of(rng, Q.Q5_K, Q.Q6_K, layer=1)
    gx = make([arena, generic], slots=2)
    try:
        assert gx.generic_layers == {1}
        assert gx._kl[0] == (gx._k_gate_up, gx._k_down, gx._k1_gate_up, gx._k1_down) and gx._kl[1][0] is not gx._k_gate_up
        _both_paths(gx, arena, rng, reference)
        _both_paths(gx, generic, rng, reference)
        with pytest.raises(ExecutorError, match="block by block"):
            gx.routed_layer(1, 0, 0, 0, 0, 0, 0, 2)
    finally:
        gx.close()


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_generic_layer_biases_and_activation(activation, rng, reference):
    cupy_or_skip()
    layer = biased(layer_of(rng, Q.Q5_0, hidden=256, ffn=512), rng, activation)
    gx = make([layer], slots=2)
    try:
        _both_paths(gx, layer, rng, reference, lambda e, x: biased_reference(layer, e, x)[0])
    finally:
        gx.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy, slots", [("gpu", 8), ("lru", 2), ("hybrid", 3)])
def test_q5_k_m_model_on_the_gpu_matches_reference(policy, slots, tmp_path):
    """A Q5_K_M-style file loaded as stored runs decode tokens on the GPU (no token graph) to the
    float64 reference's logits."""
    cupy_or_skip()
    from execute import model as M
    from execute.reference import reference_forward
    from scheduler import Capacity, make_policy

    path = synth.synth_model(tmp_path / "q5km.gguf", tiny_config("Q5_K", down_quant="Q6_K", hidden=256, ffn=256))
    w = gguf_model.load_model(path)
    assert {x.gate.qtype for x in w.experts if x is not None} == {Q.Q5_K}
    tokens = [5, 300, 17, 17, 42, 256, 1]
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True, timeout_s=120)
    try:
        model = M.MoeModel(w, use_gpu=True, max_tokens=16)
        assert backend.engine.gpu.generic_layers and backend.token_graph(model) is None
        inputs = [M.TokenInput(i, 0, i, "decode", t, None) for i, t in enumerate(tokens)]
        res = M.run(model, backend, make_policy(policy, g, cap), inputs, keep_logits=True)
    finally:
        backend.close()
    got, ref = np.stack(res.logits).astype(np.float64), reference_forward(w, tokens)[0]
    assert ((got - ref) ** 2).sum() / (ref ** 2).sum() <= 1e-4
