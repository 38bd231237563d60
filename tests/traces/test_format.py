"""The trace schema: invariants, save/load round trip, memory mapping, and the tokens it yields."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import traces
from scheduler import Geometry
from traces.format import HEADER_NAME, Trace, TraceError

from .conftest import small_trace


def _reference_steps(trace: Trace, row: int):
    """Plain-Python expectation: distinct non-masked ids in order, repeat weights summed."""
    out = []
    for l in trace.moe_layers:
        ids, ws = [], []
        for j, e in enumerate(trace.expert_ids[row, l].tolist()):
            if e < 0:
                continue
            w = None if trace.weights is None else float(trace.weights[row, l, j])
            if e in ids:
                if w is not None:
                    ws[ids.index(e)] += w
                continue
            ids.append(e)
            ws.append(w)
        if ids:
            out.append((l, tuple(ids), None if trace.weights is None else tuple(ws)))
    return out


def test_bundled_trace_shape(granite):
    assert (granite.num_layers, max(granite.num_experts), granite.top_k) == (24, 32, 8)
    assert len(granite) == 39 + 44 + 29 + 3 * 64
    assert len(granite.rows("decode")) == 192 and len(granite.rows("prefill")) == 112
    assert granite.sequences() == [0, 1, 2]
    assert granite.meta["license"] == "MIT"
    assert isinstance(granite.expert_ids, np.memmap) or isinstance(granite.expert_ids.base, np.memmap)
    granite.validate()


def test_tokens_follow_the_rows(granite):
    toks = list(granite.tokens("decode"))
    rows = granite.rows("decode")
    assert [t.index for t in toks] == list(range(192))
    for tok, r in zip(toks[::17], rows[::17]):
        assert (tok.seq, tok.pos, tok.phase) == (granite.seq[r], granite.pos[r], "decode")
        assert [(s.layer, s.experts, s.weights) for s in tok.steps] == _reference_steps(granite, r)
    assert [t.pos for t in granite.tokens("decode", start=64, limit=2)] == [44, 45]
    assert next(granite.tokens("decode", start=64)).index == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), mask=st.sampled_from([0.0, 0.3]), weights=st.booleans())
def test_tokens_match_reference(seed, mask, weights):
    t = small_trace(np.random.default_rng(seed), T=30, mask_share=mask, weights=weights)
    ids = np.array(t.expert_ids)
    if seed % 3 == 0:  # repeated ids in a row must collapse into one expert
        ids[0, 0, 1] = ids[0, 0, 0]
        t = Trace(t.model, t.num_experts, t.top_k, ids, t.seq, t.pos, t.phase, t.weights, check=False)
    for tok in t.tokens():
        got = [(s.layer, s.experts, s.weights) for s in tok.steps]
        assert len(got) == len(_reference_steps(t, tok.index))
        for (l, e, w), (rl, re, rw) in zip(got, _reference_steps(t, tok.index)):
            assert (l, e) == (rl, re)
            assert (w is None) == (rw is None)
            if w is not None:
                np.testing.assert_allclose(w, rw, rtol=1e-6)


def test_dense_layers_have_no_steps():
    rng = np.random.default_rng(0)
    ids = np.full((5, 3, 2), -1, np.int16)
    ids[:, 1] = [rng.permutation(4)[:2] for _ in range(5)]
    t = Trace("m", (0, 4, 0), 2, ids, np.zeros(5), np.arange(5), np.ones(5))
    assert all([s.layer for s in tok.steps] == [1] for tok in t.tokens())
    g = t.geometry(1000)
    assert isinstance(g, Geometry) and g.expert_bytes == (0, 1000, 0) and g.num_experts == (0, 4, 0)


def test_save_load_roundtrip(tmp_path, tiny):
    tiny.save(tmp_path / "t")
    back = traces.load(tmp_path / "t", check=True)
    for name in ("expert_ids", "weights", "seq", "pos", "phase"):
        np.testing.assert_array_equal(getattr(back, name), getattr(tiny, name))
    assert (back.model, back.num_experts, back.top_k, back.meta) == (tiny.model, tiny.num_experts, tiny.top_k, tiny.meta)
    assert [tuple(t.steps) for t in back.tokens()] == [tuple(t.steps) for t in tiny.tokens()]
    tiny.select(seqs=[1]).save(tmp_path / "t")  # replacing an existing trace directory
    assert set(traces.load(tmp_path / "t").seq.tolist()) == {1}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_save_refuses_a_non_trace_directory(tmp_path, tiny):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(TraceError, match="not a trace directory"):
        tiny.save(tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_failed_save_leaves_nothing(tmp_path, tiny, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr("traces.format._save_array", boom)
    with pytest.raises(OSError):
        tiny.save(tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("change, message", [
    (lambda h: h.update(schema_version=2), "schema_version 2"),
    (lambda h: h.update(num_tokens=3), "num_tokens=3"),
    (lambda h: h.update(top_k="8"), "top_k"),
    (lambda h: h.pop("num_experts"), "num_experts"),
])
def test_load_rejects_bad_headers(tmp_path, tiny, change, message):
    tiny.save(tmp_path / "t")
    h = json.loads((tmp_path / "t" / HEADER_NAME).read_text())
    change(h)
    (tmp_path / "t" / HEADER_NAME).write_text(json.dumps(h))
    with pytest.raises(TraceError, match=message):
        traces.load(tmp_path / "t")


def test_load_rejects_wrong_arrays(tmp_path, tiny):
    tiny.save(tmp_path / "t")
    np.save(tmp_path / "t" / "expert_ids.npy", np.zeros((len(tiny), 3, 4), np.int16))
    with pytest.raises(TraceError, match="expert_ids: shape"):
        traces.load(tmp_path / "t")
    with pytest.raises(TraceError, match="not a trace directory"):
        traces.load(tmp_path)


def test_validate_catches_bad_entries(tiny):
    ids = np.array(tiny.expert_ids)
    ids[3, 2, 1] = 16
    with pytest.raises(TraceError, match="row 3 layer 2: id 16 out of range"):
        Trace("m", tiny.num_experts, tiny.top_k, ids, tiny.seq, tiny.pos, tiny.phase)
    w = np.array(tiny.weights)
    w[5, 0, 0] = np.nan
    with pytest.raises(TraceError, match="row 5"):
        Trace("m", tiny.num_experts, tiny.top_k, tiny.expert_ids, tiny.seq, tiny.pos, tiny.phase, w)


def test_routing_counts_and_select(granite):
    c = granite.routing_counts("decode")
    assert c.shape == (24, 32) and c.sum() == 192 * 24 * 8
    sub = granite.select("decode", seqs=[2])
    assert len(sub) == 64 and set(sub.phase.tolist()) == {1}
    np.testing.assert_array_equal(sub.routing_counts(), granite.select("decode", seqs=[2]).routing_counts())
    assert (c >= sub.routing_counts()).all()
