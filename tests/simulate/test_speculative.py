"""Speculative decoding: rows grouped into verification batches, tokens produced counted right."""
import numpy as np
import pytest

from scheduler import Step, Token
from simulate.speculative import merge_rows, verify_batches


def rows(n, seq_len=100):
    return [Token(i, i // seq_len, i % seq_len, "decode", (Step(0, (i % 4, 4 + i % 3)), Step(1, (i % 2,))))
            for i in range(n)]


def test_merge_counts_tokens_per_expert():
    t = merge_rows(rows(3), 0)
    assert t.num_tokens == 3
    assert t.steps[0].experts == (0, 4, 1, 5, 2, 6) and t.steps[0].counts == (1, 1, 1, 1, 1, 1)
    assert t.steps[1].experts == (0, 1) and t.steps[1].counts == (2, 1)


def test_full_acceptance_produces_draft_plus_one_per_step():
    batches, produced = verify_batches(rows(12), 3, 1.0, np.random.default_rng(0))
    assert produced == 12 and len(batches) == 3 and all(b.num_tokens == 4 for b in batches)


def test_zero_acceptance_produces_one_per_step():
    batches, produced = verify_batches(rows(5), 2, 0.0, np.random.default_rng(0))
    assert produced == 5 and len(batches) == 5
    assert [b.num_tokens for b in batches] == [3, 3, 3, 2, 1]  # the tail runs out of rows


def test_plain_decode_is_unchanged_and_batches_stay_in_their_sequence():
    batches, produced = verify_batches(rows(6), 0, 0.5, np.random.default_rng(0))
    assert produced == 6 and all(b.num_tokens == 1 for b in batches)
    batches, _ = verify_batches(rows(6, seq_len=3), 4, 1.0, np.random.default_rng(0))
    assert [(b.seq, b.num_tokens) for b in batches] == [(0, 3), (1, 3)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="acceptance"):
        verify_batches(rows(2), 1, 1.5, np.random.default_rng(0))
