"""execute.gpu_quant: dequantize-and-multiply of every layout against the numpy dequantizer.

The quantized types run on int8 inputs of two levels per 32 values (gpu_quant.cu's header):
x = d / 256 (256 q1 + q2) within d / 512, d = max|x| / 127, as the CPU pool's kernels, so their
products carry the CPU path's bound REL_ERR_INT8 (measured ~1e-5 on random blocks; NMSE ~1e-10);
float types and the one-token down projection (float32 inputs) keep 1e-5."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from execute import quant as Q
from execute.gpu_quant import BATCH_VARIANTS
from execute.gpu_quant import source as gpu_quant_source

ROOT = Path(__file__).parents[2]
ALL = sorted(Q.LAYOUTS)
FLOAT = (Q.F32, Q.F16, Q.BF16)
QUANT = [t for t in ALL if t not in FLOAT]
REL_ERR = 1e-5
REL_ERR_INT8 = 2e-4


def test_kernels_decode_every_layout():
    """gpu_quant.cu dispatches every quantized type of quant.LAYOUTS to its chunk decoder and reads
    the float types weight by weight; its block constants agree with quant.LAYOUTS."""
    from execute.gpu_quant import FLOAT_QTYPES

    src = gpu_quant_source()
    assert set(FLOAT_QTYPES) == set(FLOAT)
    assert {int(c) for c in re.findall(r"case (\d+): return", src)} == set(FLOAT)
    assert {int(c) for c in re.findall(r"C\((\d+)\)", src)} == set(QUANT)
    decoded = {int(c) for c in re.findall(r"QT == (\d+)", src[src.index("dec32"):src.index("dot_staged")])}
    assert decoded == set(QUANT)


def test_tables_fit_the_kernels_declarations():
    """Each uploaded table fills its declaration; IQ2/IQ3 grid bytes are nonzero (sign8 negates
    bytes without borrows only then)."""
    from execute.gpu_quant import tables

    src = gpu_quant_source()
    for name, arr in tables().items():
        m = re.search(r"(uint32_t|uint8_t) " + name + r"\[([0-9 *]+)\];", src)
        assert m, name
        assert arr.nbytes == eval(m.group(2)) * (4 if m.group(1) == "uint32_t" else 1), name
        if name.startswith(("g_iq2", "g_iq3")):
            assert arr.min() > 0, name


def _stage(x: np.ndarray):
    """gpu_quant.cu's stage(): two int8 levels per 32 values, d / 256 and the staged values' sums per 16."""
    v = x.reshape(-1, 32).astype(np.float32)
    m = np.abs(v).max(axis=1, keepdims=True)
    d = m / np.float32(127)
    inv = np.where(m > 0, np.float32(127) / np.where(m > 0, m, 1), 0).astype(np.float32)
    q1 = np.rint(v * inv)
    q2 = np.clip(np.rint((v - d * q1) * inv * np.float32(256)), -127, 127)
    s16 = (d * (q1 + q2 / np.float32(256))).astype(np.float32).reshape(-1, 2, 16).sum(axis=2, dtype=np.float32)
    return q1.astype(np.int8), q2.astype(np.int8), (d / np.float32(256)).ravel(), s16


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    """gpu_quant.cu's decoders built for the host by nvcc."""
    assert shutil.which("nvcc"), "nvcc (the CUDA toolkit) builds gpu_quant.cu's decoders for the host"
    d = tmp_path_factory.mktemp("hostcheck")
    harness = (Path(__file__).parent / "gpu_quant_host.cu").read_text()
    (d / "h.cu").write_text(harness.replace("GPU_QUANT_CU", str(ROOT / "execute" / "gpu_quant.cu")))
    subprocess.run(["nvcc", "-x", "cu", "-o", str(d / "h"), str(d / "h.cu")], check=True, capture_output=True)
    return d / "h"


