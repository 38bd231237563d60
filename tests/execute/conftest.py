"""Shared fixtures for the executor tests: random quantized layers and a float64 reference."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402  (tests may import gguf directly; the package may not)

from execute.experts import LayerExperts  # noqa: E402


def gguf_dequant(data: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """gguf-py's reference dequantizer, as float64 (rows, cols)."""
    return quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType(qtype)).reshape(-1, cols).astype(np.float64)


def experts_reference(layer: LayerExperts, experts, x: np.ndarray) -> np.ndarray:
    """float64 down(silu(gate x) * up x) per pair, from gguf's dequantized weights."""
    out = np.empty((len(experts), layer.hidden))
    for i, (e, xi) in enumerate(zip(experts, np.asarray(x, np.float64))):
        g = gguf_dequant(layer.gate.data[e], layer.gate.qtype, layer.hidden)
        u = gguf_dequant(layer.up.data[e], layer.up.qtype, layer.hidden)
        d = gguf_dequant(layer.down.data[e], layer.down.qtype, layer.ffn)
        a = g @ xi
        with np.errstate(over="ignore"):  # exp(-a) = inf for a << 0: silu(a) = -0.0, as it should
            out[i] = d @ (a / (1 + np.exp(-a)) * (u @ xi))
    return out


def biased(layer, rng, activation):
    """``layer`` with N(0, 1) float32 biases and ``activation``."""
    def b(rows):
        return rng.standard_normal((layer.num_experts, rows)).astype(np.float32)

    return dataclasses.replace(layer, gate_bias=b(layer.ffn), up_bias=b(layer.ffn), down_bias=b(layer.hidden),
                               activation=activation)


def biased_reference(layer, experts, x):
    """float64 ``down(act(gate x + bg, up x + bu)) + bd`` per pair, from gguf's dequantized weights;
    also the fraction of pre-activation gate/up values the swiglu_oai clamps cut."""
    out, cut = np.empty((len(experts), layer.hidden)), []
    for i, (e, xi) in enumerate(zip(experts, np.asarray(x, np.float64))):
        g = gguf_dequant(layer.gate.data[e], layer.gate.qtype, layer.hidden) @ xi + layer.gate_bias[e]
        u = gguf_dequant(layer.up.data[e], layer.up.qtype, layer.hidden) @ xi + layer.up_bias[e]
        d = gguf_dequant(layer.down.data[e], layer.down.qtype, layer.ffn)
        if layer.activation == "swiglu_oai":
            cut.append(np.mean(g > 7) + np.mean(np.abs(u) > 7))
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            h = g / (1 + np.exp(-1.702 * g)) * (u + 1)
        else:
            h = g / (1 + np.exp(-g)) * u
        out[i] = d @ h + layer.down_bias[e]
    return out, float(np.mean(cut)) if cut else 0.0


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261129)


@pytest.fixture
def reference():
    return experts_reference


@pytest.fixture(name="gguf_dequant")
def gguf_dequant_fixture():
    return gguf_dequant


# synthetic GGUF models (execute.synth) --------------------------------------------------------
TINY = dict(num_layers=2, num_experts=8, top_k=2, hidden=64, ffn=32, num_heads=4, num_kv_heads=2, vocab=320)
TINY_K = dict(TINY, hidden=256, ffn=256)  # K-quants need rows of 256
SMALL_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
K_QUANTS = ("Q4_K", "Q6_K")


def tiny_config(quant: str, seed: int = 7, **overrides):
    from execute.synth import SynthConfig

    base = TINY_K if quant in K_QUANTS else TINY
    return SynthConfig(**{**base, **overrides}, quant=quant, seed=seed)


@pytest.fixture(scope="session")
def synth_path(tmp_path_factory):
    """``synth_path(quant, **overrides)`` -> path of a tiny synthetic qwen3moe GGUF (cached per session)."""
    from execute.synth import synth_model

    root = tmp_path_factory.mktemp("models")
    made: dict = {}

    def make(quant: str = "Q8_0", **overrides):
        key = (quant, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = synth_model(root / f"m{len(made)}_{quant}.gguf", tiny_config(quant, **overrides))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_weights(synth_path):
    """``tiny_weights(quant)`` -> loaded ModelWeights of a tiny model (cached per session)."""
    from execute.gguf_model import load_model

    cache: dict = {}

    def get(quant: str = "Q8_0"):
        if quant not in cache:
            cache[quant] = load_model(synth_path(quant))
        return cache[quant]

    return get


def cupy_or_skip():
    """cupy with a CUDA device, or skip the test (the only reason a test here may skip)."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp


_SPIN = r"""extern "C" __global__ void spin(long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def spin(cp, ms: float, stream=None) -> None:
    """Keep ``stream`` (default: the current one) busy on the device for ``ms`` milliseconds, so
    that what is queued on it next runs late: a missing wait between streams shows as stale data."""
    import numpy as np

    with stream or cp.cuda.get_current_stream():
        cp.RawKernel(_SPIN, "spin")((1,), (1,), (np.int64(ms * 1e6),))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """``models(arch)``: a tiny complete GGUF of that architecture (Q8_0 experts), made once."""
    from execute.synth import config_from_preset, synth_model

    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(arch: str = "qwen3moe"):
        if arch not in made:
            made[arch] = synth_model(root / f"{arch}.gguf", config_from_preset("tiny", arch=arch, quant="Q8_0", seed=5))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def graph_models(tmp_path_factory):
    """``graph_models(arch)``: loaded weights of a 6-block tiny model of that architecture (Q8_0
    experts, seed 13), made once: the token graph's, the late start's and the CPU graph's tests."""
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model

    root, cache = tmp_path_factory.mktemp("graph_models"), {}

    def get(arch: str):
        if arch not in cache:
            cfg = config_from_preset("tiny", arch=arch, quant="Q8_0", num_layers=6, seed=13)
            cache[arch] = load_model(synth_model(root / f"{arch}.gguf", cfg))
        return cache[arch]

    return get


def decode_bits(w, tokens, policy: str, monkeypatch, **switches):
    """Decode ``tokens`` of ``w`` with ``policy`` on 3 slots per layer through the GPU engine, the
    ``MOELAB_*`` environment switches given (``TOKEN_GRAPH="1"`` ...): -> (logits, route log,
    decision digest, late pairs, whether the token graph was built). The engine's ``synchronize``
    raises a late pair's time-out or a hand-off's failure."""
    from execute import model as M
    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit

    for name, value in switches.items():
        monkeypatch.setenv(f"MOELAB_{name}", value)
    g = w.info.geometry()
    cap = Capacity.per_layer(g, 3)
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True)
    audit = Audit(g, keep_log=True)
    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), inputs, 1, audit=audit, keep_logits=True)
        backend.engine.synchronize()
        late_pairs = backend.engine.stats.late_pairs
    finally:
        backend.close()
    return np.stack(res.logits), model.route_log, audit.digest(), late_pairs, model.token_graph is not None


def run_json(capsys, *argv) -> tuple[str, dict]:
    """``moelab run ... --json`` on one thread: (the streamed text, the figures)."""
    import json

    from execute.cli_run import run_main

    assert run_main([*map(str, argv), "--json", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    text, _, figures = out.partition("\n{")
    return text, json.loads("{" + figures)
