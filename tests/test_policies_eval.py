"""experiments/policies_eval.py: a small version runs and writes a page of the committed one's
structure (a short reference: the targets on the development set and on each held-out seed apart;
the rest in the run folder) and its run folder; every run says where 1.2x lru is out of oracle's
reach; the committed run's lookahead and hybrid-cost defaults are the dataclasses'; bad input refused,
nothing written."""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

from scheduler.policies import HybridCostConfig, LookaheadConfig

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("policies_eval", ROOT / "experiments" / "policies_eval.py")
policies_eval = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policies_eval)

SECTIONS = ["# Policies", "## Method", "## Targets", "## Known limits", "## Command"]
RUN_SECTIONS = ["# policies_eval run: every policy on every trace", "## Policies", "## Chosen configuration",
                "## Held out: seed 3", "## Held out: seed 4", "## Development set", "## Every policy",
                "### Held out, seed 3", "### Held out, seed 4", "### Development set"]
COLUMNS = "| target | development (tuning) | held out, seed 3 | held out, seed 4 |"
RUN = ROOT / "docs" / "perf" / "policies_eval"


def structure(text: str) -> tuple[list[str], list[str]]:
    heads = [l for l in text.splitlines() if l.startswith("#")]
    paras = re.findall(r"^\*\*([\w -]+)\*\*\. ", text, flags=re.M)
    return heads, paras


def test_small_run_matches_the_committed_structure(tmp_path, monkeypatch):
    out, run = tmp_path / "p.md", tmp_path / "run"
    full = policies_eval.dev_cases
    monkeypatch.setattr(policies_eval, "dev_cases", lambda limit: full(limit)[1::4])  # a few, for time
    assert policies_eval.main(["--tokens", "4", "--hardware", "rtx4060-laptop", "--out", str(out),
                               "--run-dir", str(run), "--quiet"]) == 0
    small = out.read_text()
    committed = (ROOT / "docs" / "POLICIES.md").read_text()
    for text, folder, n_hw in ((small, run, 1), (committed, RUN, len(policies_eval.HARDWARE))):
        readme = (folder / "README.md").read_text()
        assert structure(text)[0] == SECTIONS and len(text) < 10_000  # a few screens
        assert COLUMNS in text and COLUMNS in readme  # the development set's figures apart from each seed's
        heads, paras = structure(readme)
        assert heads == RUN_SECTIONS and paras == list(policies_eval.ROWS) and "grid held out" in readme
        held = [l for l in readme.splitlines() if l.startswith(("| test ", "| held "))]
        assert len(held) == 2 * n_hw * sum(len(f) for _, f in policies_eval.HELD)
        for row in held:  # oracle / lru, and its reach
            oracle = float(row.split(" | ")[9].split()[0])
            assert (oracle < 1.2) == ("1.2x out of reach" in row)
    assert "--tokens 4 --hardware rtx4060-laptop" in small
    assert "](run/README.md)" in small
    rows = list(csv.DictReader((run / "results.csv").open()))
    assert {r["set"] for r in rows} == {"dev", "test3", "test4"}
    # each held-out family carries one lookahead configuration per run, lru reads x1.00 in the tables
    for seed, fams in policies_eval.HELD:
        assert len([r for r in rows if r["set"] == f"test{seed}" and r["policy"] == "lookahead"]) == 2 * len(fams)
    lru_rows = [l for l in (run / "README.md").read_text().splitlines() if l.startswith("| lru |")]
    assert lru_rows and all(l.count("(x1.00)") == 2 for l in lru_rows)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["command"].endswith("--tokens 4 --hardware rtx4060-laptop") and cfg["test_seeds"] == [3, 4]


def test_the_committed_default_is_the_dataclass_default():
    """The run's choice on the development set is what LookaheadConfig() runs, and the page says it."""
    cfg = json.loads((RUN / "config.json").read_text())
    default = dataclasses.asdict(LookaheadConfig())
    assert all(default[k] == v for k, v in cfg["lookahead_default"].items())
    assert all(default[k] == v for k, v in cfg["lookahead_fixed"].items() if k in default)
    assert "(the `LookaheadConfig` default)" in (RUN / "README.md").read_text()
    hc = dataclasses.asdict(HybridCostConfig())  # the grid's choice, but the prefetch off (measured)
    assert all(hc[k] == v for k, v in cfg["hybrid_cost_default"].items() if k != "prefetch")
    assert hc["prefetch"] == 0 and "off by default, `HybridCostConfig`" in (ROOT / "docs" / "POLICIES.md").read_text()
    for seed, fams in policies_eval.HELD:
        assert [f[0] for f in cfg["test_families"][str(seed)]] == [f[0] for f in fams]


def test_bad_input_refused(capsys, tmp_path):
    assert policies_eval.main(["--tokens", "1", "--out", str(tmp_path / "p.md")]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert policies_eval.main(["--hardware", "nope", "--out", str(tmp_path / "p.md")]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert policies_eval.main(["--run-dir", str(tmp_path / "no" / "run"), "--out", str(tmp_path / "p.md")]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()
