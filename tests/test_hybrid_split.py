"""experiments/hybrid_split.py and the claim it documents: on the H200 preset the cost-model
splits (hybrid, hybrid-cost) are at least as fast as lru and cpu at 2, 4 and 12 GiB (simulated)."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("hybrid_split", ROOT / "experiments" / "hybrid_split.py")
hybrid_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hybrid_split)


@pytest.mark.parametrize("mib", [2048, 4096, 12288])
def test_cost_model_splits_are_no_slower_than_lru_and_cpu_on_the_h200_preset(mib):
    rows = hybrid_split.with_ratios([hybrid_split.simulate_row("qwen3-30b-a3b", "synth", "h200-xeon16", mib, p, 128, 0)
                                     for p in ("lru", "cpu", "hybrid", "hybrid-cost")])
    assert not any(r["error"] for r in rows)
    assert hybrid_split.failures(rows) == []
    by = {r["policy"]: r for r in rows}
    assert by["hybrid"]["cpu_experts"] > 0 and by["hybrid"]["uploads"] > 0  # a split, not one side


def test_failures_names_a_slower_configuration():
    rows = [{"model": "m", "trace": "t", "hardware": "h", "cache_mib": 1.0, "policy": p, "tokens_per_s": v, "error": "",
             "hit_rate": 0.5, "uploads": 10, "cpu_experts": n}
            for p, v, n in (("lru", 10.0, 0), ("cpu", 5.0, 20), ("hybrid", 9.0, 3), ("hybrid-cost", 9.5, 0))]
    assert hybrid_split.failures(hybrid_split.with_ratios(rows)) == [
        "hybrid m h 1 MiB: 0.900x lru, 1.800x cpu", "hybrid-cost m h 1 MiB: 0.950x lru, 1.900x cpu (lru's decisions)"]


def test_small_run_writes_its_files_and_the_docs_section(tmp_path):
    docs = tmp_path / "SIM.md"
    docs.write_text(f"# Sim\n\n## Miss split\n\n{hybrid_split.BEGIN}\nold\n{hybrid_split.END}\n\n## After\n")
    out = tmp_path / "out"
    assert hybrid_split.main(["--out", str(out), "--tokens", "8", "--hardware", "rtx4060-laptop",
                              "--docs", str(docs)]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "results.csv", "README.md", "hybrid_split.png"}
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 6 * len(hybrid_split.POLICIES)
    lru = [r for r in rows if r["policy"] == "lru" and not r["error"]]
    assert lru and all(float(r["vs_lru"]) == 1.0 for r in lru)
    assert [r["error"] != "" for r in rows if r["cache_mib"] == "12288"] == [True] * len(hybrid_split.POLICIES)
    text = docs.read_text()
    assert "old" not in text and text.startswith("# Sim") and text.endswith("## After\n")
    assert "| qwen3-30b-a3b / synth | rtx4060-laptop | 12288 | does not fit" in text
    assert "--tokens 8 --hardware rtx4060-laptop" in (out / "README.md").read_text()


def test_bad_input_refused(tmp_path, capsys):
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--tokens", "0"]) == 2
    assert "--tokens 0" in capsys.readouterr().err
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers\n")
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--docs", str(plain)]) == 2
    assert "hybrid_split markers" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
