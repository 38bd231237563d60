"""experiments/tokenizer_speed.py runs end to end on a small vocabulary and writes its figures."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
_spec = importlib.util.spec_from_file_location("tokenizer_speed", Path(__file__).parents[1] / "experiments" / "tokenizer_speed.py")
ts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ts)


def test_runs_and_writes_figures(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert ts.main(["--vocab", "2000", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["args"]["vocab"] == 2000 and res["read_tokenizer_s"] > 0 and res["per_char_ratio"] > 0
    assert set(res["encode_us_per_char"]) == {"1000", "4000", "16000"}
    assert "per-character time at 16000 vs 1000" in capsys.readouterr().out


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        ts.main(["--vocab", "10"])
    assert e.value.code == 2 and "--vocab" in capsys.readouterr().err
