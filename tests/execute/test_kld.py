"""``moelab kld``: the KL statistics themselves, the command on tiny synthetic models (policy cpu:
the engine's CPU pool against the numpy reference), a corrupted expert output showing up, and the
errors; ``gpu``-marked runs of the caching policies on the executor."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from execute import kld, synth

TEXT = ("The cache keeps the experts a token will need next; when it guesses wrong, the expert is copied "
        "over the link or computed on the host. 12345 tokens later, the same question comes back.")


def _kl_exact(p_logits, q_logits):
    p = np.exp(p_logits - np.logaddexp.reduce(p_logits))
    q = np.exp(q_logits - np.logaddexp.reduce(q_logits))
    return float(np.sum(p * np.log(p / q)))


def test_kl_divergence_against_the_definition(rng):
    a = rng.standard_normal((70, 50)).astype(np.float32) * 3  # more rows than one block of _ROWS
    b = a + rng.standard_normal((70, 50)).astype(np.float32) * 0.5
    kl = kld.kl_divergence(a, b)
    np.testing.assert_allclose(kl, [_kl_exact(x.astype(np.float64), y.astype(np.float64)) for x, y in zip(a, b)],
                               rtol=1e-9)
    assert (kld.kl_divergence(a, a) == 0).all()
    np.testing.assert_allclose(kld.kl_divergence(a, a + 7.0), 0, atol=1e-12)  # a shift is the same distribution
    assert not np.allclose(kld.kl_divergence(a, b), kld.kl_divergence(b, a))  # KL(p || q), not symmetric


def test_non_finite_policy_logits_count_as_infinite_kl():
    a = np.zeros((3, 4), np.float32)
    b = a.copy()
    b[1, 2] = np.nan
    b[2, 0] = np.inf
    assert kld.kl_divergence(a, b).tolist() == [0.0, np.inf, np.inf]


def test_figures_count_thresholds_and_top1():
    ref = np.zeros((4, 3), np.float32)
    ref[:, 0] = 5.0  # every position: token 0 most likely
    got = ref.copy()
    got[1] = [0.0, 5.0, 0.0]  # top-1 flips, KL about 4.9
    got[2] = [0.0, 20.0, 0.0]  # KL about 19
    f = kld.kl_figures(ref, got, [0, 0, 1, 0])
    assert f["positions"] == 4 and f["top1_same"] == 2 and f["top1_agreement"] == 0.5
    assert f["share_kl_above_0.1"] == 0.5 and f["share_kl_above_4"] == 0.5
    assert f["kl_max_position"] == 2 and f["worst"][0][0] == 2 and f["worst"][1][0] == 1
    assert f["kl_max"] == pytest.approx(_kl_exact(ref[2].astype(float), got[2].astype(float)))
    assert f["ppl_reference"] == pytest.approx(np.exp(np.mean([-np.log(np.exp(5) / (np.exp(5) + 2)),
                                                               -np.log(1 / (np.exp(5) + 2)),
                                                               -np.log(np.exp(5) / (np.exp(5) + 2))])))


def _args(model, *extra):
    return kld._parser().parse_args([str(model), "-p", TEXT, *extra])


CPU = ("--policy", "cpu", "--cpu-dense")  # the engine's CPU pool, dense path on the host, on any machine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kld")
    made = {}

    def get(arch="qwen3moe", quant="Q8_0"):
        if (arch, quant) not in made:
            k = {"hidden": 256, "ffn": 256} if quant in ("Q4_K", "Q6_K") else {}  # rows of 256
            cfg = synth.config_from_preset("tiny", arch=arch, quant=quant, **k)
            made[arch, quant] = synth.synth_model(root / f"{arch}-{quant}.gguf", cfg)
        return made[arch, quant]

    return get


# The engine's CPU pool rounds activations to two int8 levels for Q8_0/Q4_0 experts (F16 experts
# take float32 activations): on the tiny models KL stays below about 2e-9 (float32 rounding alone:
# 1e-13). The bounds leave room; a wrong expert or a stale output is many orders of magnitude above.
@pytest.mark.parametrize("arch, quant, batch, bound", [
    ("qwen3moe", "Q8_0", 1, 1e-7), ("qwen3moe", "Q4_0", 8, 1e-7), ("gpt-oss", "Q8_0", 1, 1e-7),
    ("deepseek2", "Q8_0", 8, 1e-7), ("qwen3moe", "F16", 1, 1e-11)])
def test_cpu_policy_matches_the_reference(models, arch, quant, batch, bound):
    out = kld.kld(_args(models(arch, quant), *CPU, "--batch", str(batch), "--tokens", "40"))
    assert out["positions"] == 40 and out["batch"] == batch and out["policy"] == "cpu" and not out["gpu"]
    assert 0 < out["kl_mean"] <= out["kl_p99"] <= out["kl_max"] < bound
    assert out["top1_agreement"] == 1.0 and out["share_kl_above_0.1"] == 0.0
    assert out["ppl_policy"] == pytest.approx(out["ppl_reference"], rel=1e-4)
    assert out["cpu"] > 0 and out["uploads"] == 0
    t = out["ties"]  # tiny models have clear margins: no flips, no near ties, routes the reference's
    assert t["flips"] == [] and t["twin_top1_agreement"] == 1.0 and t["top1_agreement_outside_ties"] == 1.0
    assert t.get("positions_routed_differently", 0) == 0 and t.get("twin_route_flips", 0) == 0
    f = t["forced"]  # the reference's routes forced: the same routes, so the same figures
    assert (f is None) == (arch == "deepseek2")  # expert groups: routing not analysed, no forced run
    if f is None:
        return
    assert f["top1_agreement"] == 1.0 and f["flips_outside_ties"] == [] and f["kl_max"] < bound
    assert f["spread_ratio_median"] == pytest.approx(t["spread_ratio_median"], rel=1e-6)


def test_a_corrupted_expert_output_shows_up_at_its_position(models, monkeypatch):
    """The engine's output of both blocks is scaled up at position 30 only: KL is large there and
    stays at the rounding floor before it (later positions see it through the KV cache)."""
    from execute import model as M

    calls = {"n": 0}
    run_layer = M.EngineExperts.run_layer

    def corrupt(self, item, x, ids, weights):
        y = run_layer(self, item, x, ids, weights)
        calls["n"] += 1
        return y * 50 if 30 * 2 < calls["n"] <= 31 * 2 else y  # 2 MoE blocks per token

    monkeypatch.setattr(M.EngineExperts, "run_layer", corrupt)
    out = kld.kld(_args(models(), *CPU, "--tokens", "40"))
    assert out["kl_max_position"] == 30 and out["kl_max"] > 0.1
    assert out["worst"][0][0] == 30 and all(pos > 30 for pos, kl in out["worst"][1:] if kl > 1e-6)


def _moelab(argv, cwd):
    return subprocess.run([sys.executable, "-m", "moelab.cli", *map(str, argv)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_command_prints_json(models, tmp_path):
    r = _moelab(["kld", models(), *CPU, "-p", TEXT, "--tokens", "16", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["positions"] == 16 and out["top1_agreement"] == 1.0 and out["kl_max"] < 1e-7
    r = _moelab(["kld", models(), *CPU, "-p", TEXT, "--tokens", "16"], tmp_path)
    assert r.returncode == 0 and "top-1 agreement: 100.00% (16/16)" in r.stdout, r.stderr


def test_a_gpu_policy_without_a_gpu_is_refused_up_front(models, monkeypatch, capsys):
    monkeypatch.setattr(kld, "gpu_missing", lambda: "no CUDA device is visible")
    assert kld.main([str(models()), "--policy", "lru", "--cache-mib", "1", "-p", TEXT]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("moelab kld: policy 'lru' runs experts on the GPU, and this machine cannot: no CUDA device is "
                   "visible; only --policy cpu runs without a GPU")


@pytest.mark.skipif(kld.gpu_missing() is None, reason="this machine has a GPU")
def test_this_machine_without_a_gpu_says_so(models, tmp_path):
    r = _moelab(["kld", models(), "--policy", "hybrid", "--cache-mib", "0.1", "-p", TEXT], tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "policy 'hybrid' runs experts on the GPU, and this machine cannot" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["--policy", "cpu", "-f", "absent.txt"], "moelab kld: -f absent.txt: No such file or directory"),
    (["--policy", "cpu", "-f", "latin1.txt"], "moelab kld: -f latin1.txt: not UTF-8 text (byte 3)"),
    (["--policy", "cpu", "-p", "x", "--tokens", "1"], "--tokens 1: expected >= 2"),
    (["--policy", "cpu", "-p", "x", "--batch", "0"], "--batch 0: expected >= 1"),
    (["--policy", "cpu", "-p", "x", "--twin-jitter", "0"], "--twin-jitter 0.0: expected a relative size in (0, 1)"),
    (["--policy", "cpu", "-p", ""], "the text encodes to"),
    (["--policy", "nope", "-p", "x"], "--policy 'nope': expected one of"),
    (["--policy", "belady", "-p", "x"], "policy 'belady' needs the future routing"),
    (["--policy", "cpu", "-p", "x", "-f", "t.txt"], "not allowed with argument"),
])
def test_bad_input_is_one_line(models, tmp_path, argv, message):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    r = _moelab(["kld", models(), *argv], tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


# on a GPU machine: the caching policies with asynchronous copies, fills and swaps ---------------
@pytest.mark.gpu
@pytest.mark.parametrize("policy, extra", [
    ("lru", ["--cache-slots", "3"]), ("lru", ["--cache-slots", "3", "--lag-tokens", "0"]),
    ("hybrid", ["--cache-slots", "3"]), ("predict", ["--cache-slots", "3"]), ("gpu", []),
    ("lru", ["--cache-slots", "3", "--batch", "8"]), ("cpu", [])])
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "MXFP4"])
def test_gpu_policies_match_the_reference(models, policy, extra, quant):
    """Experts copied, filled and swapped while tokens run: every position's distribution stays at
    the reference's up to the kernels' rounding (no token computed with a half-copied expert)."""
    arch = "gpt-oss" if quant == "MXFP4" else "qwen3moe"
    out = kld.kld(_args(models(arch, quant), "--policy", policy, "--tokens", "64", *extra))
    assert out["gpu"] and out["positions"] == 64
    assert out["kl_max"] < 1e-5 and out["share_kl_above_0.1"] == 0.0, out["worst"]
    assert out["top1_agreement"] == 1.0 and out["ties"]["flips"] == []
    f = out["ties"]["forced"]  # the same policy with the reference's routes forced
    assert f["kl_max"] < 1e-5 and f["top1_agreement"] == 1.0 and f["wall_s"] > 0
    if policy not in ("gpu", "cpu"):
        # the cache of 3 of 8 experts per block had to move experts: on demand or in the background
        # (upload_mib counts both). hybrid moves them only in the background here: on a top-2 model
        # a step's 1 or 2 misses all go to the CPU (scheduler.policies.hybrid), so uploads stay 0
        assert out["upload_mib"] > 0
        if policy == "hybrid":
            assert out["cpu"] > 0


def test_forced_routes_are_the_probes_ids_per_position():
    from types import SimpleNamespace

    from execute.routing import Route

    probe = SimpleNamespace(ids={1: np.array([[3, 0], [2, 5]]), 2: np.array([[1, 4], [0, 6]])})
    r = kld.forced_routes(probe, 3, 2)
    assert r == [(None, Route((3, 0)), Route((1, 4))), (None, Route((2, 5)), Route((0, 6)))]
    assert r[0][1].weights is None  # the router's own weights of those ids


def test_a_failed_forced_run_is_reported_and_the_figures_stand(models, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no routes today")

    monkeypatch.setattr(kld, "numerics", broken)
    out = kld.kld(_args(models("qwen3moe", "Q8_0"), *CPU, "--tokens", "12"))
    assert out["ties"]["forced"] == {"error": "RuntimeError: no routes today"} and out["top1_agreement"] == 1.0
    out = kld.kld(_args(models("qwen3moe", "Q8_0"), *CPU, "--tokens", "12", "--no-forced"))
    assert out["ties"]["forced"] is None
