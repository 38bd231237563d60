"""Synthetic traces: determinism, validity, the granite preset's calibration, the 1M-token trace."""
from __future__ import annotations


import numpy as np
import pytest

import traces
from traces import stats
from moelab.trace_cli import main
from traces.synth import PRESETS, SynthParams, calibration_error, generate, signature


def test_deterministic_and_valid():
    a = generate(6, 16, 4, 200, SynthParams(), np.random.default_rng(1), num_seqs=3)
    b = generate(6, 16, 4, 200, SynthParams(), np.random.default_rng(1), num_seqs=3)
    c = generate(6, 16, 4, 200, SynthParams(), np.random.default_rng(2), num_seqs=3)
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    assert not np.array_equal(a.expert_ids, c.expert_ids)
    a.validate()
    srt = np.sort(np.asarray(a.expert_ids), axis=2)
    assert (srt[..., 1:] != srt[..., :-1]).all() and (srt >= 0).all()  # k distinct ids everywhere
    assert a.sequences() == [0, 1, 2] and a.pos[67].item() == 0


@pytest.mark.parametrize("field, value", [("reuse_prob", 1.0), ("zipf_s", -1.0), ("cross_layer", 2.0),
                                          ("reuse_lag_tokens", 0.5), ("topic_concentration", float("nan"))])
def test_params_validated(field, value):
    with pytest.raises(ValueError, match=f"SynthParams.{field}"):
        SynthParams(**{field: value})


def test_locality_parameters_act():
    lo = generate(8, 32, 4, 600, SynthParams(reuse_prob=0.05), np.random.default_rng(0), num_seqs=2)
    hi = generate(8, 32, 4, 600, SynthParams(reuse_prob=0.8), np.random.default_rng(0), num_seqs=2)
    assert stats.adjacent_overlap(hi) > stats.adjacent_overlap(lo) + 0.2
    flat = generate(8, 32, 4, 600, SynthParams(zipf_s=0.0, topic_concentration=50), np.random.default_rng(0))
    skew = generate(8, 32, 4, 600, SynthParams(zipf_s=2.0, topic_concentration=50), np.random.default_rng(0))
    assert stats.coverage(skew)["80%"] < stats.coverage(flat)["80%"]


@pytest.mark.parametrize("seed", [11, 12])
def test_granite_preset_reproduces_granite(granite, seed):
    p = PRESETS["granite"]
    caps = [4, 8, 16, 24]
    target = signature(granite.select("decode"), caps)
    t = generate(p.num_layers, p.num_experts, p.top_k, 4 * p.num_seqs * p.tokens_per_seq, p.params,
                 np.random.default_rng(seed), num_seqs=4 * p.num_seqs)
    err = calibration_error(target, signature(t, caps))
    assert max(err[f"lru@{c}"] for c in caps) < 3.0 and err["overlap"] < 3.0, err


def test_cli_synth_and_info(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "s"), "--layers", "4", "--experts", "16", "--top-k", "2",
                 "--tokens", "50", "--seqs", "2", "--seed", "3"]) == 0
    t = traces.load(tmp_path / "s", check=True)
    assert (len(t), t.num_layers, t.top_k, t.meta["seed"]) == (50, 4, 2, 3)
    assert main(["info", str(tmp_path / "s")]) == 0
    assert '"num_tokens": 50' in capsys.readouterr().out
    assert main(["synth", str(tmp_path / "x"), "--layers", "4"]) == 2 and not (tmp_path / "x").exists()


@pytest.mark.slow
def test_fit_recovers_granite_curve(granite):
    from traces.synth import fit
    p = fit(granite, num_random=20, passes=6, start=PRESETS["granite"].params)
    t = generate(24, 32, 8, 768, p, np.random.default_rng(5), num_seqs=12)
    err = calibration_error(signature(granite.select("decode"), [4, 8, 16, 24]), signature(t, [4, 8, 16, 24]))
    assert max(v for k, v in err.items() if k != "novelty_correlation") < 3.0, err


@pytest.mark.slow
def test_million_token_trace_written_and_memory_mapped(tmp_path):
    t = generate(48, 128, 8, 1_000_000, PRESETS["qwen3-30b-a3b"].params, np.random.default_rng(0), num_seqs=500)
    t.save(tmp_path / "big")
    del t
    back = traces.load(tmp_path / "big")
    assert len(back) == 1_000_000 and back.expert_ids.shape == (1_000_000, 48, 8)
    assert isinstance(back.expert_ids.base, np.memmap) or isinstance(back.expert_ids, np.memmap)
    toks = list(back.tokens(start=999_990))
    assert len(toks) == 10 and all(len(tok.steps) == 48 for tok in toks)


def test_rows_completed_from_a_narrow_topic_stay_distinct():
    """A topic too narrow for k experts is completed with unused ids: never one the row has (a masked
    entry once restored a used id's key, and a row listed that expert twice)."""
    from traces.synth import SynthParams, generate

    params = SynthParams(zipf_s=0.6, topic_concentration=0.035, topic_shift_prob=0.87, reuse_prob=0.48,
                         reuse_lag_tokens=4.0, cross_layer=0.23)
    for seed in range(3):
        generate(24, 32, 8, 60, params, np.random.default_rng(seed)).validate()  # raises on a repeated id
