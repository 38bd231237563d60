"""experiments/hybrid_split.py and the claim it documents: on the H200 preset the cost-model
splits (hybrid, hybrid-cost) are at least as fast as lru and cpu at 2, 4 and 12 GiB (simulated,
development routing)."""
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
    rows = hybrid_split.with_ratios([hybrid_split.simulate_row("qwen3-30b-a3b", "synth", "h200-xeon16", mib, p, 128, 1)
                                     for p in ("lru", "cpu", "hybrid", "hybrid-cost")])
    assert not any(r["error"] for r in rows)
    assert hybrid_split.failures(rows) == []
    by = {r["policy"]: r for r in rows}
    assert by["hybrid"]["cpu_experts"] > 0 and by["hybrid"]["uploads"] > 0  # a split, not one side


def test_failures_names_a_slower_configuration():
    rows = [{"set": "development", "model": "m", "trace": "t", "hardware": "h", "cache_mib": 1.0, "policy": p,
             "tokens_per_s": v, "error": "", "hit_rate": 0.5, "uploads": 10, "cpu_experts": n}
            for p, v, n in (("lru", 10.0, 0), ("cpu", 5.0, 20), ("hybrid", 9.0, 3), ("hybrid-cost", 9.5, 0))]
    assert hybrid_split.failures(hybrid_split.with_ratios(rows)) == [
        "hybrid t h 1 MiB: 0.900x lru, 1.800x cpu", "hybrid-cost t h 1 MiB: 0.950x lru, 1.900x cpu"]


PEER_2048 = "docs/perf/peer_h200/budget-2048/result.json"


def test_small_run_writes_its_files_and_the_docs_section(tmp_path):
    docs = tmp_path / "SIM.md"
    docs.write_text(f"# Sim\n\n## Miss split\n\n{hybrid_split.BEGIN}\nOLD SECTION\n{hybrid_split.END}\n\n## After\n")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--tokens", "8", "--seeds", "1", "--dev-hardware", "rtx4060-laptop",
            "--held-out-hardware", "rtx4060-laptop", "--peer", str(ROOT / PEER_2048), "--docs", str(docs)]
    assert hybrid_split.main(argv) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "results.csv", "README.md", "hybrid_split.png"}
    rows = list(csv.DictReader(open(out / "results.csv")))
    P = len(hybrid_split.POLICIES)
    C = len(hybrid_split.CEILINGS)
    assert len(rows) == 6 * P + P + C
    assert [r["set"] for r in rows].count("held-out") == P + C
    lru = [r for r in rows if r["policy"] == "lru" and not r["error"]]
    assert lru and all(float(r["vs_lru"]) == 1.0 for r in lru)
    assert [r["error"] != "" for r in rows if r["cache_mib"] == "12288"] == [p != "cpu" for p in hybrid_split.POLICIES]
    held = {r["policy"]: r for r in rows if r["set"] == "held-out"}
    assert all(not r["error"] and float(r["tokens_per_s"]) > 0 for r in held.values())
    text = docs.read_text()
    assert "OLD SECTION" not in text and text.startswith("# Sim") and text.endswith("## After\n")
    assert "## Development set" in text and "## Held-out set" in text
    assert "| qwen3-30b-a3b / synth | rtx4060-laptop | 12288 | does not fit" in text
    assert "--tokens 8 --seeds 1 --dev-hardware rtx4060-laptop" in (out / "README.md").read_text()


def test_bad_input_refused(tmp_path, capsys):
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--tokens", "0"]) == 2
    assert "--tokens 0" in capsys.readouterr().err
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--seeds", "0"]) == 2
    assert "--seeds 0" in capsys.readouterr().err
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers\n")
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--docs", str(plain)]) == 2
    assert "hybrid_split markers" in capsys.readouterr().err
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--dev-hardware", "no-such-gpu"]) == 2
    assert "no-such-gpu" in capsys.readouterr().err
    lone = tmp_path / "result.json"
    lone.write_text((ROOT / PEER_2048).read_text())
    assert hybrid_split.main(["--out", str(tmp_path / "o"), "--peer", str(lone)]) == 2
    assert "no recorded trace" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
