"""experiments/policies_eval.py: a small version runs and writes a page of the committed one's
structure (a short reference: the targets on the development set and on each held-out seed apart;
the rest in the run folder) and its run folder; every run says where 1.2x lru is out of oracle's
reach; a real trace given with --real is a held-out set of its own, run at the default only; the
committed run's lookahead and hybrid-cost defaults are the dataclasses'; bad input refused, nothing written."""
from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np

from scheduler.policies import HybridCostConfig, LookaheadConfig

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("policies_eval", ROOT / "experiments" / "policies_eval.py")
policies_eval = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policies_eval)

SECTIONS = ["# Policies", "## Method", "## Targets", "## Per trace family", "## Known limits", "## Command"]
RUN_SECTIONS = ["# policies_eval run: every policy on every trace", "## Policies", "## Chosen configuration",
                "## Held out: seed 3", "## Held out: seed 4", "## Held out: real", "## Development set",
                "## Every policy", "### Held out, seed 3", "### Held out, seed 4", "### Held out, real",
                "### Development set"]
COLUMNS = "| target | development (tuning) | held out, seed 3 | held out, seed 4 | held out, real |"


def committed() -> Path:
    """The recorded run: the folder under docs/perf/policies_eval that docs/POLICIES.md links to."""
    link = re.search(r"\]\((perf/policies_eval/[^)]+)/README\.md\)", (ROOT / "docs" / "POLICIES.md").read_text())
    assert link, "docs/POLICIES.md links to no run folder under perf/policies_eval"
    return ROOT / "docs" / link.group(1)


def write_real(path: Path) -> None:
    """A small vLLM-profiler JSONL of a synthetic 6x8 top-2 trace (the importer's format)."""
    from tests.traces.conftest import write_vllm
    from traces import synth

    t = synth.generate(6, 8, 2, 12, synth.SynthParams(), np.random.default_rng(5), num_seqs=2)
    write_vllm(path, t)


def structure(text: str) -> tuple[list[str], list[str]]:
    heads = [l for l in text.splitlines() if l.startswith("#")]
    paras = re.findall(r"^\*\*([\w -]+)\*\*\. ", text, flags=re.M)
    return heads, paras


def test_small_run_matches_the_committed_structure(tmp_path, monkeypatch):
    out, run, real = tmp_path / "p.md", tmp_path / "run", tmp_path / "r.jsonl"
    write_real(real)
    full = policies_eval.dev_cases
    monkeypatch.setattr(policies_eval, "dev_cases", lambda limit: full(limit)[1::4])  # a few, for time
    assert policies_eval.main(["--tokens", "4", "--hardware", "rtx4060-laptop", "--out", str(out),
                               "--run-dir", str(run), "--quiet", "--real", f"tiny-real=vllm:{real}"]) == 0
    small = out.read_text()
    recorded = committed()
    for text, folder, n_hw in ((small, run, 1), ((ROOT / "docs" / "POLICIES.md").read_text(), recorded,
                                                 len(policies_eval.HARDWARE))):
        readme = (folder / "README.md").read_text()
        assert structure(text)[0] == SECTIONS and len(text.encode()) <= 15_000  # a reference page
        assert COLUMNS in text and COLUMNS in readme  # the development set's figures apart from each held-out set's
        heads, paras = structure(readme)
        assert heads == RUN_SECTIONS and paras == list(policies_eval.ROWS) and "grid held out" in readme
        held = [l for l in readme.splitlines() if l.startswith(("| test ", "| held "))]
        assert len(held) == 2 * n_hw * sum(len(f) for _, f in policies_eval.HELD)
        for row in held:  # oracle / lru, and its reach
            oracle = float(row.split(" | ")[9].split()[0])
            assert (oracle < 1.2) == ("1.2x out of reach" in row)
        assert "- *Held out, real*: " in text and "| held out, real | " in text  # its own column and family rows
        assert "Why 1.2x lru on half the runs is missed" in text and "measured against the fastest of the four" in text
    assert "--tokens 4 --hardware rtx4060-laptop --real tiny-real=vllm:" in small
    assert "](run/README.md)" in small
    rows = list(csv.DictReader((run / "results.csv").open()))
    assert {r["set"] for r in rows} == {"dev", "test3", "test4", "real"}
    # the real trace runs every policy once per hardware and cache size: lookahead at its default only
    real_rows = [r for r in rows if r["set"] == "real"]
    assert {r["case"] for r in real_rows} == {"tiny-real"} and len(real_rows) == 2 * len(policies_eval.ROWS)
    assert {r["slots"] for r in real_rows} == {"2", "4"}  # 1/4 and 1/2 of 8 experts, at least top-2
    assert all("#" not in r["policy"] for r in rows)
    # each held-out family carries one lookahead configuration per run, lru reads x1.00 in the tables
    for seed, fams in policies_eval.HELD:
        assert len([r for r in rows if r["set"] == f"test{seed}" and r["policy"] == "lookahead"]) == 2 * len(fams)
    lru_rows = [l for l in (run / "README.md").read_text().splitlines() if l.startswith("| lru |")]
    assert lru_rows and all(l.count("(x1.00)") == 2 for l in lru_rows)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["real_held_out"]["tiny-real"]["blob"] == policies_eval.blob_id(real)
    assert cfg["command"].endswith(f"--tokens 4 --hardware rtx4060-laptop --real tiny-real=vllm:{real}")
    assert cfg["test_seeds"] == [3, 4]


def test_the_committed_default_is_the_dataclass_default():
    """The run's choice on the development set is what LookaheadConfig() runs, and the page says it."""
    run = committed()
    cfg = json.loads((run / "config.json").read_text())
    default = dataclasses.asdict(LookaheadConfig())
    assert all(default[k] == v for k, v in cfg["lookahead_default"].items())
    assert all(default[k] == v for k, v in cfg["lookahead_fixed"].items() if k in default)
    assert "(the `LookaheadConfig` default)" in (run / "README.md").read_text()
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
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dataset": "x", "problem_id": 0, "layer": 0, "token_idx": 0, "experts": "no"}\n')
    for spec, says in ((f"x=nope:{bad}", "FORMAT one of"), (f"x:{bad}", "NAME=FORMAT:PATH"),
                       (f"x=vllm:{tmp_path / 'none.jsonl'}", "does not exist"), (f"x=vllm:{bad}", "line 1"),
                       (f"granite=vllm:{bad}", "already a trace")):
        assert policies_eval.main(["--real", spec, "--out", str(tmp_path / "p.md")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("--real: ") and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.md").exists()
