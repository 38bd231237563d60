"""``moelab run --json``'s first_token_breakdown (host-clock phases up to the first token) and the
stored dense matrices (``gguf_model.StoredDense``) a run loads instead of float32 copies."""
from __future__ import annotations

import numpy as np
import pytest

from execute.cli_run import run_figures
from execute.first_token import PHASES, Phases, process_age_s
from execute.gguf_model import StoredDense, load_model

from .conftest import run_json


def test_breakdown_fields_sum_to_at_most_first_token_s(models, capsys):
    _, fig = run_json(capsys, models(), "-p", "The cat sat", "-n", "3", "--policy", "cpu")
    b = fig["first_token_breakdown"]
    assert set(b) == set(PHASES) | {"other_s", "import_s"}
    inside = sum(b[k] for k in PHASES)
    assert all(b[k] >= 0 for k in PHASES) and b["other_s"] >= 0
    assert inside <= fig["first_token_s"] + 1e-9
    assert inside + b["other_s"] == pytest.approx(fig["first_token_s"])
    assert b["prefill_s"] == pytest.approx(fig["prompt_s"])
    for k in ("finite_check_s", "model_open_s", "tokenizer_s", "numba_warmup_s", "prefill_s", "first_sample_s"):
        assert b[k] > 0, k  # each of these ran
    assert b["import_s"] is None or b["import_s"] > 0
    assert b["kernel_compile_s"] < 0.05 and b["expert_upload_s"] < 0.05  # no GPU: nothing compiled or uploaded


def test_breakdown_in_run_figures_and_without_a_first_token(models):
    fig, _ = run_figures([str(models()), "-p", "Hi", "-n", "0", "--threads", "1", "--backend", "numpy"])
    b = fig["first_token_breakdown"]
    assert fig["first_token_s"] is None and b["other_s"] is None and b["first_sample_s"] == 0.0
    assert b["finite_check_s"] == 0.0 and b["prefill_s"] > 0  # run_figures skips the finite check


def test_phases_reject_unknown_names_and_add_up():
    ph = Phases(0.5)
    ph.add("prefill_s", 1.0)
    ph.add("prefill_s", 0.25)
    with ph.phase("tokenizer_s"):
        pass
    with pytest.raises(ValueError, match="phase 'bogus'"):
        ph.add("bogus", 1.0)
    b = ph.breakdown(2.0)
    assert b["prefill_s"] == 1.25 and b["import_s"] == 0.5 and b["other_s"] == pytest.approx(0.75 - b["tokenizer_s"])
    age = process_age_s()
    assert age is None or 0 < age < 1e6


@pytest.mark.parametrize("dense_quant", ("Q8_0", "F16", "BF16", "F32"))
def test_stored_dense_reads_as_the_float32_load(tmp_path, dense_quant):
    from execute.synth import config_from_preset, synth_model

    path = synth_model(tmp_path / "m.gguf", config_from_preset("tiny", dense_quant=dense_quant, seed=3))
    eager, lazy = load_model(path), load_model(path, lazy_dense=True)
    assert isinstance(lazy.token_embd, StoredDense) and isinstance(lazy.layers[0].wo, StoredDense)
    for a, b in [(eager.token_embd, lazy.token_embd), (eager.output, lazy.output)] + [
            (getattr(x, k), getattr(y, k)) for x, y in zip(eager.layers, lazy.layers) for k in ("wq", "wk", "wv", "wo")]:
        assert b.shape == a.shape and b.ndim == 2 and len(b) == len(a)
        assert np.array_equal(np.asarray(b), a) and np.array_equal(np.asarray(b, np.float16), a.astype(np.float16))
        p = np.random.default_rng(0).permutation(len(a))
        assert np.array_equal(b[p], a[p]) and np.array_equal(b[3], a[3]) and np.array_equal(b[-1], a[-1])
        assert np.array_equal(b[1:5], a[1:5]) and np.array_equal(b[[2, 2, 0]], a[[2, 2, 0]])
    assert np.array_equal(lazy.layers[0].router, eager.layers[0].router)  # small tensors stay arrays
    assert isinstance(lazy.layers[0].attn_norm, np.ndarray)


