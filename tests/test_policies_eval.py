"""experiments/policies_eval.py: a small version runs and writes a page of the committed one's
structure (held-out summary separate from tuning, a table per trace family); bad input refused."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("policies_eval", ROOT / "experiments" / "policies_eval.py")
policies_eval = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policies_eval)

SECTIONS = ["# Policies", "## Method", "## Policies", "## Chosen configurations", "## Held-out summary (lookahead)",
            "## Tables: real traces", "## Tables: synthetic traces", "## Known limits", "## Command"]


def structure(text: str) -> tuple[list[str], list[str]]:
    heads = [l for l in text.splitlines() if l.startswith("#")]
    paras = re.findall(r"^\*\*([\w -]+)\*\*\. ", text, flags=re.M)
    return heads, paras


def test_small_run_matches_the_committed_structure(tmp_path):
    out = tmp_path / "p.md"
    assert policies_eval.main(["--tokens", "6", "--hardware", "rtx4060-laptop", "--out", str(out), "--quiet"]) == 0
    small = out.read_text()
    committed = (ROOT / "docs" / "POLICIES.md").read_text()
    for text in (small, committed):
        heads, paras = structure(text)
        assert heads == SECTIONS
        assert paras == list(policies_eval.ROWS)
        assert "tuning: x lru" in text and "x max(lru, hybrid)" in text
    assert "--tokens 6 --hardware rtx4060-laptop" in small
    # lru's own rows read x1.00 everywhere
    rows = [l for l in small.splitlines() if l.startswith("| lru |")]
    assert rows and all(c.count("(x1.00)") == 2 for c in rows)


def test_bad_input_refused(capsys, tmp_path):
    assert policies_eval.main(["--tokens", "1", "--out", str(tmp_path / "p.md")]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert policies_eval.main(["--hardware", "nope", "--out", str(tmp_path / "p.md")]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()
