"""The simulator streams a trace's tokens: memory does not grow with the number of tokens run."""
from __future__ import annotations

import tracemalloc

import numpy as np

import traces
from simulate.run import SimConfig, TraceTokens, load_tokens, run
from scheduler.models import load_model
from traces.synth import SynthParams, generate


def _peak_bytes(cfg: SimConfig) -> int:
    tracemalloc.start()
    try:
        result, _ = run(cfg)
        assert result.summary()["tokens"] == cfg.tokens
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_flat_in_the_number_of_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr("traces.format._CACHE_ENTRIES", 0)  # as a trace too long for the step cache
    generate(24, 32, 8, 3200, SynthParams(), np.random.default_rng(0)).save(tmp_path / "t")  # granite's geometry
    base = dict(trace=str(tmp_path / "t"), policy="lru", cache_slots=16)
    small = _peak_bytes(SimConfig(tokens=800, **base))
    large = _peak_bytes(SimConfig(tokens=3200, **base))
    # tokens loaded up front took about 18 KiB each: 2,400 more would be +42 MiB
    assert large < small + 256 * 2**10, (small, large)


def test_load_tokens_is_re_iterable_and_holds_no_tokens():
    cfg = SimConfig(tokens=40)
    toks = load_tokens(cfg, load_model(cfg.model))
    assert isinstance(toks, TraceTokens) and len(toks) == 40
    first, again = list(toks), list(toks)
    assert [t.steps for t in first] == [t.steps for t in again]
    assert [t.steps for t in first] == [t.steps for t in traces.load().tokens("decode", limit=40)]
