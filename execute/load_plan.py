"""Plans of the start-up copies host -> GPU, pure (``execute.gpu_upload`` carries them out), and the
``MOELAB_FAST_LOAD`` switch.

- :func:`slot_runs`: a placement ``{(layer, expert): slot}`` as runs of consecutive experts going
  to consecutive slots of one layer; a run is one strided copy per projection (source pitch: the
  host row stride of the expert stack; destination pitch: the slot size), instead of one copy per
  expert and projection.
- :class:`ChunkPacker`: copies of any size cut into pieces packed into fixed-size staging buffers
  used in turn (a copy larger than a buffer spans several; small ones share one), each piece at an
  aligned offset, so that a buffer is filled, sent and reused as a whole.
  :meth:`ChunkPacker.add_rows` packs whole rows (experts' parts going to slots of another pitch),
  so that each piece is one strided copy out of its buffer.
- :func:`split_range`: a piece's bytes split among copy threads at aligned boundaries.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

from .xp import env_switch

__all__ = ["ChunkPacker", "Piece", "RowPiece", "Run", "fast_load_env", "slot_runs", "split_range"]


def fast_load_env() -> bool:
    """``MOELAB_FAST_LOAD``: 1 (the default) registers the expert weights and uploads a run's
    pre-placed experts on a background thread while the dense weights go up through pinned staging
    buffers; 0 keeps the serial path (registration while the backend is built, one copy per expert
    and projection after the warm-up, dense weights copied from pageable memory)."""
    return env_switch("MOELAB_FAST_LOAD")


class Run(NamedTuple):
    """Experts ``expert .. expert + count - 1`` of ``layer`` into slots ``slot .. slot + count - 1``."""

    layer: int
    expert: int
    slot: int
    count: int


def slot_runs(slots: Mapping[tuple[int, int], int]) -> list[Run]:
    """The placement as maximal runs, ordered by layer then expert; together the runs hold every
    ``(layer, expert) -> slot`` of ``slots`` exactly once."""
    runs: list[Run] = []
    for (layer, expert), slot in sorted(slots.items()):
        if runs:
            r = runs[-1]
            if r.layer == layer and r.expert + r.count == expert and r.slot + r.count == slot:
                runs[-1] = r._replace(count=r.count + 1)
                continue
        runs.append(Run(int(layer), int(expert), int(slot), 1))
    return runs


class Piece(NamedTuple):
    """``nbytes`` of copy ``copy`` from its byte ``offset`` into staging buffer ``buffer`` (a count
    of buffers filled so far: buffer ``buffer % n`` of a ring of n) at ``buffer_offset``."""

    copy: int
    offset: int
    buffer: int
    buffer_offset: int
    nbytes: int


class RowPiece(NamedTuple):
    """Rows ``row .. row + rows - 1`` of a copy, placed back to back in staging buffer ``buffer``
    (as :class:`Piece`) from ``buffer_offset``."""

    row: int
    rows: int
    buffer: int
    buffer_offset: int


class ChunkPacker:
    """Packs copies into staging buffers of ``chunk_bytes``: :meth:`add` returns the pieces of the
    next copy. Pieces start at multiples of ``align`` within a buffer; a buffer is left for the
    next one when fewer than ``align`` bytes (or nothing) remain. Buffer numbers never decrease, so
    the buffers before a piece's are complete once it is placed."""

    def __init__(self, chunk_bytes: int, align: int = 256):
        if align < 1 or chunk_bytes < align or chunk_bytes % align:
            raise ValueError(f"ChunkPacker: chunk_bytes {chunk_bytes} must be a positive multiple of align {align}")
        self.chunk_bytes, self.align = int(chunk_bytes), int(align)
        self.buffer, self.fill, self.copies = 0, 0, 0

    def add(self, nbytes: int) -> list[Piece]:
        if nbytes < 0:
            raise ValueError(f"ChunkPacker.add: {nbytes} bytes, expected >= 0")
        c, out, off = self.copies, [], 0
        self.copies += 1
        while off < nbytes:
            if self.fill >= self.chunk_bytes:
                self.buffer, self.fill = self.buffer + 1, 0
            n = min(nbytes - off, self.chunk_bytes - self.fill)
            out.append(Piece(c, off, self.buffer, self.fill, n))
            off += n
            self.fill += -(-n // self.align) * self.align
        return out

    def add_rows(self, rows: int, row_bytes: int) -> list[RowPiece]:
        """Pieces of whole rows of the next copy (``rows`` rows of ``row_bytes``, at most a buffer
        each): as many rows as fit the current buffer's room, then the next buffers'."""
        if rows < 0 or not 0 < row_bytes <= self.chunk_bytes:
            raise ValueError(f"ChunkPacker.add_rows: {rows} rows of {row_bytes} bytes, expected rows >= 0 and "
                             f"0 < row_bytes <= {self.chunk_bytes}")
        out, r = [], 0
        self.copies += 1
        while r < rows:
            if self.chunk_bytes - self.fill < row_bytes:
                self.buffer, self.fill = self.buffer + 1, 0
            n = min(rows - r, (self.chunk_bytes - self.fill) // row_bytes)
            out.append(RowPiece(r, n, self.buffer, self.fill))
            r += n
            self.fill += -(-n * row_bytes // self.align) * self.align
        return out


def split_range(nbytes: int, parts: int, align: int = 4096) -> list[tuple[int, int]]:
    """``[0, nbytes)`` as at most ``parts`` consecutive ``(start, stop)`` ranges, every inner boundary
    a multiple of ``align``, none empty (one range when 0 < ``nbytes`` <= ``align``, none for 0)."""
    if parts < 1:
        raise ValueError(f"split_range: {parts} parts, expected >= 1")
    step = -(-max(nbytes, 1) // parts)
    step = -(-step // align) * align
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]
