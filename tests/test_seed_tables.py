"""experiments/reproduce_seed_tables.py: a small run has the committed report's structure and rows;
the committed report is what its own command writes (slow); bad data files are refused up front."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "reproduce_seed_tables.py"
DOC = ROOT / "docs" / "SEED_TABLES.md"
LAST = re.compile(r"^rows within 15%: (\d+) of (\d+); hybrid/cache speedup error: laptop (\d+)%, L4 (\d+)%$")


def _script():
    spec = importlib.util.spec_from_file_location("reproduce_seed_tables", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(text: str) -> list[tuple[str, str]]:
    """(row label, published t/s) of every table row under a machine/model heading."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 8 and cells[1] and cells[1][0].isdigit():
            out.append((cells[0], cells[1]))
    return out


def test_small_run_has_the_committed_structure_and_rows(tmp_path):
    out = tmp_path / "seed.md"
    assert _script().main(["--seeds", "1", "--tokens-scale", "0.05", "--out", str(out)]) == 0
    small, committed = out.read_text(), DOC.read_text()
    heads = lambda t: [l for l in t.splitlines() if l.startswith("#")]
    assert heads(small) == heads(committed)
    for h in ("## Method", "## Errors", "## Known limits"):
        assert h in heads(committed)
    assert _rows(small) == _rows(committed)
    data = json.loads((ROOT / "experiments" / "seed_tables.json").read_text())
    published = [f"{v:.1f}" for t in data["tables"] for v in t["rows"].values()]
    assert [p for _, p in _rows(committed)] == published
    for text in (small, committed):
        m = LAST.match(text.rstrip("\n").splitlines()[-1])
        assert m, text.splitlines()[-1]
        n, total = int(m.group(1)), int(m.group(2))
        fit = sum(1 for label, _ in _rows(text) if label.endswith("(fit)"))
        assert 0 <= n <= total == len(_rows(text)) - fit


@pytest.mark.slow
def test_committed_report_is_what_its_command_writes(tmp_path):
    committed = DOC.read_text()
    cmd = re.search(r"Command: `python experiments/reproduce_seed_tables.py(.*?) --out docs/SEED_TABLES.md`", committed)
    assert cmd, "the report names its command"
    out = tmp_path / "seed.md"
    assert _script().main(shlex.split(cmd.group(1)) + ["--out", str(out)]) == 0
    assert out.read_text() == committed


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("tables"), "'tables'"),
    (lambda d: d["tables"][0].pop("cache_mib"), "tables[0] has no field 'cache_mib'"),
    (lambda d: d["tables"][0]["rows"].update(cpu=-1), "tables[0].rows.cpu"),
    (lambda d: d["tables"][1]["rows"].update(belady=3.0), "tables[1].rows.belady: unknown row"),
    (lambda d: d["tables"][0].update(machine="h100"), "tables[0].machine 'h100'"),
])
def test_bad_data_file_is_refused_before_any_work(tmp_path, capsys, edit, field):
    data = json.loads((ROOT / "experiments" / "seed_tables.json").read_text())
    edit(data)
    bad, out = tmp_path / "bad.json", tmp_path / "out.md"
    bad.write_text(json.dumps(data))
    assert _script().main(["--data", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr()
    assert field in err.err and str(bad) in err.err and len(err.err.strip().splitlines()) == 1
    assert err.out == "" and not out.exists()
