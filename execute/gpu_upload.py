"""Start-up copies host -> GPU (planned by ``execute.load_plan``; ``MOELAB_FAST_LOAD``).

:class:`Staged`: host arrays of any size copied to device addresses through a ring of page-locked
staging buffers. Each piece (``load_plan.ChunkPacker``) is copied from its source (pageable: the
memory-mapped file) into its buffer by up to ``threads`` threads (numpy's copy releases the GIL),
then queued with ``cudaMemcpyAsync`` on the given stream; a buffer is refilled only after the event
recorded behind its copies, so the host fills one buffer while the copy engine drains the others.
``close`` waits for everything queued on the stream. The dense weights go up this way
(``gpu_dense.stack_matrices``): about the host's copy rate instead of the driver's pageable rate,
and no host-side concatenation or Q8_0 split (done on the device).

:class:`ExpertLoad`: a ``GpuExperts``' expert weights page-locked in place (``cudaHostRegister``,
as ``GpuExperts`` does when built), layer by layer, on one background thread from the backend's
construction on, and the placement given later (:meth:`ExpertLoad.place`) uploaded on a private
non-blocking stream, while the caller goes on (the engine's imports, the dense upload, the
warm-up). A layer's runs (``load_plan.slot_runs``) are one ``cudaMemcpy2DAsync`` per projection
from the registered expert stack into consecutive slots. Registration never waits for copies:
after each layer the thread queues the copies of the layers registered so far while fewer than two
layers' copies are in the stream (so that copies other threads queue meanwhile wait behind
little), and the rest once every layer is registered. ``finish`` joins the thread, raises what it
raised and waits for the copies; the experts of a layer it could not register are then copied
through the staging ring, as ``GpuExperts`` does without registration.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import cupy as cp
import numpy as np

from .experts import ExecutorError
from .gpu_host import PinnedRing
from .load_plan import ChunkPacker, Run, slot_runs, split_range

__all__ = ["ExpertLoad", "Staged", "register"]

_rt = cp.cuda.runtime
_H2D = _rt.memcpyHostToDevice
_THREAD_MIN = 4 << 20  # pieces from this size are copied by several threads


def register(gx, a: np.ndarray) -> bool:
    """Page-lock host array ``a`` in place for ``gx`` (a ``GpuExperts``: ``a`` is kept in
    ``gx._pinned`` and its address in ``gx.registered`` until unregistered); False when the driver
    refuses it (with and without ``cudaHostRegisterReadOnly``)."""
    for flags in (0, 8):  # default, then cudaHostRegisterReadOnly
        try:
            _rt.hostRegister(a.ctypes.data, a.nbytes, flags)
        except _rt.CUDARuntimeError:
            continue
        gx.registered.append(a.ctypes.data)
        gx._pinned.append(a)
        return True
    return False


class Staged:
    """Queue host -> device copies through ``buffers`` pinned buffers of ``chunk_bytes`` on the
    stream ``stream_ptr``: :meth:`put` returns once the source has been read (the caller may drop
    it); the copies are complete after :meth:`close`."""

    def __init__(self, stream_ptr: int, chunk_bytes: int = 32 << 20, buffers: int = 3, threads: int = 4):
        self.stream_ptr = int(stream_ptr)
        self._mem = [cp.cuda.alloc_pinned_memory(chunk_bytes) for _ in range(buffers)]
        self._bufs = [np.frombuffer(m, np.uint8, chunk_bytes) for m in self._mem]
        self._events = [cp.cuda.Event(disable_timing=True) for _ in range(buffers)]
        self._queued = [False] * buffers  # its event recorded behind copies not yet waited for
        self._packer = ChunkPacker(chunk_bytes)
        self._cur = -1
        self._threads = max(int(threads), 1)
        self._pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        self.nbytes = 0

    def put(self, dst: int, src: np.ndarray) -> None:
        """Queue ``src``'s bytes (C order) to device address ``dst``."""
        flat = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        for p in self._packer.add(flat.nbytes):
            if p.buffer != self._cur:
                self._switch(p.buffer)
            buf = self._bufs[p.buffer % len(self._bufs)]
            self._fill(buf[p.buffer_offset:p.buffer_offset + p.nbytes], flat[p.offset:p.offset + p.nbytes])
            _rt.memcpyAsync(dst + p.offset, buf.ctypes.data + p.buffer_offset, p.nbytes, _H2D, self.stream_ptr)
        self.nbytes += flat.nbytes

    def _switch(self, buffer: int) -> None:
        n = len(self._bufs)
        if self._cur >= 0:
            self._record(self._cur % n)
        i = buffer % n
        if self._queued[i]:
            self._events[i].synchronize()
            self._queued[i] = False
        self._cur = buffer

    def _record(self, i: int) -> None:
        _rt.eventRecord(self._events[i].ptr, self.stream_ptr)
        self._queued[i] = True

    def _fill(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self._pool is None or dst.nbytes < _THREAD_MIN:
            np.copyto(dst, src)
            return
        if dst.ndim == 2 and src.flags.c_contiguous:  # rows back to back on both sides: as bytes
            dst, src = dst.reshape(-1), src.reshape(-1)
        if dst.ndim == 2:  # strided rows: split by rows
            ranges = [(a, b) for a, b in split_range(dst.shape[0], self._threads, 1)]
        else:
            ranges = split_range(dst.nbytes, self._threads)
        list(self._pool.map(lambda r: np.copyto(dst[r[0]:r[1]], src[r[0]:r[1]]), ranges))

    def close(self) -> None:
        """Wait for every copy queued (and any work queued before it on the stream); release the
        threads. The buffers go back to CuPy's pinned memory pool."""
        if self._cur >= 0:
            self._record(self._cur % len(self._bufs))
            self._cur = -1
        for i, ev in enumerate(self._events):
            if self._queued[i]:
                ev.synchronize()
                self._queued[i] = False
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class ExpertLoad:
    """Register the host expert weights of ``gx`` (a ``GpuExperts``) on a background thread, started
    at once, and upload the placement :meth:`place` gives (copies start when it is given; none when
    :meth:`finish` comes first)."""

    def __init__(self, gx):
        self.gx = gx
        self.runs: list[Run] = []
        self.placed = False
        self._placed = threading.Event()
        self.left: list[Run] = []  # runs of layers whose weights could not all be registered
        self._by_layer: dict[int, list[Run]] | None = None
        self.nbytes = 0
        self.error: BaseException | None = None
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._stop = False
        self.stamps: dict[str, float] = {}  # perf_counter marks of the thread (start, registered, queued)
        self._device = _rt.getDevice()
        self._thread = threading.Thread(target=self._main, name="moelab-expert-load", daemon=True)
        self._thread.start()

    def place(self, slots: Mapping[tuple[int, int], int]) -> None:
        """Upload ``slots`` ``{(layer, expert): slot}`` (checked here) as their layers are registered."""
        if self.placed:
            raise ExecutorError("ExpertLoad.place: the placement was given already")
        gx, runs = self.gx, slot_runs(slots)
        for r in runs:
            lx = gx.layers[r.layer] if 0 <= r.layer < len(gx.layers) else None
            if lx is None or r.expert < 0 or r.expert + r.count > lx.num_experts:
                raise ExecutorError(f"pre-placed experts {r.expert}..{r.expert + r.count - 1} of layer {r.layer}: "
                                    "no such MoE layer or expert")
            gx._slot_ptr(r.layer, r.slot)  # range checks, before anything is copied
            gx._slot_ptr(r.layer, r.slot + r.count - 1)
        self.runs, self.placed = runs, True
        self._placed.set()

    def _main(self) -> None:
        try:
            _rt.setDevice(self._device)
            self.stamps["start"] = time.perf_counter()
            pending, queued = [], []
            for lx in self.gx.layers:
                if self._stop:
                    return
                if lx is not None:
                    pending.append((lx.layer, all([register(self.gx, a) for a in self.gx._host_parts(lx)])))
                    if self._placed.is_set():  # copies of the layers registered so far, as the queue has room
                        self._issue(pending, queued, block=False)
            self.stamps["registered"] = time.perf_counter()
            self._placed.wait()
            self._issue(pending, queued, block=True)
        except BaseException as exc:  # noqa: BLE001 - raised again by finish(), in the caller's thread
            self.error = exc
        finally:
            self.stamps["queued"] = time.perf_counter()

    def _issue(self, pending: list, queued: list, block: bool) -> None:
        """Queue the copies of ``pending`` (layer, registered) in order, at most two layers' copies in
        the stream at a time (``block``: wait for room, else return when there is none)."""
        gx = self.gx
        if self._by_layer is None:
            self._by_layer = {}
            for r in self.runs:
                self._by_layer.setdefault(r.layer, []).append(r)
        while pending:
            while queued and queued[0].done:
                queued.pop(0)
            if len(queued) >= 2:
                if not block:
                    return
                queued.pop(0).synchronize()
            layer, ok = pending.pop(0)
            runs = self._by_layer.get(layer, [])
            rows = gx._host_rows(layer) if ok and runs else None
            if rows is None:
                self.left += runs
                continue
            pitch = gx.slot_bytes[gx.pool_of[layer]]
            for r in runs:
                dst, off = gx._slot_ptr(layer, r.slot), 0
                for base, stride, n in rows:
                    src = base + r.expert * stride
                    if r.count == 1:
                        _rt.memcpyAsync(dst + off, src, n, _H2D, self.stream.ptr)
                    else:
                        _rt.memcpy2DAsync(dst + off, pitch, src, stride, n, r.count, _H2D, self.stream.ptr)
                    off += n
                self.nbytes += off * r.count
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(self.stream)
            queued.append(ev)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread (at most ``timeout_s``); True when it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def abandon(self) -> None:
        """Wait for the thread and its copies, its error left unraised (the GpuExperts closes)."""
        self._stop = True
        self._placed.set()  # without a placement: nothing more to copy
        self.join()
        self.stream.synchronize()

    def finish(self, moe) -> None:
        """Give an empty placement if none was given, join the thread and wait for its copies (each
        at most the GpuExperts' ``timeout_s``), raise its error, mark the slots it filled; where
        registration failed, copy that layer's experts through the staging ring (created as
        ``GpuExperts`` does) and wait for them."""
        gx = self.gx
        if not self.placed:
            self.place({})
        if not self.join(gx.timeout_s):
            raise ExecutorError(f"registering and uploading the expert weights did not finish within {gx.timeout_s} s")
        if self.error is not None:
            raise ExecutorError(f"registering and uploading the expert weights failed: "
                                f"{type(self.error).__name__}: {self.error}") from self.error
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(self.stream)
        gx.wait(ev, "upload of pre-placed residents")
        gx.bytes_uploaded += self.nbytes
        gx.filled.update(((r.layer, r.slot + i), r.expert + i) for r in self.runs if r not in self.left
                          for i in range(r.count))
        if len(gx.registered) < sum(len(gx._host_parts(l)) for l in moe):
            gx.staging = PinnedRing(4, max(l.expert_bytes for l in moe))
        for r in self.left:
            for i in range(r.count):
                gx._copy_expert(r.layer, r.expert + i, gx._slot_ptr(r.layer, r.slot + i), gx.copy)
        if self.left:
            gx.wait(gx.copies_event(), "upload of pre-placed residents")
