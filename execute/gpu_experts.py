"""The GPU side of the executor: a slot arena per cache pool, copy streams, and expert kernels.

Device memory: one arena per scheduler pool, ``slots x slot_bytes`` (``slot_bytes`` is the
scheduler's 256-byte padded expert size, so the arena is exactly the capacity's budget and an
H200 can stand in for a small card), plus ``scratch_slots`` scratch buffers for streamed experts.
An expert in a slot or scratch buffer is laid out as gate | up | down, each in its GGUF type.

Streams and ordering (all GPU-side, via events):
- ``copy``: on-demand uploads (a step's uploads and streams). Before a batch of copies the copy
  stream waits for ``last_read`` (the event after the most recent expert kernels), so a copy never
  overwrites a slot or scratch buffer a queued kernel still reads.
- ``background``: fills and swaps (same rule), one completion event per batch.
- ``compute``: expert kernels, promotions (device-to-device, scratch -> slot) and the combine;
  it waits only for the copy events of the experts it reads.

Host weights are page-locked in place (``cudaHostRegister``) when ``pinned``; where that fails
(e.g. a read-only mapping the driver refuses) uploads go through a small pinned staging ring.

Kernels (``gpu_kernels.cu``) read the quantized weights directly: ``moe_gate_up`` and
``moe_down`` cover all of a layer's GPU (expert, token) pairs in one launch each; ``moe_combine``
sums the router-weighted pair outputs per token in a fixed order.
"""
from __future__ import annotations

import time
from importlib import resources
from typing import Sequence

import cupy as cp
import numpy as np

from scheduler.core import Capacity, pad_slot_bytes

from . import quant as Q
from .experts import ExecutorError, LayerExperts

__all__ = ["GpuExperts", "gpu_available", "scratch_source"]

_WARPS = 4
_MODULE: cp.RawModule | None = None


def gpu_available() -> bool:
    """True when CuPy sees at least one CUDA device."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False


def scratch_source(k: int) -> int:
    """The ``sources`` code of scratch buffer ``k`` (slots are codes >= 0)."""
    return -1 - k


_FUNCS: dict[str, object] = {}


def _kernel(name: str):
    """A kernel of gpu_kernels.cu (compiled once per process)."""
    global _MODULE
    f = _FUNCS.get(name)
    if f is None:
        if _MODULE is None:
            src = resources.files(__package__).joinpath("gpu_kernels.cu").read_text()
            _MODULE = cp.RawModule(code=src, options=("-std=c++14",))
        f = _FUNCS[name] = _MODULE.get_function(name)
    return f


class _PinnedRing:
    """Reusable page-locked host buffers; a buffer is reused only after its copy's event."""

    def __init__(self, n: int, nbytes: int, device: bool = False):
        self.bufs = [cp.cuda.alloc_pinned_memory(nbytes) for _ in range(n)]
        self.arrays = [np.frombuffer(b, np.uint8, nbytes) for b in self.bufs]
        self.events: list[cp.cuda.Event | None] = [None] * n
        self.device = [cp.empty(nbytes, cp.uint8) for _ in range(n)] if device else []
        self.next = 0

    def take(self) -> tuple[np.ndarray, int]:
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.arrays[i], i