@pytest.mark.parametrize("qtype", QUANT, ids=[Q.LAYOUTS[t].name for t in QUANT])
def test_chunk_decoders_on_the_host(qtype, host_decoders, rng):
    """Every chunk decoder gives gguf's dequantized weights (w = a q + b), its float dot the float64
    product, its staged int8 dot the product within the inputs' rounding, on blocks at odd addresses."""
    from execute.gpu_quant import tables

    q = Q.LAYOUTS[qtype]
    rows, cols = 4, 512
    raw = Q.random_blocks(rng, qtype, rows, cols, scale=0.05)
    ref = Q.dequantize(raw, qtype, cols).astype(np.float64).reshape(-1, 32)
    x = rng.standard_normal(ref.size).astype(np.float32).reshape(-1, 32)
    q1, q2, dxs, s16 = _stage(x)
    per = np.concatenate([x.view(np.uint8), q1.view(np.uint8), q2.view(np.uint8), dxs.view(np.uint8).reshape(-1, 4),
                          s16.view(np.uint8)], axis=1)
    tab = b"".join(np.ascontiguousarray(a).tobytes() for a in tables().values())
    nb = raw.size // q.block_bytes
    inp = np.array([qtype, nb], np.int32).tobytes() + tab + raw.tobytes() + per.tobytes()
    out = subprocess.run([str(host_decoders)], input=inp, capture_output=True, check=True).stdout
    got = np.frombuffer(out, np.float32).reshape(-1, 34).astype(np.float64)
    scale = np.abs(ref).max()
    assert np.abs(got[:, :32] - ref).max() <= 1e-6 * scale
    want = (ref * x).sum(axis=1)
    assert np.linalg.norm(got[:, 32] - want) <= REL_ERR * np.linalg.norm(want)
    assert np.linalg.norm(got[:, 33] - want) <= REL_ERR_INT8 * np.linalg.norm(want)


@pytest.fixture(scope="module")
def emulated_kernels(tmp_path_factory):
    """gpu_quant.cu's kernels built for the host with the SIMT emulation of gpu_quant_simt.h (g++)."""
    assert shutil.which("g++"), "g++ builds gpu_quant.cu's kernels with the SIMT emulation for the host"
    exe = tmp_path_factory.mktemp("emu") / "emu"
    here = Path(__file__).parent
    src = f'-DGPU_QUANT_CU="{ROOT / "execute" / "gpu_quant.cu"}"'
    subprocess.run(["g++", "-O1", "-std=c++17", "-pthread", f"-I{here}", src, "-o", str(exe), str(here / "gpu_quant_emu.cpp")],
                   check=True, capture_output=True)
    blocks = np.zeros((64, 2), np.int32)
    for t, q in Q.LAYOUTS.items():
        blocks[t] = (q.block_weights, q.block_bytes)
    from execute.gpu_quant import tables

    pre = b"".join(np.ascontiguousarray(a).tobytes() for a in tables().values()) + blocks.tobytes()
    return lambda inp: subprocess.run([str(exe)], input=pre + inp, capture_output=True, check=True, timeout=600).stdout


# the emulation is slow (a thread per CUDA thread, barriers for every shuffle): three types' matmul
# by default, every type and the expert kernels with -m slow
COMMON = (Q.Q4_K, Q.Q6_K, Q.IQ4_XS)
EMULATED = [pytest.param(t, id=Q.LAYOUTS[t].name, marks=() if t in COMMON else pytest.mark.slow) for t in ALL]


@pytest.mark.parametrize("qtype", EMULATED)
def test_emulated_matmul_kernels(qtype, emulated_kernels, rng):
    """qmatmul_q1 (1 token), qmatmul_q (11 tokens: passes of 8 and 3; 3 input tiles of 1024, 1024,
    256) and qmatmul_f, emulated on the host, against the float64 reference (24 rows: 3 blocks)."""
    rows, cols = 24, 2304
    raw = Q.random_blocks(rng, qtype, rows, cols, scale=0.05)
    w = Q.dequantize(raw, qtype, cols).astype(np.float64)
    for n in (1, 11):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        inp = np.array([0, qtype, rows, cols, n], np.int32).tobytes() + np.int64(raw.shape[1]).tobytes()
        y = np.frombuffer(emulated_kernels(inp + raw.tobytes() + x.tobytes()), np.float32).reshape(n, rows)
        bound = REL_ERR if qtype in FLOAT else REL_ERR_INT8
        assert np.isfinite(y).all() and np.linalg.norm(y - ref) <= bound * np.linalg.norm(ref)


EMULATED_EXPERTS = [(t, t, t) for t in QUANT] + [(Q.Q4_K, Q.Q5_K, Q.Q6_K)]