def test_a_file_found_finite_is_not_scanned_again_until_it_changes(tmp_path, monkeypatch):
    import json
    import os

    from execute import weights_check as W
    from execute.synth import config_from_preset, synth_model

    monkeypatch.setenv("MOELAB_CACHE_DIR", str(tmp_path / "cache"))
    path = synth_model(tmp_path / "m.gguf", config_from_preset("tiny", seed=4))
    scans = []
    real = W.first_non_finite
    monkeypatch.setattr(W, "first_non_finite", lambda r: scans.append(1) or real(r))
    W.check_file(path)
    W.check_file(path)
    assert len(scans) == 1 and len(json.loads((tmp_path / "cache/finite_checked.json").read_text())) == 1
    # a NaN written into the file (same size, same inode) changes its times: scanned again, found
    from execute.gguf_file import GGUFFile

    off = {t.name: t.data_offset for t in GGUFFile(path).tensors}["output_norm.weight"]
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(off + 8)
        f.write(np.float32(np.nan).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(W.NonFiniteWeights, match="output_norm.weight"):
        W.check_file(path)
    with pytest.raises(W.NonFiniteWeights):
        W.check_file(path)  # a failed check is never remembered
    assert len(scans) == 3
    (tmp_path / "cache/finite_checked.json").write_text("{not json")  # a damaged cache: scanned, rewritten
    good = synth_model(tmp_path / "g.gguf", config_from_preset("tiny", seed=4))
    W.check_file(good)
    W.check_file(good)
    assert len(scans) == 4
    monkeypatch.setenv("MOELAB_CACHE_DIR", "")  # empty: no cache
    W.check_file(good)
    W.check_file(good)
    assert len(scans) == 6


def test_prepare_compiles_the_cpu_kernels_only_when_a_cpu_pair_can_happen(models, monkeypatch):
    from types import SimpleNamespace

    from execute.backends import EngineExperts
    from scheduler import Capacity

    w = load_model(models())
    geo = w.info.geometry()
    b = EngineExperts(w, Capacity.per_layer(geo, 0), 1, False)
    calls, loaded = [], []
    monkeypatch.setattr(b.engine.pool, "warmup", lambda layer, others=(): calls.append(layer.layer))
    monkeypatch.setattr(b.engine, "load_residents", lambda slots: loaded.append(len(slots)))
    every = {(l, e): e for l, n in enumerate(geo.num_experts) for e in range(n)}
    for slots, warmed in (({}, True), (dict(list(every.items())[:-1]), True), (every, False)):
        calls.clear()
        b.prepare(SimpleNamespace(cache=SimpleNamespace(slot=slots)))
        assert bool(calls) == warmed and loaded[-1] == len(slots)
        assert set(b.prepare_s) == {"numba_warmup_s", "expert_upload_s"}
    b.close()


def test_gpu_init_makes_the_context_and_cublas_on_a_thread_and_keeps_errors(monkeypatch):
    import sys
    import threading
    import types

    from execute.first_token import GpuInit

    calls = []
    rt = types.SimpleNamespace(free=lambda p: calls.append(("free", p, threading.current_thread().name)))
    cp = types.ModuleType("cupy")
    cp.cuda = types.SimpleNamespace(runtime=rt)
    blas = types.ModuleType("cupy_backends.cuda.libs.cublas")
    blas.create = lambda: calls.append(("create",)) or 7
    blas.destroy = lambda h: calls.append(("destroy", h))
    for name in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["cupy_backends.cuda.libs"].cublas = blas
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", blas)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    cp.cuda.Device = lambda: types.SimpleNamespace(compute_capability="90")
    import execute.prefill_dense as PD

    monkeypatch.setattr(PD, "warm_library", lambda *a: calls.append(("warm", *a[1:], threading.current_thread().name)))
    info = types.SimpleNamespace(spec=types.SimpleNamespace(attn="gqa"))
    g = GpuInit()
    g.warm(info, 256, 300)
    g.warm(info, 1, 1)  # once only
    assert g.join(10) and g.error is None and g.done_s is not None and g.warmed
    assert calls == [("free", 0, "moelab-gpu-init"), ("create",), ("destroy", 7), ("warm", 256, 300, "moelab-gpu-init")]
    calls.clear()
    monkeypatch.setenv("MOELAB_PREFILL_DENSE", "0")  # no chunk dense path: nothing to warm
    g = GpuInit()
    g.warm(info, 256, 300)
    assert g.join(10) and g.error is None and not g.warmed and ("warm", 256, 300, "moelab-gpu-init") not in calls
    g = GpuInit(wait_s=0.0)  # no shapes given: the thread ends after the context
    assert g.join(10) and g.error is None and not g.warmed
    rt.free = lambda p: (_ for _ in ()).throw(RuntimeError("no device"))
    g = GpuInit()
    assert g.join(10) and isinstance(g.error, RuntimeError) and "no device" in str(g.error)


def test_gpu_init_switch_is_checked(models, monkeypatch, capsys):
    from execute.cli_run import run_main

    monkeypatch.setenv("MOELAB_GPU_INIT", "2")
    assert run_main([str(models()), "-p", "hi", "-n", "1", "--policy", "gpu"]) == 2
    assert "MOELAB_GPU_INIT" in capsys.readouterr().err