class GpuExperts:
    """Slot arenas, scratch buffers, copy streams and the expert kernels for a model's MoE layers."""

    def __init__(self, layers: Sequence[LayerExperts | None], capacity: Capacity, scratch_slots: int = 16,
                 pinned: bool = True, timeout_s: float = 30.0):
        if scratch_slots < 1:
            raise ValueError(f"GpuExperts scratch_slots: {scratch_slots}, expected >= 1")
        self.layers = list(layers)
        self.timeout_s = float(timeout_s)
        moe = [l for l in self.layers if l is not None]
        if not moe:
            raise ValueError("GpuExperts: no MoE layer")
        for l in moe:
            for t in (l.gate, l.up, l.down):
                Q.row_bytes(t.qtype, t.cols, t.name or f"layer {l.layer}")
        self.set_capacity(capacity)
        self.scratch_bytes = max(pad_slot_bytes(l.expert_bytes) for l in moe)
        self.scratch = cp.empty(scratch_slots * self.scratch_bytes, cp.uint8)
        self.scratch_slots = scratch_slots
        self._next_scratch = 0
        self.copy = cp.cuda.Stream(non_blocking=True)
        self.background = cp.cuda.Stream(non_blocking=True)
        self.compute = cp.cuda.Stream(non_blocking=True)
        self.last_read = cp.cuda.Event(disable_timing=True)
        self.last_read.record(self.compute)
        self.registered: list[int] = []
        self.staging: _PinnedRing | None = None
        if pinned:
            self._pin(moe)
        self._meta = _PinnedRing(16, 1 << 20, device=True)
        self._meta_events = [cp.cuda.Event(disable_timing=True) for _ in range(16)]
        self.bytes_uploaded = 0

    def set_capacity(self, capacity: Capacity) -> None:
        """(Re)allocate one arena per pool: slots x the pool's padded expert size. Contents are lost."""
        self.pool_of = capacity.pool_of_layer(len(self.layers))
        self.slot_bytes: list[int] = []
        self.arenas: list[cp.ndarray] = []
        for i, (pool_layers, n) in enumerate(capacity.pools):
            sizes = {self.layers[l].expert_bytes for l in pool_layers if self.layers[l] is not None}
            if len(sizes) > 1:
                raise ValueError(f"Capacity.pools[{i}]: layers {list(pool_layers)} have different expert sizes")
            sb = pad_slot_bytes(sizes.pop()) if sizes else 0
            self.slot_bytes.append(sb)
            self.arenas.append(cp.empty(n * sb, cp.uint8))

    # host memory -----------------------------------------------------------------------------
    def _pin(self, moe: list[LayerExperts]) -> None:
        for l in moe:
            for t in (l.gate, l.up, l.down):
                ptr, size = t.data.ctypes.data, t.data.nbytes
                for flags in (0, 8):  # default, then cudaHostRegisterReadOnly
                    try:
                        cp.cuda.runtime.hostRegister(ptr, size, flags)
                    except cp.cuda.runtime.CUDARuntimeError:
                        continue
                    self.registered.append(ptr)
                    break
        if len(self.registered) < 3 * len(moe):
            self.staging = _PinnedRing(4, max(l.expert_bytes for l in moe))

    def close(self) -> None:
        """Unregister the host weights and drop the device buffers."""
        for s in (self.copy, self.background, self.compute):
            s.synchronize()
        for ptr in self.registered:
            cp.cuda.runtime.hostUnregister(ptr)
        self.registered = []
        self.arenas, self.scratch = [], None

    # addresses -------------------------------------------------------------------------------
    def _slot_ptr(self, layer: int, slot: int) -> int:
        p = self.pool_of[layer]
        if p < 0:
            raise ExecutorError(f"layer {layer} has no cache pool; slot {slot} does not exist")
        if not 0 <= slot < self.arenas[p].size // max(self.slot_bytes[p], 1):
            raise ExecutorError(f"layer {layer}: slot {slot} out of range for pool {p}")
        return self.arenas[p].data.ptr + slot * self.slot_bytes[p]

    def source_ptr(self, layer: int, source: int) -> int:
        """Device address of an expert: ``source`` >= 0 is a slot, else ``scratch_source(k)``."""
        if source >= 0:
            return self._slot_ptr(layer, source)
        k = -1 - source
        if k >= self.scratch_slots:
            raise ExecutorError(f"scratch buffer {k} out of range ({self.scratch_slots})")
        return self.scratch.data.ptr + k * self.scratch_bytes

    # copies ----------------------------------------------------------------------------------
    def _copy_expert(self, layer: int, expert: int, dst: int, stream: cp.cuda.Stream) -> None:
        lx = self.layers[layer]
        off = 0
        for t in (lx.gate, lx.up, lx.down):
            row = t.data[expert]
            n = row.nbytes
            if self.staging is None:
                src = row.ctypes.data
            else:
                buf, i = self.staging.take()
                buf[:n] = row
                src = buf.ctypes.data
            cp.cuda.runtime.memcpyAsync(dst + off, src, n, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            if self.staging is not None:
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(stream)
                self.staging.events[i] = ev
            off += n
        self.bytes_uploaded += off

    def begin_copies(self, stream: cp.cuda.Stream | None = None) -> None:
        """Order the next copies on ``stream`` (default: copy) after every queued expert kernel."""
        (stream or self.copy).wait_event(self.last_read)

    def upload(self, layer: int, expert: int, slot: int, stream: cp.cuda.Stream | None = None) -> None:
        """Queue host -> slot ``slot`` of the layer's pool (call ``begin_copies`` first)."""
        self._copy_expert(layer, expert, self._slot_ptr(layer, slot), stream or self.copy)

    def stream(self, layer: int, expert: int) -> int:
        """Queue host -> the next scratch buffer; returns its index (round-robin)."""
        k = self._next_scratch
        self._next_scratch = (k + 1) % self.scratch_slots
        self._copy_expert(layer, expert, self.source_ptr(layer, scratch_source(k)), self.copy)
        return k

    def copies_event(self, stream: cp.cuda.Stream | None = None) -> cp.cuda.Event:
        """An event after everything queued on ``stream`` (default: copy) so far."""
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream or self.copy)
        return ev

    def all_done_event(self) -> cp.cuda.Event:
        """An event on the compute stream after everything queued on all three streams."""
        for s in (self.copy, self.background):
            self.compute.wait_event(self.copies_event(s))
        return self.copies_event(self.compute)

    def promote(self, layer: int, scratch_idx: int, slot: int) -> None:
        """Device-to-device copy of scratch buffer ``scratch_idx`` into ``slot`` (compute stream)."""
        n = self.layers[layer].expert_bytes
        cp.cuda.runtime.memcpyAsync(self._slot_ptr(layer, slot), self.source_ptr(layer, scratch_source(scratch_idx)),
                                    n, cp.cuda.runtime.memcpyDeviceToDevice, self.compute.ptr)

    def wait(self, event: cp.cuda.Event, what: str = "copy") -> None:
        """Block the host until ``event`` (at most ``timeout_s``); ExecutorError on a stall."""
        deadline = time.perf_counter() + self.timeout_s
        while not event.done:
            if time.perf_counter() > deadline:
                raise ExecutorError(f"GPU {what} did not finish within {self.timeout_s} s")
            time.sleep(20e-6)

    # kernels ---------------------------------------------------------------------------------
    def _upload_meta(self, *arrays: np.ndarray) -> list[np.uint64]:
        """Copy small arrays to the device in one pinned transfer on the compute stream; returns
        their device addresses (the ring's device buffer is reused in stream order)."""
        buf, i = self._meta.take()
        offs, o = [], 0
        for a in arrays:
            offs.append(o)
            o += -(-a.nbytes // 16) * 16
        if o > buf.nbytes:
            raise ExecutorError(f"kernel metadata of {o} bytes exceeds the {buf.nbytes}-byte buffer")
        for a, off in zip(arrays, offs):
            buf[off:off + a.nbytes] = a.view(np.uint8).reshape(-1)
        dev = self._meta.device[i].data.ptr
        cp.cuda.runtime.memcpyAsync(dev, buf.ctypes.data, o, cp.cuda.runtime.memcpyHostToDevice, self.compute.ptr)
        ev = self._meta_events[i]
        ev.record(self.compute)
        self._meta.events[i] = ev
        return [np.uint64(dev + off) for off in offs]

    def run(self, layer: int, sources: Sequence[int], x: cp.ndarray, xrow: Sequence[int],
            wait: Sequence[cp.cuda.Event] = (), out: cp.ndarray | None = None) -> cp.ndarray:
        """Expert outputs for pairs i: ``y[i] = expert(sources[i]) applied to x[xrow[i]]``.

        ``sources[i]`` is a slot (>= 0) or ``scratch_source(k)``; pairs with equal sources share
        one read of the weights. The compute stream first waits for ``wait`` (the copies these
        experts need). Returns ``out`` (or a new array): (len(sources), hidden) float32, written
        on the compute stream.
        """
        lx = self.layers[layer]
        n = len(sources)
        if out is None:
            with self.compute:
                out = cp.empty((n, lx.hidden), cp.float32)
        if out.shape != (n, lx.hidden) or not out.flags.c_contiguous:
            raise ValueError(f"layer {layer}: out must be C-contiguous ({n}, {lx.hidden}), got {out.shape}")
        if n == 0:
            return out
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(sources):
            groups.setdefault(int(s), []).append(i)
        order = np.fromiter((i for g in groups.values() for i in g), np.int32, n)
        gstart = np.cumsum([0] + [len(g) for g in groups.values()], dtype=np.int32)
        base = np.array([self.source_ptr(layer, s) for s in groups], np.uint64)
        rows = np.asarray(xrow, np.int32)
        ids = groups
        with self.compute:
            for ev in wait:
                self.compute.wait_event(ev)
            d_base, d_gstart, d_order, d_rows = self._upload_meta(base, gstart, order, rows)
            x = cp.ascontiguousarray(x, cp.float32)
            h = cp.empty((n, lx.ffn), cp.float32)
            self._launch_gate_up(lx, len(ids), d_base, d_gstart, d_order, d_rows, x, h)
            self._launch_down(lx, len(ids), d_base, d_gstart, d_order, h, out)
            self.last_read.record(self.compute)
        return out

    def _launch_gate_up(self, lx, groups, d_base, d_gstart, d_order, d_rows, x, h) -> None:
        rpw = 2
        grid = (-(-lx.ffn // (_WARPS * rpw)), groups)
        rb_g = Q.row_bytes(lx.gate.qtype, lx.hidden)
        rb_u = Q.row_bytes(lx.up.qtype, lx.hidden)
        _kernel("moe_gate_up")(
            grid, (32 * _WARPS,),
            (d_base, d_gstart, d_order, d_rows, x, np.int64(x.shape[1]), h, np.int32(lx.ffn), np.int32(lx.hidden),
             np.int32(rpw), np.int32(lx.gate.qtype), np.int64(rb_g), np.int64(lx.gate.expert_bytes),
             np.int32(lx.up.qtype), np.int64(rb_u)))

    def _launch_down(self, lx, groups, d_base, d_gstart, d_order, h, y) -> None:
        rpw = 2
        grid = (-(-lx.hidden // (_WARPS * rpw)), groups)
        _kernel("moe_down")(
            grid, (32 * _WARPS,),
            (d_base, d_gstart, d_order, h, y, np.int32(lx.ffn), np.int32(lx.hidden), np.int32(rpw),
             np.int64(lx.gate.expert_bytes + lx.up.expert_bytes), np.int32(lx.down.qtype),
             np.int64(Q.row_bytes(lx.down.qtype, lx.ffn))))

    def combine(self, y: cp.ndarray, pair_of: np.ndarray, weights: np.ndarray) -> cp.ndarray:
        """out[t] = sum_j weights[t, j] * y[pair_of[t, j]] (j in order; -1 skipped), on compute."""
        t, k = pair_of.shape
        with self.compute:
            out = cp.empty((t, y.shape[1]), cp.float32)
            d_pair, d_w = self._upload_meta(np.ascontiguousarray(pair_of, np.int32),
                                            np.ascontiguousarray(weights, np.float32))
            _kernel("moe_combine")(
                (t,), (256,), (cp.ascontiguousarray(y, cp.float32), d_pair, d_w, out, np.int32(k), np.int32(y.shape[1])))
        return out
