"""Held-out evaluation: the default is chosen on the development cases only and is the one run on
the test cases; the targets are counted as stated; oracle stays a ceiling on the test families."""
from __future__ import annotations

import pytest

from simulate.evaluate import measure, summary, synthetic_cases
from simulate.heldout import (LITE, LOOKAHEAD_GRID, ONLINE, RETIRED, RETIRED_FAMILIES, TEST_FAMILIES, TEST_SEED,
                              ceiling, evaluate, grid_summary, held_out_cases, retired_cases, verdict)


def _row(x_lru, x_best, gap, smallest):
    return {"case": "c", "hardware": "h", "slots": 1, "smallest": smallest, "x_lru": x_lru, "x_best": x_best, "gap": gap}


def test_verdict_counts_the_targets_at_their_bounds():
    rows = [_row(1.2, 1.0, 0.4, True), _row(1.19, 1.0, 0.25, True), _row(1.5, 1.1, 0.6, False),
            _row(1.0, 0.999, 0.0, False), _row(None, None, None, True)]  # the last: policy refused
    v = verdict(rows)
    assert (v["runs"], v["best"], v["x12"]) == (4, 3, 2)
    assert v["gap"] == pytest.approx(0.325) and v["gap_small"] == pytest.approx(0.325)
    assert v["met"] == {"best": False, "x12": True, "gap": False, "gap_small": True}
    v = verdict([_row(1.3, 1.0, 0.5, True), _row(1.0, 1.0, 0.4, False)])
    assert all(v["met"].values())


def test_ceiling_names_a_run_above_oracle():
    res = {("c", "h", 2, "oracle"): {"tokens_per_s": 100.0}, ("c", "h", 2, "lru"): {"tokens_per_s": 90.0},
           ("c", "h", 2, "static"): {"tokens_per_s": 120.0}, ("c", "h", 2, "lookahead"): None}
    assert ceiling(res) == (1, [])  # static is offline, a refused run is skipped
    res["c", "h", 2, "hybrid"] = {"tokens_per_s": 100.5}
    assert ceiling(res) == (2, [("c", "h", 2, "hybrid")])


def test_held_out_cases_are_seeded_and_differ_from_the_development_set():
    a, b = held_out_cases(8), held_out_cases(8)
    assert [c.name for c in a] == [f[0] for f in TEST_FAMILIES]
    assert all(x.tokens == y.tokens for x, y in zip(a, b))
    assert held_out_cases(8, seed=5)[0].tokens != a[0].tokens
    for c, (_, L, E, k, _) in zip(a, TEST_FAMILIES):
        assert (c.model.num_layers, c.model.num_experts, c.model.top_k) == (L, E, k)
        assert c.slots == (max(k, E // 4), max(k, E // 2)) and len(c.tokens) == 8
    shape = lambda cs: {(c.model.num_layers, c.model.num_experts, c.model.top_k) for c in cs}
    retired = retired_cases(8)
    assert [c.name for c in retired] == [f[0] for f in RETIRED_FAMILIES] and {c.family for c in retired} == {"synthetic"}
    assert not (shape(synthetic_cases(8)) | shape(retired)) & shape(a)  # other geometries
    assert not {str(f[4]) for f in RETIRED_FAMILIES} & {str(f[4]) for f in TEST_FAMILIES}  # other statistics
    assert retired[0].tokens != held_out_cases(8, seed=TEST_SEED, families=RETIRED_FAMILIES)[0].tokens


def test_the_grid_configurations_are_valid_and_distinct():
    from scheduler.policies import LookaheadConfig

    configs = [LookaheadConfig(**g) for g in LOOKAHEAD_GRID]
    assert len(set(configs)) == len(configs) and LookaheadConfig() in configs and LITE in LOOKAHEAD_GRID


def test_grid_summary_counts_each_entry_against_lru_and_hybrid():
    run = lambda tps, us=1.0: {"tokens_per_s": tps, "plan_us": us}
    case = synthetic_cases(4)[0]
    raw = {}
    for s, (lru, hyb, a, b) in zip(case.slots, ((100.0, 110.0, 121.0, 100.0), (100.0, 90.0, 100.0, 81.0))):
        raw.update({(case.name, "h", s, "lru"): run(lru), (case.name, "h", s, "hybrid"): run(hyb),
                    (case.name, "h", s, "x#0"): run(a, 5.0), (case.name, "h", s, "x#1"): run(b, 3.0)})
    (g0, geo0, best0, n0, us0), (_, geo1, best1, _, _) = grid_summary(raw, [case], ["h"], "x", ({"a": 0}, {"a": 1}))
    assert g0 == {"a": 0} and n0 == 2 and us0 == 5.0
    assert geo0 == pytest.approx(1.1) and best0 == 2  # 1.21 and 1.0: at or above max(lru, hybrid) both times
    assert geo1 == pytest.approx(0.9) and best1 == 0


def test_the_default_is_chosen_on_the_development_cases_and_run_on_the_test_cases():
    dev, test = synthetic_cases(6)[:2], held_out_cases(6)[:1]
    grids = {"lookahead": ({"values": "recency"}, {"values": "adaptive", "fill_share": 0.0})}
    res, held, chosen = evaluate(dev, test, ["rtx4060-laptop"], grids, baselines=("lru", "hybrid", "oracle"))
    default, per = chosen["lookahead"]
    assert set(per) == {c.name for c in dev}
    for c in test:
        for s in c.slots:
            r = measure(c.tokens, c.model, "rtx4060-laptop", "lookahead", s, grids["lookahead"][default])
            got = dict(res[c.name, "rtx4060-laptop", s, "lookahead"])
            assert got.pop("plan_us") > 0 and r.pop("plan_us") > 0 and got == r  # all but the wall-clock
    assert {k[0] for k in held} == {c.name for c in dev}
    rows = summary(res, test, ["rtx4060-laptop"])
    assert len(rows) == 2 and all(r["x_lru"] is not None for r in rows)


def test_oracle_is_a_ceiling_on_the_test_families():
    res = {}
    for c in held_out_cases(12):
        for h in ("h200-xeon16", "rtx4060-laptop"):
            for s in c.slots:
                for p in ONLINE + ("oracle",):
                    res[c.name, h, s, p] = measure(c.tokens, c.model, h, p, s)
    n, bad = ceiling(res)
    assert n == len(TEST_FAMILIES) * 2 * 2 * len(ONLINE) and bad == []


def test_lookahead_loses_nothing_to_lru_or_hybrid_on_a_small_trace():
    """No margin: lookahead at its default is at or above max(lru, hybrid) in simulated tokens/s on
    48 tokens of a development family (top-8, the slow link); the same check sees a loss under the
    guard's margin (lookahead with frequency values, 0.2% below), so it can fail."""
    (seed, fam), = [(s, f) for s, fams in RETIRED for f in fams if f[0] == "dev2 k8 e32 weak-reuse high-cross"]
    c = held_out_cases(48, seed, (fam,))[0]
    tps = lambda p, o=None: measure(c.tokens, c.model, "rtx4060-laptop", p, 8, o)["tokens_per_s"]
    best = max(tps("lru"), tps("hybrid"))
    assert tps("lookahead") >= best
    assert 0.99 * best < tps("lookahead", {"values": "frequency"}) < best
