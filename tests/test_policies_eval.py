"""experiments/policies_eval.py: a small version runs and writes a document of the committed one's
structure; the committed docs/POLICIES.md has every policy's paragraph and table row."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("policies_eval", ROOT / "experiments" / "policies_eval.py")
policies_eval = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policies_eval)

SECTIONS = ["# Policies", "## Method", "## Policies", "## Hit rate (gap closed)",
            "## Experts moved over PCIe per token", "## Forecast precision",
            "## Simulated tokens/s (granite test, ratio to lru)", "## Scheduler cost (granite test, 8 slots)",
            "## Known limits", "## Command"]


def structure(text: str) -> tuple[list[str], list[str], list[str]]:
    """(headings, policies with a paragraph, policies with a row in every table)."""
    heads = [l for l in text.splitlines() if l.startswith("#")]
    paras = re.findall(r"^\*\*([\w -]+)\*\*\. ", text, flags=re.M)
    rows = [l.split("|")[1].strip() for l in text.splitlines() if l.startswith("| ") and not l.startswith("| policy")]
    return heads, paras, sorted(set(r for r in rows if rows.count(r) == 4))


def test_small_run_matches_the_committed_structure(tmp_path):
    out = tmp_path / "p.md"
    assert policies_eval.main(["--tokens", "6", "--hardware", "rtx4060-laptop", "--out", str(out)]) == 0
    small = out.read_text()
    committed = (ROOT / "docs" / "POLICIES.md").read_text()
    for text in (small, committed):
        heads, paras, rows = structure(text)
        assert heads == SECTIONS
        assert paras == list(policies_eval.POLICIES)
        assert rows == sorted(policies_eval.POLICIES)
    assert "--tokens 6 --hardware rtx4060-laptop" in small
    # lru closes none of the gap and belady all of it, wherever the gap is defined
    for name, want in (("lru", "0.0%"), ("belady", "100.0%")):
        row = next(l for l in small.splitlines() if l.startswith(f"| {name} |"))
        cells = re.findall(r"\(([-\d.]+%|n/a)\)", row)
        assert cells and all(c in (want, "n/a") for c in cells)


def test_gap_is_the_share_of_lru_to_belady():
    r = lambda h: {"hit_rate": h, "moved_per_token": 0.0}
    rates = {("p", 8, "lru"): r(0.4), ("p", 8, "belady"): r(0.6), ("p", 8, "x"): r(0.5)}
    assert abs(policies_eval.gap(rates, "p", 8, "x") - 0.5) < 1e-12
    rates[("p", 8, "belady")] = r(0.4)
    assert policies_eval.gap(rates, "p", 8, "x") is None


def test_bad_tokens_refused(capsys, tmp_path):
    assert policies_eval.main(["--tokens", "1", "--out", str(tmp_path / "p.md")]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()
