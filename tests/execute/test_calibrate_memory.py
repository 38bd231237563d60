"""execute.calibrate_memory: the same experts through a file's read-only memory map, and the pool
timed on both kinds of memory."""
from __future__ import annotations

import numpy as np
import pytest

from execute import calibrate_memory as CM
from execute.calibrate_measure import build_layers


def test_mapped_layers_are_read_only_views_of_the_same_bytes(tmp_path):
    layers = build_layers(np.random.default_rng(0), 2, 4, 64, 64, distinct=2)
    mapped, mm = CM.mapped_layers(layers, tmp_path / "e.bin")
    for a, b in zip(layers, mapped):
        for ta, tb in ((a.gate, b.gate), (a.up, b.up), (a.down, b.down)):
            assert np.array_equal(ta.data, tb.data) and tb.data.shape == ta.data.shape
            assert not tb.data.flags.writeable and tb.data.ctypes.data % 64 == 0
            assert (tb.qtype, tb.rows, tb.cols) == (ta.qtype, ta.rows, ta.cols)
    pages = CM.huge_page_kib([t.data for lx in mapped for t in (lx.gate, lx.up, lx.down)])
    assert pages == {} or pages["Rss"] >= 0
    assert len(mm) >= sum(lx.gate.data.nbytes * 3 for lx in layers)  # the map stays open while views live


def test_the_pool_is_timed_on_three_kinds_and_the_file_removed(tmp_path):
    layers = build_layers(np.random.default_rng(1), 2, 8, 64, 64, distinct=2)
    path = tmp_path / "e.bin"
    res = CM.measure_pool_memory(layers, 1, path, n=2, rounds=2, reps=1)
    assert res["anon"]["n"] == res["mapped"]["n"] == res["cold"]["n"] == 2 and res["anon"]["median"] > 0
    assert res["ratio"] == pytest.approx(res["mapped"]["median"] / res["anon"]["median"])
    assert res["touch_s_per_expert"] == pytest.approx((res["cold"]["median"] - res["mapped"]["median"]) / 2)
    assert set(res["pages"]) == {"anon", "mapped", "cold"} and not path.exists()
    with pytest.raises(ValueError, match="2 layers of >= 16 experts"):  # more calls than experts to keep cold
        CM.measure_pool_memory(layers, 1, tmp_path / "f.bin", n=2, rounds=4, reps=2)


def test_the_factor_is_the_warm_maps_and_an_old_cold_only_table_on_huge_pages_reads_as_the_buffers():
    huge = {"anon": {"Rss": 100, "AnonHugePages": 98}, "mapped": {"Rss": 0, "Rss_after": 50, "FilePmdMapped_after": 50}}
    assert CM.mapped_factor({"ratio": 1.2, "cold": {"median": 1.0}, "pages": huge}) == pytest.approx(1.2)
    assert CM.mapped_factor({"ratio": 1.57, "pages": huge}) == 1.0  # every call faulted: not the warm factor
    small = {**huge, "mapped": {"Rss_after": 50, "FilePmdMapped_after": 0}}  # 4 KiB pages: the old ratio stands
    assert CM.mapped_factor({"ratio": 1.57, "pages": small}) == pytest.approx(1.57)
    assert CM.mapped_factor({"error": "no room"}) is None and CM.mapped_factor(None) is None
