"""The peer benchmark's rows as their commands ran them (simulate.peer): hybrid's share from the
command line, the recorded trace stepped in the run's batches."""
from __future__ import annotations

import pytest

from scheduler import MISS_FRAC_256, Step, Token
from simulate.peer import batched_tokens, miss_fraction_of


def test_hybrids_share_is_the_commands():
    run = ["python", "-m", "moelab", "run", "m.gguf", "--policy", "hybrid", "--cache-mib", "4096"]
    assert miss_fraction_of(run) == MISS_FRAC_256 / 256  # no --hardware: the fixed default share
    assert miss_fraction_of(run + ["--hardware", "cal.json"]) is None  # the cost model's share
    assert miss_fraction_of(run + ["--hardware", "cal.json", "--miss-fraction", "0.5"]) == 0.5
    assert miss_fraction_of(run + ["--miss-fraction=0.25"]) == 0.25


def test_rows_are_stepped_in_the_runs_batches():
    rows = [Token(i, 0, i, "prefill" if i < 3 else "decode", (Step(0, (i % 2, 2)),)) for i in range(6)]
    out = batched_tokens(rows, [3, 1, 1])
    assert [(t.index, t.pos, t.phase, t.num_tokens) for t in out] == [(0, 0, "prefill", 3), (1, 3, "decode", 1),
                                                                      (2, 4, "decode", 1), (3, 5, "decode", 1)]
    step = out[0].steps[0]
    assert dict(zip(step.experts, step.counts)) == {0: 2, 2: 3, 1: 1}
    with pytest.raises(ValueError, match="batches"):
        batched_tokens(rows, [4, 4])
