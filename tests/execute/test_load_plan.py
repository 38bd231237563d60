"""The start-up copy plans (execute.load_plan): slot runs cover a placement exactly, the chunk
packer's pieces tile every copy and never overlap inside a staging buffer, thread ranges tile a
piece; and the MOELAB_FAST_LOAD switch."""
from __future__ import annotations

import numpy as np
import pytest

from execute.experts import ExecutorError
from execute.load_plan import ChunkPacker, Run, fast_load_env, slot_runs, split_range


def _expand(runs):
    return {(r.layer, r.expert + i): r.slot + i for r in runs for i in range(r.count)}


def test_slot_runs_merge_consecutive_experts_into_consecutive_slots():
    slots = {(0, e): e for e in range(8)}  # identity: one run
    slots.update({(1, 3): 0, (1, 4): 1, (1, 5): 7, (1, 6): 8, (1, 9): 9})  # breaks at a slot jump and an expert gap
    slots.update({(2, 1): 5, (2, 0): 4})  # given out of order
    runs = slot_runs(slots)
    assert runs == [Run(0, 0, 0, 8), Run(1, 3, 0, 2), Run(1, 5, 7, 2), Run(1, 9, 9, 1), Run(2, 0, 4, 2)]
    assert _expand(runs) == slots
    assert slot_runs({}) == []


def test_slot_runs_never_cross_layers_and_cover_random_placements():
    rng = np.random.default_rng(4)
    for _ in range(50):
        slots = {}
        for layer in range(3):
            experts = rng.permutation(16)[: rng.integers(0, 17)]
            free = rng.permutation(16)
            slots.update({(layer, int(e)): int(free[i]) for i, e in enumerate(experts)})
        slots.update({(1, e): e for e in range(4)})  # the first layer's last run must not absorb these
        runs = slot_runs(slots)
        assert _expand(runs) == slots
        assert sum(r.count for r in runs) == len(slots)
        assert [(r.layer, r.expert) for r in runs] == sorted((r.layer, r.expert) for r in runs)


def _check_pieces(sizes, chunk, align):
    packer = ChunkPacker(chunk, align)
    used: dict[int, list[tuple[int, int]]] = {}
    last_buffer = 0
    for c, n in enumerate(sizes):
        pieces = packer.add(n)
        assert all(p.copy == c for p in pieces)
        assert sum(p.nbytes for p in pieces) == n and all(p.nbytes > 0 for p in pieces)
        assert [p.offset for p in pieces] == list(np.cumsum([0] + [p.nbytes for p in pieces])[:-1])
        for p in pieces:
            assert p.buffer >= last_buffer  # buffers are filled in order
            last_buffer = p.buffer
            assert p.buffer_offset % align == 0 and p.buffer_offset + p.nbytes <= chunk
            used.setdefault(p.buffer, []).append((p.buffer_offset, p.buffer_offset + p.nbytes))
    for spans in used.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap in one buffer


def test_chunk_packer_tiles_every_copy_without_overlap():
    _check_pieces([0, 1, 255, 256, 257, 1000, 4096, 10_000, 3, 0, 8191], chunk=4096, align=256)
    rng = np.random.default_rng(7)
    for _ in range(20):
        _check_pieces(rng.integers(0, 20_000, 30).tolist(), chunk=int(rng.choice([512, 4096, 65536])), align=256)


def test_chunk_packer_splits_a_large_copy_and_packs_small_ones():
    p = ChunkPacker(1024, 256)
    assert p.add(3000) == [(0, 0, 0, 0, 1024), (0, 1024, 1, 0, 1024), (0, 2048, 2, 0, 952)]
    assert p.add(10) == [(1, 0, 3, 0, 10)]  # 952 rounds up to 1024: buffer 2 is full
    assert p.add(100) == [(2, 0, 3, 256, 100)]  # the next aligned offset of buffer 3
    assert p.add(0) == []
    with pytest.raises(ValueError, match="chunk_bytes 1000"):
        ChunkPacker(1000, 256)
    with pytest.raises(ValueError, match="-1 bytes"):
        p.add(-1)


@pytest.mark.parametrize("n, parts", [(0, 4), (1, 4), (4096, 4), (4097, 4), (10 << 20, 4), (10 << 20, 3), (12345, 1)])
def test_split_range_tiles_at_aligned_boundaries(n, parts):
    r = split_range(n, parts, 4096)
    assert len(r) <= parts and all(a < b for a, b in r)
    assert [a for a, _ in r] == ([0] + [b for _, b in r[:-1]] if n else [])
    assert (r[-1][1] if r else 0) == n
    assert all(a % 4096 == 0 for a, _ in r)
    with pytest.raises(ValueError, match="0 parts"):
        split_range(n, 0)


def test_fast_load_switch(monkeypatch):
    monkeypatch.delenv("MOELAB_FAST_LOAD", raising=False)
    assert fast_load_env()
    monkeypatch.setenv("MOELAB_FAST_LOAD", "0")
    assert not fast_load_env()
    monkeypatch.setenv("MOELAB_FAST_LOAD", "yes")
    with pytest.raises(ExecutorError, match="MOELAB_FAST_LOAD"):
        fast_load_env()


def test_chunk_packer_rows_fit_whole_in_one_buffer_and_tile_the_copy():
    p = ChunkPacker(1024, align=64)
    p.add(100)  # a byte copy first: rows start at the next aligned offset
    placed = []
    for rows, rb in [(7, 300), (1, 1024), (0, 8), (11, 64), (3, 1000)]:
        pieces = p.add_rows(rows, rb)
        assert sum(q.rows for q in pieces) == rows and [q.row for q in pieces] == [
            sum(q.rows for q in pieces[:i]) for i in range(len(pieces))]
        for q in pieces:
            assert q.rows >= 1 and q.buffer_offset % 64 == 0 and q.buffer_offset + q.rows * rb <= 1024
            placed.append((q.buffer, q.buffer_offset, q.buffer_offset + q.rows * rb))
    assert placed[0] == (0, 128, 728)  # two rows of 300 after the 100-byte copy's 128
    for (b1, s1, e1), (b2, s2, e2) in zip(placed, placed[1:]):  # in order, never overlapping
        assert b2 > b1 or (b2 == b1 and s2 >= e1)
    with pytest.raises(ValueError, match="row_bytes"):
        p.add_rows(2, 1025)