def _emulate_experts(emulated_kernels, rng, qtypes, modes):
    """The expert kernels of ``modes`` (gpu_quant_emu.cpp: 1 one token with 2 down rows per block, 3
    with 4 and gate/up's _w tiles, 2 batches of 11 tokens, 4 .. 11 the same by the int8 variants _q8,
    _q8m2, _q8m1, _q8s2, _q8s1, _q8p, _q8p2, _q8px) on 2 experts,
    emulated on the host, against the float64 reference."""
    num_e, ffn, hidden = 2, 256, 512
    parts = _expert_parts(rng, qtypes, num_e, ffn, hidden)
    w = np.concatenate([p.reshape(num_e, -1) for p in parts], axis=1)
    wts = np.array([0.6, 0.4], np.float32)
    head = np.array(qtypes, np.int32).tobytes()
    for mode in modes:
        tokens = 1 if mode in (1, 3) else 11
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ys = _expert_outputs64(parts, qtypes, x, ffn, hidden)
        ref = np.concatenate(ys) if tokens > 1 else sum(float(wts[e]) * ys[e] for e in range(num_e))
        inp = (np.array([mode], np.int32).tobytes() + head + np.array([num_e, ffn, hidden, tokens], np.int32).tobytes()
               + np.array([p.shape[2] for p in parts], np.int64).tobytes() + wts.tobytes() + w.tobytes() + x.tobytes())
        y = np.frombuffer(emulated_kernels(inp), np.float32).reshape(ref.shape)
        assert np.isfinite(y).all() and np.linalg.norm(y - ref) <= REL_ERR_INT8 * np.linalg.norm(ref), f"mode {mode}"


@pytest.mark.slow
@pytest.mark.parametrize("qtypes", EMULATED_EXPERTS, ids=["-".join(Q.LAYOUTS[t].name for t in m) for m in EMULATED_EXPERTS])
def test_emulated_expert_kernels(qtypes, emulated_kernels, rng):
    """qmoe1_gate_up + qmoe1_down_combine (one token; 2 and 4 down rows per block) and qmoe_gate_up +
    qmoe_down (11 tokens through each), emulated on the host, against the float64 reference."""
    _emulate_experts(emulated_kernels, rng, qtypes, (1, 3, 2, *range(4, 12)))


@pytest.mark.slow
@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q5_K, Q.Q6_K), (Q.Q8_0, Q.IQ4_XS, Q.Q4_1)], ids=["Q4_K-Q5_K-Q6_K", "Q8_0-IQ4_XS-Q4_1"])
def test_emulated_int8_batched_kernels(qtypes, emulated_kernels, rng):
    """qx8 + qmoe_gate_up_q8 + qx8 + qmoe_down_q8 (and _q8m2, _q8m1, _q8s2, _q8s1, _q8p, _q8p2, _q8px: 64, 32, 16 rows a block; 11 tokens
    through each expert) emulated on the host: gate and up of scale-per-16 and per-32 types in one
    block, the offsets of Q4_1, against the float64 reference (about 10 s a mode: slow)."""
    _emulate_experts(emulated_kernels, rng, qtypes, tuple(range(4, 12)))


