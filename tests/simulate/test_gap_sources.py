"""The sentences that say where oracle's lead comes from and what another selection rule would
choose: ``early_moves`` (the share of oracle's lead over oracle-demand each kind of early move keeps)
and ``count_rule`` (the grid entry with the most runs at or above max(lru, hybrid), against the
chosen one, on the real traces)."""
from __future__ import annotations

from dataclasses import replace

from simulate.evaluate import synthetic_cases
from simulate.heldout import count_rule, early_moves, grid_summary


def _run(tps: float) -> dict:
    return {"tokens_per_s": tps, "plan_us": 1.0}


def test_early_moves_reports_each_kind_share_of_the_lead_per_preset():
    case = synthetic_cases(4)[0]
    res = {}
    for s in case.slots:  # lead 100 -> 200 on "a"; prefetch keeps 25%, fills 100%; no lead on "b"
        res.update({(case.name, "a", s, "oracle-demand"): _run(100.0), (case.name, "a", s, "oracle"): _run(200.0),
                    (case.name, "a", s, "oracle-prefetch"): _run(125.0), (case.name, "a", s, "oracle-fills"): _run(200.0),
                    (case.name, "b", s, "oracle-demand"): _run(100.0), (case.name, "b", s, "oracle"): _run(100.0),
                    (case.name, "b", s, "oracle-prefetch"): _run(100.0), (case.name, "b", s, "oracle-fills"): _run(100.0)})
    text = early_moves(res, [("set", [case])], ["a", "b"])
    assert "prefetch alone keeps (set 25% / n/a)" in text and "fills alone (set 100% / n/a)" in text


def test_count_rule_names_the_entry_with_more_wins_and_what_it_costs_on_a_real_trace():
    case = replace(synthetic_cases(4)[0], name="real one", family="real")
    raw = {}
    for s, (a, b) in zip(case.slots, ((150.0, 100.0), (99.5, 100.0))):  # entry 0: x1.5 and a loss; 1: two ties
        raw.update({(case.name, "h", s, "lru"): _run(100.0), (case.name, "h", s, "hybrid"): _run(100.0),
                    (case.name, "h", s, "x#0"): _run(a), (case.name, "h", s, "x#1"): _run(b)})
    grid = grid_summary(raw, [case], ["h"], "x", ({"a": 0}, {"a": 1}))
    text = count_rule(raw, [case], ["h"], grid, 0, "x")
    assert text.startswith("Counting runs at or above max(lru, hybrid) first would choose `{'a': 1}` (2 of 2 against 1")
    assert f"real one h {case.slots[0]} x1.00 against x1.50" in text and f"h {case.slots[1]} x" not in text
    assert count_rule(raw, [case], ["h"], grid, 1, "x").endswith("would choose the same entry.")
