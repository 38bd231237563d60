"""Batched prefill: routing of a whole batch (bit-identical to row by row), and the tensor-core
expert kernels (``execute.prefill``) against a float64 reference and against the engine's own
path under every kind of decision (hits, uploads, streams in several rounds, CPU pairs,
promotions), with the residency they leave."""
from __future__ import annotations

import types

import numpy as np
import pytest

from execute import quant as Q
from execute.batch_route import merge_rows, route_rows, stable_order
from execute.experts import random_layer
from execute.routing import merge_step, route_weights
from scheduler.core import Capacity, Geometry, Step, Token
from scheduler.drive import AwaitBackground, RunLayer, StartBackground, drive
from scheduler.policies import make_policy

from .conftest import cupy_or_skip


# routing of a batch (no GPU) ------------------------------------------------------------------
@pytest.mark.parametrize("gating", ("softmax", "sigmoid", "softmax_topk"))
@pytest.mark.parametrize("norm,scale", ((True, 0.0), (False, 2.5)))
@pytest.mark.parametrize("experts", (8, 128, 256))
def test_route_rows_equal_route_weights_row_by_row(gating, norm, scale, experts):
    info = types.SimpleNamespace(gating=gating, norm_topk=norm, expert_weights_scale=scale, expert_groups=1, top_k=8)
    rng = np.random.default_rng(experts)
    logits = rng.standard_normal((70, experts)) * 3
    logits[3] = 0.0  # all tied: lower ids first
    logits[4, :4] = logits[4, 4:8]
    for bias in (None, rng.standard_normal(experts)):
        ids, w = route_rows(info, logits, bias)
        for i in range(len(logits)):
            r_ids, r_w = route_weights(info, logits[i], bias)
            assert np.array_equal(ids[i], r_ids) and np.array_equal(w[i], r_w)  # bit for bit
        assert merge_rows(5, ids, w) == merge_step(5, ids, w)


def test_route_rows_leaves_expert_groups_to_the_caller():
    info = types.SimpleNamespace(gating="sigmoid", norm_topk=True, expert_weights_scale=0.0, expert_groups=4, top_k=2)
    assert route_rows(info, np.zeros((3, 8)), None) is None


def test_stable_order_is_the_stable_argsort():
    rng = np.random.default_rng(5)
    for a in (rng.integers(0, 128, 2048), rng.integers(0, 40000, 999), rng.integers(-5, 6, 300).astype(np.int32),
              rng.integers(0, 4, 17).astype(np.uint8), np.zeros(0, np.int64), np.array([32767, 0, 32767, 1])):
        assert np.array_equal(stable_order(a), np.argsort(a, kind="stable"))


def test_merge_rows_is_merge_step_on_wide_ids_and_repeats():
    """Expert ids past int16's range and a row that repeats its first expert (a forced route padded
    to k): the same Step as merge_step's."""
    rng = np.random.default_rng(6)
    for n_experts in (8, 128, 70000):
        ids = np.stack([rng.choice(n_experts, 4, replace=False) for _ in range(33)])
        ids[3, 2:] = ids[3, 0]
        w = rng.dirichlet(np.ones(4), size=33)
        assert merge_rows(1, ids, w) == merge_step(1, ids, w)


def test_merge_rows_order_counts_and_sums():
    ids = np.array([[3, 1], [1, 7], [7, 3]])
    w = np.array([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]])
    assert merge_rows(2, ids, w) == Step(2, (3, 1, 7), (2, 2, 2), (4.5, 0.375, 3.0))


# the kernels on a GPU ---------------------------------------------------------------------------
E, K = 16, 4


def _scenario(rng, layers, sizes):
    """Tokens of ``sizes`` rows at every layer, routed with a skewed distribution (some experts get
    more than a tile of rows): ({(token, layer): (ids, weights)}, tokens)."""
    p = np.array([16, 12, 8, 6, 4, 3, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1], float)
    p /= p.sum()
    routing, tokens = {}, []
    for i, t in enumerate(sizes):
        steps = []
        for l in range(len(layers)):
            ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(t)])
            w = rng.dirichlet(np.ones(K), size=t).astype(np.float32)
            routing[(i, l)] = (ids, w)
            one = Step(l, tuple(ids[0].tolist()), None, tuple(w[0].tolist()))
            steps.append(merge_rows(l, ids, w) if t > 1 else one)
        tokens.append(Token(i, 0, i, "prefill" if t > 1 else "decode", tuple(steps), t))
    return routing, tokens