@pytest.mark.parametrize("qtypes", [(Q.Q4_K,) * 3, (Q.Q4_K, Q.Q5_K, Q.Q6_K)], ids=["Q4_K", "Q4_K-Q5_K-Q6_K"])
def test_emulated_one_token_kernels(qtypes, emulated_kernels, rng):
    """The one-token kernels (gate and up of one type in one body; mixed types by matrix; the default
    tiles and _w's) and their down launch at 2 and 4 rows per block, emulated on the host, against
    the float64 reference."""
    _emulate_experts(emulated_kernels, rng, qtypes, (1, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("qtype", ALL, ids=[Q.LAYOUTS[t].name for t in ALL])
def test_matmul_matches_numpy_dequantize(qtype, tokens, rng):
    cp = pytest.importorskip("cupy")
    from execute.gpu_quant import matmul

    rows, cols = 72, 2304  # 9 blocks of 8 rows; 9 K-blocks per row: 2 input tiles of 1024 for a batch, 1 of 8192 for one token
    raw = Q.random_blocks(rng, qtype, rows, cols, scale=0.05)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ Q.dequantize(raw, qtype, cols).astype(np.float64).T
    y = cp.asnumpy(matmul(cp.asarray(raw.reshape(-1)), qtype, rows, cols, cp.asarray(x)))
    assert y.shape == (tokens, rows) and np.isfinite(y).all()
    bound = REL_ERR if qtype in FLOAT else REL_ERR_INT8
    assert np.linalg.norm(y - ref) <= bound * np.linalg.norm(ref)


def _expert_outputs64(parts, qtypes, x, ffn, hidden) -> list:
    """Each expert's unweighted float64 output (silu(x g^T) * (x u^T)) d^T on the rows of x, from
    gguf's dequantized gate, up and down blocks ``parts``."""
    ys = []
    for e in range(parts[0].shape[0]):
        g, u, d = (Q.dequantize(p[e], t, c).astype(np.float64) for p, t, c in zip(parts, qtypes, (hidden, hidden, ffn)))
        a, b = x.astype(np.float64) @ g.T, x.astype(np.float64) @ u.T
        ys.append((a / (1 + np.exp(-a)) * b) @ d.T)
    return ys


def _expert_parts(rng, qtypes, num_e, ffn, hidden):
    parts = []
    for qt, (rows, cols) in zip(qtypes, ((ffn, hidden), (ffn, hidden), (hidden, ffn))):
        probe = Q.dequantize(Q.random_blocks(np.random.default_rng(0), qt, 16, cols, 1.0), qt, cols)
        scale = 2.0 / np.sqrt(cols) / np.sqrt((probe.astype(np.float64) ** 2).mean())
        parts.append(Q.random_blocks(rng, qt, num_e * rows, cols, scale).reshape(num_e, rows, -1))
    return parts


MIXED = [(t, t, t) for t in QUANT] + [(Q.Q4_K, Q.Q5_K, Q.Q6_K), (Q.IQ4_XS, Q.Q4_0, Q.IQ2_XS)]


@pytest.mark.gpu
@pytest.mark.parametrize("qtypes", MIXED, ids=["-".join(Q.LAYOUTS[t].name for t in m) for m in MIXED])
def test_expert_kernels_match_numpy_dequantize(qtypes, rng):
    """qmoe1_gate_up + qmoe1_down_combine (2 and ONE_DOWN_ROWS down rows per block) and their
    ONE_VARIANTS (one token, 3 experts) and qmoe_gate_up + qmoe_down (11 tokens through each: a pass
    of 8 and one of 3) against the float64 reference; 2304 inputs for gate/up (one-token tiles of
    2048 and 256 columns or fewer, batch tiles of 128), 768 for down; mixed types: gate and up of
    different types in one block."""
    cp = pytest.importorskip("cupy")
    from execute.gpu_quant import ONE_VARIANTS, Experts

    num_e, ffn, hidden, tokens = 3, 768, 2304, 11
    parts = _expert_parts(rng, qtypes, num_e, ffn, hidden)
    w = cp.asarray(np.concatenate([p.reshape(num_e, -1) for p in parts], axis=1))
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ys = _expert_outputs64(parts, qtypes, x, ffn, hidden)
    wts = np.array([0.5, 0.3, 0.2], np.float32)
    ref1 = sum(float(wts[e]) * ys[e][:1] for e in range(num_e))
    for v, rows in [("", 2), ("", None), *((v, None) for v in ONE_VARIANTS)]:
        one = cp.asnumpy(Experts(w, qtypes, ffn, hidden, weights=wts, variant=v, down_rows=rows)(cp.asarray(x[:1])))
        assert np.isfinite(one).all() and np.linalg.norm(one - ref1) <= REL_ERR_INT8 * np.linalg.norm(ref1), (v, rows)
    batch = cp.asnumpy(Experts(w, qtypes, ffn, hidden, tokens=tokens)(cp.asarray(x)))
    ref = np.concatenate(ys)
    assert np.isfinite(batch).all() and np.linalg.norm(batch - ref) <= REL_ERR_INT8 * np.linalg.norm(ref)



BATCHED = [((Q.Q4_K, Q.Q4_K, Q.Q4_K), 768, 1024), ((Q.Q5_K, Q.Q5_K, Q.Q6_K), 768, 1024), ((Q.IQ4_XS,) * 3, 768, 1024),
           ((Q.Q3_K,) * 3, 768, 1024), ((Q.IQ2_XXS, Q.IQ2_XXS, Q.MXFP4), 768, 1024), ((Q.Q4_0, Q.Q5_1, Q.Q8_0), 352, 480)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["", *BATCH_VARIANTS])
@pytest.mark.parametrize("case", BATCHED, ids=["-".join(Q.LAYOUTS[t].name for t in m[0]) for m in BATCHED])
def test_batched_expert_kernels_on_tensor_cores(case, variant, rng):
    """qmoe_gate_up + qmoe_down and their BATCH_VARIANTS on 70 tokens through each of 2 experts (passes
    of 32 or 64 tokens and a partial one; inputs scaled per token by up to e^4 either way; the legacy
    case: partial 128-column tiles and a partial block of down rows): f16 quants and two f16 input
    halves on tensor cores keep a product within REL_ERR of the float64 reference; the int8 variants
    (``_q8*``: inputs as two int8 levels, as the one-token kernels) within REL_ERR_INT8."""
    cp = pytest.importorskip("cupy")
    from execute.gpu_quant import Experts

    qtypes, ffn, hidden = case
    num_e, tokens = 2, 70
    parts = _expert_parts(rng, qtypes, num_e, ffn, hidden)
    w = cp.asarray(np.concatenate([p.reshape(num_e, -1) for p in parts], axis=1))
    x = (rng.standard_normal((tokens, hidden)) * np.exp(rng.uniform(-4, 4, (tokens, 1)))).astype(np.float32)
    ref = np.concatenate(_expert_outputs64(parts, qtypes, x, ffn, hidden))
    y = cp.asnumpy(Experts(w, qtypes, ffn, hidden, tokens=tokens, variant=variant)(cp.asarray(x)))
    bound = REL_ERR_INT8 if variant.startswith("_q8") else REL_ERR
    assert np.isfinite(y).all() and np.linalg.norm(y - ref) <= bound * np.linalg.norm(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["", "_q8m2"])
def test_routed_batch_of_128_experts(variant, rng):
    """4 tokens through each of 128 experts (a 64-token batch routed top-8 over 128 experts, every
    expert's rows read once; 128 groups in the launches' grids; the weights end where their 2 MiB
    allocation ends, as 128 of qwen3-30b-a3b's Q8_0 experts do) against the float64 reference."""
    cp = pytest.importorskip("cupy")
    from execute.gpu_quant import Experts

    qtypes, num_e, ffn, hidden, tokens = (Q.Q8_0,) * 3, 128, 256, 512, 4
    parts = _expert_parts(rng, qtypes, num_e, ffn, hidden)
    raw = np.concatenate([p.reshape(num_e, -1) for p in parts], axis=1)
    buf = cp.empty(-(-raw.size // (1 << 21)) * (1 << 21), cp.uint8)
    w = buf[buf.size - raw.size:].reshape(raw.shape)
    w.set(raw)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ref = np.concatenate(_expert_outputs64(parts, qtypes, x, ffn, hidden))
    y = cp.asnumpy(Experts(w, qtypes, ffn, hidden, tokens=tokens, variant=variant)(cp.asarray(x)))
    bound = REL_ERR_INT8 if variant else REL_ERR
    assert np.isfinite(y).all() and np.linalg.norm(y - ref) <= bound * np.linalg.norm(ref)


@pytest.mark.gpu
def test_one_token_programmatic_launches_give_the_same_bits(rng, monkeypatch):
    """gpu_quant.ONE_PROGRAMMATIC on: GpuExperts launches a generic layer's one-token kernels by
    programmatic dependent launch (pdl_launch accepts the attribute) and gives the plain launches' bits."""
    cp = pytest.importorskip("cupy")
    import execute.gpu_quant as GQ
    from execute import pdl_launch
    from execute.experts import random_layer
    from execute.gpu_experts import GpuExperts
    from scheduler.core import Capacity, Geometry

    layer = random_layer(rng, 0, 4, 512, 256, Q.Q5_K, exact=False)
    x = cp.asarray(rng.standard_normal((1, 512)).astype(np.float32))
    outs = []
    for on in (False, True):
        monkeypatch.setattr(GQ, "ONE_PROGRAMMATIC", on)
        gx = GpuExperts([layer], Capacity.per_layer(Geometry((4,), 2, (layer.expert_bytes,)), 4), scratch_slots=1)
        try:
            assert gx.generic_layers == {0} and gx._one(0)[0].programmatic is on
            gx.begin_copies()
            for e in range(3):
                gx.upload(0, e, e)
            gx.compute_after_copies()
            gx.pack1([gx.source_ptr(0, e) for e in range(3)], [0.5, 0.3, 0.2], [0, 1, 2])
            xd = gx.as_input(x)
            gx.after_caller()
            gx.gate_up1(0, xd, 3, 3)
            out = gx.down_combine1(0, 3)
            gx.to_caller()
            outs.append(out.get())
        finally:
            gx.close()
    assert pdl_launch.refused is None and np.isfinite(outs[0]).all() and np.array_equal(outs[0], outs[1])