def _drive(engine, batched, policy, routing, tokens, hidden, cp):
    """Every item on the engine (steps ``batched`` takes there when given); (token, decision,
    output, input, taken) per RunLayer."""
    xrng = np.random.default_rng(5)
    out = []
    for item in drive(policy, tokens):
        if isinstance(item, RunLayer):
            ids, w = routing[(item.token.index, item.step.layer)]
            x = cp.asarray(xrng.standard_normal((len(ids), hidden)).astype(np.float32))
            took = batched is not None and batched.takes(item.decision, ids)
            y = batched.run_layer(item.decision, x, ids, w) if took else engine.run_layer(item, x, ids, w)
            engine.gpu.compute.synchronize()
            out.append((item.token.index, item.decision, y.get(), x.get(), took))
        elif isinstance(item, StartBackground):
            engine.start_background(item.moves)
        elif isinstance(item, AwaitBackground):
            engine.await_background(item.moves)
    engine.synchronize()
    return out


def _reference(layer, ids, w, x, cache: dict):
    """float64 sum_j w[t, j] expert_{ids[t, j]}(x[t]); each expert dequantized once (gguf-py)."""
    from .conftest import gguf_dequant

    def mats(e):
        key = (layer.layer, e)
        if key not in cache:
            cache[key] = tuple(gguf_dequant(t.data[e], t.qtype, t.cols) for t in (layer.gate, layer.up, layer.down))
        return cache[key]

    y = np.zeros((len(x), layer.hidden))
    for t in range(len(x)):
        for j, e in enumerate(ids[t]):
            g, u, d = mats(int(e))
            a = g @ x[t].astype(np.float64)
            y[t] += float(w[t, j]) * (d @ (a / (1 + np.exp(-a)) * (u @ x[t].astype(np.float64))))
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", (("gpu", E), ("lru", 5), ("hybrid", 4), ("belady", 5)))
@pytest.mark.parametrize("qt,hidden,ffn", ((Q.Q8_0, 256, 128), (Q.Q4_0, 96, 160), (Q.F16, 128, 96)))
def test_batched_layers_match_reference_and_engine(policy, slots, qt, hidden, ffn):
    cp = cupy_or_skip()
    from execute.engine import ExpertEngine
    from execute.prefill import BatchedExperts

    rng = np.random.default_rng(11)
    layers = [random_layer(rng, l, E, hidden, ffn, qt) for l in range(2)]
    routing, tokens = _scenario(rng, layers, (40, 1, 100, 16, 1, 70))
    geo = Geometry((E,) * 2, K, tuple(l.expert_bytes for l in layers))
    runs = []
    for use_batched in (True, False):
        cap = Capacity.per_layer(geo, slots)
        options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
        future = [s for t in tokens for s in t.steps] if policy == "belady" else None
        pol = make_policy(policy, geo, cap, future=future, **options)
        engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
        try:
            engine.load_residents(pol.cache.slot)
            batched = BatchedExperts(engine, batch_experts=2) if use_batched else None  # several rounds
            runs.append((_drive(engine, batched, pol, routing, tokens, hidden, cp), dict(engine.slot_of)))
        finally:
            engine.close()
    (new, new_slots), (old, old_slots) = runs
    assert new_slots == old_slots  # the same residency, slot for slot
    assert any(r[-1] for r in new) and not any(r[-1] for r in old)
    kinds = {"streams": 0, "uploads": 0, "cpu": 0, "promotions": 0}
    cache = {}  # dequantized experts of this test's layers
    for (i, d, y, x, took), (_, d_old, y_old, _, _) in zip(new, old):
        assert d == d_old
        if took:
            for kind in kinds:
                kinds[kind] += len(getattr(d, kind))
        assert np.isfinite(y).all()
        assert np.linalg.norm(y - y_old) <= 2e-5 * np.linalg.norm(y_old)
        ids, w = routing[(i, d.layer)]
        ref = _reference(layers[d.layer], ids, w, x, cache)
        # CPU pairs of quantized experts take int8 activations (two levels, REL_ERR_INT8 = 2e-4 as in
        # test_cpu_experts); F16 experts and GPU pairs the ~22-bit halves of the tensor-core kernels
        tol = 2e-4 if d.cpu and qt != Q.F16 else 1e-5
        assert np.linalg.norm(y - ref) <= tol * np.linalg.norm(ref)
    if policy == "lru":
        assert kinds["streams"] > 2 and kinds["uploads"] > 0
    if policy == "hybrid":
        assert kinds["cpu"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", (("gpu", E), ("lru", 5)))
def test_pf_mm2_in_batched_experts_gives_pf_mm_bits(policy, slots, monkeypatch):
    """BatchedExperts takes pf_mm2 on Q8_0 layers by default and pf_mm under MOELAB_PREFILL_MM=1 (and
    on other types always): the same outputs bit for bit, the same residency."""
    cp = cupy_or_skip()
    from execute.engine import ExpertEngine
    from execute.prefill import BatchedExperts

    rng = np.random.default_rng(12)
    layers = [random_layer(rng, 0, E, 256, 128, Q.Q8_0), random_layer(rng, 1, E, 256, 128, Q.Q4_0)]
    routing, tokens = _scenario(rng, layers, (40, 100, 16, 70))
    geo = Geometry((E,) * 2, K, tuple(l.expert_bytes for l in layers))
    runs = []
    for mm in ("2", "1"):
        monkeypatch.setenv("MOELAB_PREFILL_MM", mm)
        cap = Capacity.per_layer(geo, slots)
        pol = make_policy(policy, geo, cap)
        engine = ExpertEngine(layers, pol.capacity, threads=2, use_gpu=True, scratch_slots=2)
        try:
            engine.load_residents(pol.cache.slot)
            batched = BatchedExperts(engine, batch_experts=2)
            assert batched._use_mm2 == {0: mm == "2", 1: False}
            runs.append((_drive(engine, batched, pol, routing, tokens, 256, cp), dict(engine.slot_of)))
        finally:
            engine.close()
    (new, new_slots), (old, old_slots) = runs
    assert new_slots == old_slots and any(r[-1] and r[1].layer == 0 for r in new)
    for (_, d, y, _, took), (_, d_old, y_old, _, _) in zip(new, old):
        assert d == d_old and np.array_equal(y, y_old)


@pytest.mark.gpu
def test_batched_layer_of_the_qwen3_shape():
    """128 Q8_0 experts of 2048 x 768, top-8, 256 tokens, every expert resident (random blocks with
    valid scales: quantizing 600 M float weights took 50 s of the test; the reference reads the
    same blocks)."""
    cp = cupy_or_skip()
    from execute.engine import ExpertEngine
    from execute.prefill import BatchedExperts

    rng = np.random.default_rng(3)
    layer = random_layer(rng, 0, 128, 2048, 768, Q.Q8_0, exact=False)
    geo = Geometry((128,), 8, (layer.expert_bytes,))
    pol = make_policy("gpu", geo, None)
    engine = ExpertEngine([layer], pol.capacity, threads=2, use_gpu=True)
    try:
        engine.load_residents(pol.cache.slot)
        ids = np.stack([rng.choice(128, 8, replace=False) for _ in range(256)])
        w = rng.dirichlet(np.ones(8), size=256).astype(np.float32)
        x = rng.standard_normal((256, 2048)).astype(np.float32)
        tok = Token(0, 0, 0, "prefill", (merge_rows(0, ids, w),), 256)
        item = next(i for i in drive(pol, [tok]) if isinstance(i, RunLayer))
        batched = BatchedExperts(engine)
        assert batched.takes(item.decision, ids)
        y = batched.run_layer(item.decision, cp.asarray(x), ids, w).get()
    finally:
        engine.close()
    rows = [0, 17, 128, 255]
    ref = _reference(layer, ids[rows], w[rows], x[rows], {})
    assert np.linalg.norm(y[rows] - ref) <= 1e-5 * np.linalg.norm(ref)


@pytest.mark.gpu
def test_a_gpu_without_mma_keeps_every_step_on_the_engine(monkeypatch):
    """Below compute capability 8.0 (no mma.sync m16n8k16) nothing is compiled and takes() is False."""
    cp = cupy_or_skip()
    from execute import prefill
    from execute.engine import ExpertEngine

    layer = random_layer(np.random.default_rng(1), 0, E, 64, 64, Q.Q8_0)
    geo = Geometry((E,), K, (layer.expert_bytes,))
    engine = ExpertEngine([layer], make_policy("gpu", geo, None).capacity, threads=1, use_gpu=True)
    try:
        ids = np.tile(np.arange(K), (32, 1))
        d = types.SimpleNamespace(layer=0, step=Step(0, tuple(range(K)), None, (1.0,) * K))
        assert prefill.BatchedExperts(engine).takes(d, ids)
        with monkeypatch.context() as m:  # the capability faked for the construction only
            m.setattr(cp.cuda, "Device", lambda *a: types.SimpleNamespace(compute_capability="75"))
            old = prefill.BatchedExperts(engine)
        assert old._mm is None and not old.takes(d, ids)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def chunk_model(tmp_path_factory):
    """``chunk_model(arch, quant)`` -> ModelWeights of a tiny model (made once per module)."""
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model

    root, made = tmp_path_factory.mktemp("prefill"), {}

    def get(arch: str, quant: str):
        if (arch, quant) not in made:
            cfg = config_from_preset("tiny", arch=arch, quant=quant, seed=5)
            made[(arch, quant)] = load_model(synth_model(root / f"{arch}_{quant}.gguf", cfg))
        return made[(arch, quant)]

    return get


def _model_run(w, policy: str, slots: int, prefill: bool, monkeypatch):
    """Two prefill chunks (20 and 17 tokens: the KV cache grows inside them) then 8 decode tokens
    through ``execute.driver.run`` on the engine, with ``MOELAB_PREFILL`` on or off: (every row's
    logits, audit, GPU rounds the batched path ran)."""
    from execute import model as M
    from scheduler.audit import Audit

    monkeypatch.setenv("MOELAB_PREFILL", "1" if prefill else "0")
    monkeypatch.setenv("MOELAB_PREFILL_DEVICE", "0")  # block by block: the device chunk has its own tests
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    options = {"miss_frac_256": 128, "swap_every": 2, "gate": 0.5, "margin": 0.1} if policy == "hybrid" else {}
    toks = np.random.default_rng(9).integers(w.info.vocab, size=45).tolist()
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(toks[:20]), all_logits=True),
              M.ChunkInput(1, 0, 20, "prefill", tuple(toks[20:37]), all_logits=True)]
    inputs += [M.TokenInput(2 + i, 0, 37 + i, "decode", t) for i, t in enumerate(toks[37:])]
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True, timeout_s=120)
    assert (backend.batched is not None) == prefill
    if prefill:
        backend.batched.batch_experts = 2  # misses in several rounds: both staging halves reused
    audit = Audit(g, keep_log=True)
    try:
        res = M.run(M.MoeModel(w, use_gpu=True, max_tokens=8), backend, make_policy(policy, g, cap, **options),
                    inputs, audit=audit, keep_logits=True)
        rounds = backend.batched.rounds if prefill else 0
    finally:
        backend.close()
    return np.stack(res.logits), audit, rounds


@pytest.mark.gpu
@pytest.mark.parametrize("arch,quant,policy,slots", (("qwen3moe", "Q8_0", "hybrid", 3), ("qwen3moe", "Q8_0", "lru", 2),
                                                     ("qwen3moe", "Q8_0", "gpu", 8), ("qwen2moe", "Q4_0", "lru", 2)))
def test_prefill_chunks_through_the_model_match_the_engine_path(chunk_model, arch, quant, policy, slots, monkeypatch):
    """The batched path as ``moelab run`` takes it (EngineExperts' hook, the dense stream waiting on
    the expert work, decode tokens and their graphs after it): the same decisions and logits
    within the kernels' rounding as the engine's own kernels."""
    cupy_or_skip()
    w = chunk_model(arch, quant)
    new, a_new, rounds = _model_run(w, policy, slots, True, monkeypatch)
    old, a_old, _ = _model_run(w, policy, slots, False, monkeypatch)
    assert rounds > 0 and len(new) == 37 + 8
    assert a_new.digest() == a_old.digest()
    assert np.isfinite(new).all()
    assert float(((new - old) ** 2).sum() / (old ** 2).sum()) <= 1e-8


# the prompt sweep's library (no GPU: policy cpu) ---------------------------------------------------
def test_prompt_sweep_rows(synth_path):
    from execute.prompt_bench import Config, fit_prompt, sweep
    from execute.tokenizer import Tokenizer

    path = str(synth_path("Q8_0"))
    text, n = fit_prompt(Tokenizer.from_gguf(path), 20)
    assert 0 < n <= 20 and len(Tokenizer.from_gguf(path).encode(text)) == n
    cpu = ("--policy", "cpu", "--backend", "numpy")
    rows = sweep(path, [8, 20], [Config("cpu", cpu), Config("chunk 4", (*cpu, "--prefill-chunk", "4"),
                                                            {"MOELAB_PREFILL": "0"})], threads=1)
    assert [(r["length"], r["config"]) for r in rows] == [(8, "cpu"), (8, "chunk 4"), (20, "cpu"), (20, "chunk 4")]
    assert all(0 < r["prompt_tokens"] <= r["length"] and r["prompt_tokens_per_s"] > 0 and r["first_token_s"] > 0
               for r in rows)
    assert rows[0]["prefill_chunk"] == 512 and rows[1]["prefill_chunk"] == 4
    assert rows[0]["digest"] != rows[1]["digest"] or rows[0]["prompt_tokens"] <= 4


def test_prompt_sweep_ab_configs():
    import importlib.util
    from argparse import Namespace
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("prompt_sweep", Path(__file__).parents[2] / "experiments/prompt_sweep.py")
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)
    args = Namespace(budgets=[], policy="lru", old=False, device_ab=False, ab="MOELAB_PREFILL_MM=1,2")
    assert [(c.label, c.env) for c in ps.configs(args)] == [
        ("gpu (MOELAB_PREFILL_MM=1)", {"MOELAB_PREFILL_MM": "1"}), ("gpu (MOELAB_PREFILL_MM=2)", {"MOELAB_PREFILL_MM": "2"})]
    with pytest.raises(SystemExit, match="--ab 'MM=1'"):
        ps._ab("MM=1")
