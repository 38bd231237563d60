"""The GPU side of the executor: a slot arena per cache pool, copy streams, and expert kernels.

Device memory: one arena per scheduler pool, ``slots x slot_bytes`` (``slot_bytes`` is the
scheduler's 256-byte padded expert size, so the arena is exactly the capacity's budget and an
H200 can stand in for a small card), plus ``scratch_slots`` scratch buffers for streamed experts.
An expert in a slot or scratch buffer is laid out as [biases] | gate | up | down, the projections
in their GGUF types; a layer with expert biases (gpt-oss) puts one expert's float32 gate, up and
down biases first (``LayerExperts.bias_bytes``, counted in its expert size).

Streams and ordering (all GPU-side, via events):
- ``copy``: on-demand uploads (a step's uploads and streams). Before a batch of copies the copy
  stream waits for ``last_read`` (the event after the most recent expert kernels), so a copy never
  overwrites a slot or scratch buffer a queued kernel still reads.
- ``background``: fills and swaps, one event per batch (when they wait: ``ExpertEngine``'s).
- ``compute``: expert kernels, promotions (device-to-device, scratch -> slot) and the combine;
  it waits only for the copy events of the experts it reads.
- the caller's current stream: a layer first makes ``compute`` wait for it (``after_caller``: its
  input may still be in the making there), then makes it wait for ``compute`` (``to_caller``, or
  ``end_step`` with ``last_read`` as the event: the output is read, and the input's memory reused,
  in the caller's order); the streams are non-blocking (nothing orders them after the legacy
  default stream). The parts of a layer (``gate_up1``, ...) leave both waits to their caller.

Host weights are page-locked in place (``cudaHostRegister``) when ``pinned``, else (refused) staged
through a pinned ring; ``defer_pin`` leaves both to :meth:`start_load` (a background thread).

Kernels (``gpu_kernels.cu``) read the quantized weights directly: ``moe_gate_up`` and
``moe_down`` cover all of a layer's GPU (expert, token) pairs in one launch each; ``moe_combine``
sums the router-weighted pair outputs per token in a fixed order.

Host cost per layer is kept to a few driver calls: kernels go through ``cuLaunchKernel`` with a
reusable argument block (:class:`Launch`; one token's per layer, ``gpu_step.FixedLaunch``), a
layer's kernel metadata in one pinned copy (:meth:`GpuExperts.layer_meta`), a step's uploads in
one batched copy (:meth:`GpuExperts.copy_in`); work buffers are allocated once and grown.

One token (decode) needs no metadata copy at all: its pair table (each routed expert's address
and router weight, at most ``MAX_TOP_K``) is a struct passed by value in the launch
(:meth:`GpuExperts.pack1`); ``moe1_gate_up`` (:meth:`gate_up1`, any subset of the pairs, so the
resident experts can start before the uploads land) and ``moe1_down_combine``
(:meth:`down_combine1`: down projection and the router-weighted sum in one launch, in the order of
``moe_combine``) write into an output reused once its holder has dropped it.

A layer with a type ``gpu_kernels.cu`` does not read (another layout of ``quant.LAYOUTS``, e.g.
Q5_K; ``generic_layers``) keeps it as stored too: its launches go to ``gpu_quant.cu``'s
``qmoe*`` kernels (the same arguments and layout; batches by ``gpu_quant.GENERIC_BATCH``); it
runs block by block (no token graph: :meth:`routed_layer` refuses it; no mapped-memory hand-off).
"""
from __future__ import annotations

import struct
import sys
import time
import weakref
from typing import NamedTuple, Sequence

import cupy as cp
import numpy as np

from scheduler.core import Capacity, pad_slot_bytes

from . import quant as Q
from .experts import ACTIVATIONS, ExecutorError, LayerExperts
from .gpu_host import Launch, cuda_module
from .gpu_host import PinnedRing as _PinnedRing
from .gpu_host import Staging as _Staging
from .gpu_host import unregister as _unregister
from .gpu_step import FREE_REFS as _FREE_REFS
from .gpu_step import CopyBatch, FixedLaunch, queue_copies
from .gpu_step import pack1 as _pack1
from .gpu_upload import ExpertLoad, register
from .kernel_variants import decode_kernels_env, kernel_name

__all__ = ["GpuExperts", "Launch", "LayerMeta", "MAX_TOP_K", "copy_to_device", "gpu_available", "scratch_source"]

_WARPS = 4
_RPW = 2  # output rows per warp in moe_gate_up / moe_down / moe1_gate_up
_RPB = 2  # output rows per block in moe1_down_combine (one warp per pair)
_RPB_V4 = 4  # the same for moe1r_down_combine_v4 (MOELAB_DECODE_KERNELS=v4: one wave of blocks)
_RPB_GQ = 4  # the same for gpu_quant.cu's qmoe1_down_combine (generic layers; as gpu_quant.ONE_DOWN_ROWS)
MAX_TOP_K = 32  # MAXK of gpu_kernels.cu: the most pairs a one-token launch carries by value
_EX_BYTES = 16 * MAX_TOP_K  # Experts1: base (u64), weight (f32), pick (i32), MAX_TOP_K each
_OUT_RING = 16  # one-token outputs kept for reuse, per shape
_NOT_READY = 600  # cudaErrorNotReady
_SPIN_S = 2e-3  # wait() polls without sleeping this long before it sleeps between polls
_FUNCS: dict[str, object] = {}
_rt = cp.cuda.runtime
_H2D, _D2H, _D2D = _rt.memcpyHostToDevice, _rt.memcpyDeviceToHost, _rt.memcpyDeviceToDevice


def gpu_available() -> bool:
    """True when CuPy sees at least one CUDA device."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False


def scratch_source(k: int) -> int:
    """The ``sources`` code of scratch buffer ``k`` (slots are codes >= 0)."""
    return -1 - k


def copy_to_device(dev: cp.ndarray, host: np.ndarray, stream_ptr: int) -> None:
    """Queue ``dev[...] = host`` (same size; ``host`` in pinned memory) on ``stream_ptr``."""
    _rt.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes, _H2D, stream_ptr)


def _kernel(name: str):
    """A kernel of gpu_kernels.cu or expert_kernels_v4.cu (one module, compiled once per process)."""
    f = _FUNCS.get(name)
    if f is None:
        f = _FUNCS[name] = cuda_module("gpu_kernels.cu", "expert_kernels_v4.cu").get_function(name)  # v4 uses the helpers
    return f


class LayerMeta(NamedTuple):
    """Device addresses of one layer's kernel metadata (see :meth:`GpuExperts.layer_meta`)."""

    base: int  # (G,) uint64 expert base addresses
    gstart: int  # (G + 1,) int32 first pair of each group (absolute pair ids)
    xrow: int  # (P_gpu,) int32 row of x per pair
    pair_of: int  # (T, k) int32 pair of each (token, rank); -1 skipped
    weights: int  # (T, k) float32 router weights
    groups: int
    tokens: int
    k: int


class GpuExperts:
    """Slot arenas, scratch buffers, copy streams and the expert kernels for a model's MoE layers."""

    def __init__(self, layers: Sequence[LayerExperts | None], capacity: Capacity, scratch_slots: int = 16,
                 pinned: bool = True, timeout_s: float = 30.0, defer_pin: bool = False):
        if scratch_slots < 1:
            raise ValueError(f"GpuExperts scratch_slots: {scratch_slots}, expected >= 1")
        self.layers = list(layers)
        self.timeout_s = float(timeout_s)
        moe = [l for l in self.layers if l is not None]
        if not moe:
            raise ValueError("GpuExperts: no MoE layer")
        for l in moe:
            for t in (l.gate, l.up, l.down):
                Q.row_bytes(t.qtype, t.cols, t.name or f"layer {l.layer}", Q.LAYOUTS)
        self.generic_layers = frozenset(l.layer for l in moe if {l.gate.qtype, l.up.qtype, l.down.qtype} - Q.QTYPES.keys())
        self._consts = {l.layer: self._layer_consts(l) for l in moe}
        self._load = None  # the background ExpertLoad, until settled
        self.filled: dict[tuple[int, int], int] = {}  # (layer, slot) -> expert, put there by the load
        self._defer = moe if pinned and defer_pin else None  # host weights still to register
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
        self._caller_ev, self._back_ev = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
        self.registered: list[int] = []
        # the registered arrays stay alive until unregistered: by close(), a failed __init__, or
        # when this object is dropped (a range freed while registered would keep its stale pages
        # and break later copies from new memory at those addresses)
        self._pinned: list[np.ndarray] = []
        self._unpin = weakref.finalize(self, _unregister, self.registered, self._pinned)
        self._unpin.atexit = False
        self.staging: _PinnedRing | None = None
        try:
            self._setup(moe, pinned)
        except BaseException:
            self._unpin()
            raise

    def _setup(self, moe: list[LayerExperts], pinned: bool) -> None:
        # per layer with biases: (experts, 2 * ffn + hidden) float32, one expert's biases per row
        self._bias = {l.layer: np.ascontiguousarray(np.concatenate([l.gate_bias, l.up_bias, l.down_bias], axis=1))
                      for l in moe if l.has_bias}
        if pinned and self._defer is None:
            self._pin(moe)
        self._meta = _PinnedRing(16, 1 << 20, device=True)
        self._meta_events = [cp.cuda.Event(disable_timing=True) for _ in range(16)]
        self._marks = [cp.cuda.Event(disable_timing=True) for _ in range(64)]  # consumed at once by a wait
        self._next_mark = 0
        self._k_gate_up = Launch(_kernel("moe_gate_up"), 18)
        self._k_down = Launch(_kernel("moe_down"), 12)
        self._k_combine = Launch(_kernel("moe_combine"), 6)
        self._ex = np.zeros(_EX_BYTES, np.uint8)  # the one-token pair table, passed by value
        self._k1_gate_up = Launch(_kernel("moe1_gate_up"), 13, self._ex)
        self._k1_down = Launch(_kernel("moe1_down_combine"), 10, self._ex)
        # per layer: its (gate_up, down, gate_up1, down_combine1) launches; generic layers: gpu_quant's (or Int8Batch, None, ..)
        self._kl = {l.layer: (self._k_gate_up, self._k_down, self._k1_gate_up, self._k1_down) for l in moe}
        if self.generic_layers:
            from .gpu_quant import GENERIC_BATCH, ONE_PROGRAMMATIC as pdl, Int8Batch, kernel as qk

            batch = (Int8Batch(GENERIC_BATCH), None) if GENERIC_BATCH else (Launch(qk("qmoe_gate_up"), 18), Launch(qk("qmoe_down"), 12))
            q = (*batch, Launch(qk("qmoe1_gate_up"), 13, self._ex, pdl), Launch(qk("qmoe1_down_combine"), 10, self._ex, pdl))
            self._kl.update((l, q) for l in self.generic_layers)
        self._k1r = None  # the token graph's launches (routed_layer), compiled on first use
        self._ones: dict[int, tuple[FixedLaunch, FixedLaunch]] = {}  # see _one
        wf = max(l.ffn for l in moe)
        with self.compute:  # one token's (k, ffn) gate/up outputs, k <= MAX_TOP_K (never regrown)
            self._h1 = cp.empty(MAX_TOP_K * wf, cp.float32)
        self.h1 = self._h1.data.ptr
        self._batch = CopyBatch()
        self._rows: dict[int, list | None] = {}
        self._outs: dict[tuple[int, int], list[cp.ndarray]] = {}
        self._structs: dict[tuple[int, int, int], struct.Struct] = {}
        self._h = self._y = self._iota = None  # device work buffers, grown on demand
        self._inputs = [None, None]  # as_input's last two inputs taken as they were
        self._x_host = _Staging()  # D2H of a layer's input for the CPU pool
        self._cpu_in = _Staging()
        self._cpu_out = [_Staging(), _Staging()]  # CPU results, H2D on compute (alternating)
        self._next_out = 0
        self.bytes_uploaded = 0

    @staticmethod
    def _layer_consts(l: LayerExperts) -> tuple[int, ...]:
        """(hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias) of a
        layer's kernels (offsets from an expert's base, see the module docstring)."""
        off_g, off_u, off_d = l.device_offsets()
        rb = [Q.row_bytes(t.qtype, t.cols, t.name or f"layer {l.layer}", Q.LAYOUTS) for t in (l.gate, l.up, l.down)]
        return (l.hidden, l.ffn, off_g, l.gate.qtype, rb[0], off_u, l.up.qtype, rb[1], off_d, l.down.qtype, rb[2],
                ACTIVATIONS.index(l.activation), int(l.has_bias))

    def set_capacity(self, capacity: Capacity) -> None:
        """(Re)allocate one arena per pool: slots x the pool's padded expert size. Contents are lost."""
        if self._load is not None and self._load.placed:  # its copies write the arenas
            self.settle()
        self.filled.clear()
        self._copy_plans: dict = {}  # gpu_step.queue_copies' per layer (host rows, slot table)
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
        self._slots = [a.size // max(sb, 1) for a, sb in zip(self.arenas, self.slot_bytes)]
        self._arena_ptr = [a.data.ptr for a in self.arenas]
        self.slot_tables = [None if p < 0 else (self._arena_ptr[p], self.slot_bytes[p], self._slots[p])
                            for p in self.pool_of]

    # host memory -----------------------------------------------------------------------------
    def _host_parts(self, l: LayerExperts) -> list[np.ndarray]:
        """The host arrays one expert of ``l`` is copied from, in device order (one row each)."""
        parts = [l.gate.data, l.up.data, l.down.data]
        return [self._bias[l.layer]] + parts if l.layer in self._bias else parts

    def _pin(self, moe: list[LayerExperts]) -> None:
        if not all([register(self, a) for l in moe for a in self._host_parts(l)]):
            self.staging = _PinnedRing(4, max(l.expert_bytes for l in moe))

    def start_load(self, slots=None) -> None:
        """With ``defer_pin``: register the host weights on a background thread (the first call starts
        it) and upload ``slots`` {(layer, expert): slot}, given once by this call or a later one, as
        their layers are registered; :meth:`settle` (or the first copy) finishes it. ``filled`` then
        holds the slots it filled: a first upload of the same expert into one is skipped."""
        if self._load is None:
            if self._defer is None:
                raise ExecutorError("start_load: the host weights are registered already")
            self._load = ExpertLoad(self)
        if slots is not None:
            self._load.place(slots)

    def settle(self) -> None:
        """Finish the background load (its errors raised here), or register deferred host weights
        now; a no-op otherwise. Every copy from the host weights settles first."""
        load, moe, self._load, self._defer = self._load, self._defer, None, None
        if load is not None:
            load.finish(moe)
        elif moe is not None:
            self._pin(moe)

    def close(self) -> None:
        """Unregister the host weights and drop the device buffers."""
        if self._load is not None:  # not settled: its errors go unraised
            self._load.abandon()
        for s in (self.copy, self.background, self.compute):
            s.synchronize()
        self._unpin()
        self.arenas, self.scratch = [], None
        self._h = self._y = self._iota = None

    # addresses -------------------------------------------------------------------------------
    def _slot_ptr(self, layer: int, slot: int) -> int:
        p = self.pool_of[layer]
        if p < 0:
            raise ExecutorError(f"layer {layer} has no cache pool; slot {slot} does not exist")
        if not 0 <= slot < self._slots[p]:
            raise ExecutorError(f"layer {layer}: slot {slot} out of range for pool {p}")
        return self._arena_ptr[p] + slot * self.slot_bytes[p]

    def source_ptr(self, layer: int, source: int) -> int:
        """Device address of an expert: ``source`` >= 0 is a slot, else ``scratch_source(k)``."""
        if source >= 0:
            return self._slot_ptr(layer, source)
        k = -1 - source
        if k >= self.scratch_slots:
            raise ExecutorError(f"scratch buffer {k} out of range ({self.scratch_slots})")
        return self.scratch.data.ptr + k * self.scratch_bytes

    # copies ----------------------------------------------------------------------------------
    def _host_rows(self, layer: int) -> list[tuple[int, int, int]] | None:
        """(address, row stride, row bytes) of each host part of the layer, when every row is
        contiguous (computed once; numpy's ``ctypes.data`` costs about a microsecond a call)."""
        rows = self._rows.get(layer, False)
        if rows is False:
            parts = self._host_parts(self.layers[layer])
            rows = None
            if all(a.ndim == 2 and a.strides[1] == a.itemsize for a in parts):
                rows = [(a.ctypes.data, a.strides[0], a.shape[1] * a.itemsize) for a in parts]
            self._rows[layer] = rows
        return rows

    def _copy_expert(self, layer: int, expert: int, dst: int, stream: cp.cuda.Stream) -> None:
        if self._load is not None or self._defer is not None:
            self.settle()
        rows = self._host_rows(layer) if self.staging is None else None
        if rows is not None:
            if not 0 <= expert < self.layers[layer].num_experts:
                raise ExecutorError(f"layer {layer}: expert {expert} out of range")
            off, s = 0, stream.ptr
            for base, stride, n in rows:
                _rt.memcpyAsync(dst + off, base + expert * stride, n, _H2D, s)
                off += n
            self.bytes_uploaded += off
            return
        off = 0
        for part in self._host_parts(self.layers[layer]):
            row = part[expert]
            n = row.nbytes
            if self.staging is None:
                src = row.ctypes.data
            else:
                buf, i = self.staging.take()
                buf[:n] = row.reshape(-1).view(np.uint8)  # a part's rows may be float (F32/F16/BF16)
                src = buf.ctypes.data
            _rt.memcpyAsync(dst + off, src, n, _H2D, stream.ptr)
            if self.staging is not None:
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(stream)
                self.staging.events[i] = ev
            off += n
        self.bytes_uploaded += off

    def begin_copies(self, stream: cp.cuda.Stream | None = None) -> None:
        """Order the next copies on ``stream`` (default: copy) after every queued expert kernel."""
        _rt.streamWaitEvent((stream or self.copy).ptr, self.last_read.ptr)

    def upload(self, layer: int, expert: int, slot: int, stream: cp.cuda.Stream | None = None) -> None:
        """Queue host -> slot ``slot`` of the layer's pool (call ``begin_copies`` first)."""
        if self.filled or self._load is not None:
            self.settle()
            if self.filled.pop((layer, slot), None) == expert:
                return  # put there by the background load, and nothing has written the slot since
        self._copy_expert(layer, expert, self._slot_ptr(layer, slot), stream or self.copy)

    def copy_in(self, layer: int, experts: Sequence[int], slots: Sequence[int], streamed: Sequence[int] = (),
                scratch: Sequence[int] = ()) -> None:
        """A step's copies, after every queued expert kernel: ``experts`` into ``slots``, ``streamed``
        into scratch buffers ``scratch``; the compute stream waits for them (``gpu_step.queue_copies``)."""
        queue_copies(self, layer, experts, slots, streamed, scratch)

    def reserve_scratch(self) -> int:
        """The next scratch buffer (round-robin), without copying anything into it."""
        k = self._next_scratch
        self._next_scratch = (k + 1) % self.scratch_slots
        return k

    def stream_to(self, layer: int, expert: int, k: int) -> None:
        """Queue host -> scratch buffer ``k`` on the copy stream (call ``begin_copies`` first)."""
        self._copy_expert(layer, expert, self.source_ptr(layer, scratch_source(k)), self.copy)

    def stream(self, layer: int, expert: int) -> int:
        """Queue host -> the next scratch buffer; returns its index (round-robin)."""
        k = self.reserve_scratch()
        self.stream_to(layer, expert, k)
        return k

    def copies_event(self, stream: cp.cuda.Stream | None = None) -> cp.cuda.Event:
        """An event after everything queued on ``stream`` (default: copy) so far."""
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream or self.copy)
        return ev

    def compute_after_copies(self) -> None:
        """Make the compute stream wait for everything queued on the copy stream so far."""
        ev = self._marks[self._next_mark]
        self._next_mark = (self._next_mark + 1) % len(self._marks)
        _rt.eventRecord(ev.ptr, self.copy.ptr)
        _rt.streamWaitEvent(self.compute.ptr, ev.ptr)

    def mark_read(self) -> None:
        """Record ``last_read`` after the work queued on the compute stream so far."""
        _rt.eventRecord(self.last_read.ptr, self.compute.ptr)

    def after_caller(self) -> None:
        """Make the compute stream (non-blocking: nothing else orders it after the caller's stream) wait
        for the caller's work so far: what wrote a layer's input, the reads of an output it dropped."""
        cur = cp.cuda.get_current_stream().ptr
        if cur != self.compute.ptr:
            _rt.eventRecord(self._caller_ev.ptr, cur)
            _rt.streamWaitEvent(self.compute.ptr, self._caller_ev.ptr)

    def to_caller(self) -> None:
        """Make the caller's current stream wait for the work queued so far on the compute stream:
        an output read there, an input whose memory the caller frees and reuses in its order."""
        cur = cp.cuda.get_current_stream().ptr
        if cur != self.compute.ptr:
            _rt.eventRecord(self._back_ev.ptr, self.compute.ptr)
            _rt.streamWaitEvent(cur, self._back_ev.ptr)

    def end_step(self) -> None:
        """``mark_read`` and ``to_caller`` by one event: ``last_read`` after the work queued on the
        compute stream so far, and the caller's current stream waits for it."""
        _rt.eventRecord(self.last_read.ptr, self.compute.ptr)
        cur = cp.cuda.get_current_stream().ptr
        if cur != self.compute.ptr:
            _rt.streamWaitEvent(cur, self.last_read.ptr)

    def all_done_event(self) -> cp.cuda.Event:
        """An event on the compute stream after everything queued on all three streams."""
        for s in (self.copy, self.background):
            self.compute.wait_event(self.copies_event(s))
        return self.copies_event(self.compute)

    def promote(self, layer: int, scratch_idx: int, slot: int) -> None:
        """Device-to-device copy of scratch buffer ``scratch_idx`` into ``slot`` (compute stream)."""
        n = self.layers[layer].expert_bytes
        self.filled.pop((layer, slot), None)
        _rt.memcpyAsync(self._slot_ptr(layer, slot), self.source_ptr(layer, scratch_source(scratch_idx)),
                        n, _D2D, self.compute.ptr)

    def wait(self, event: cp.cuda.Event, what: str = "copy") -> None:
        """Block the host until ``event`` (at most ``timeout_s``); ExecutorError on a stall or a
        CUDA error. Polls without sleeping for the first 2 ms (a short wait costs no sleep)."""
        status = _rt.eventQuery(event.ptr)
        if status == 0:
            return
        t0 = time.perf_counter()
        while status == _NOT_READY:
            now = time.perf_counter()
            if now - t0 > self.timeout_s:
                raise ExecutorError(f"GPU {what} did not finish within {self.timeout_s} s")
            if now - t0 > _SPIN_S:
                time.sleep(50e-6)
            status = _rt.eventQuery(event.ptr)
        if status != 0:
            raise ExecutorError(f"GPU {what} failed: CUDA error {status}")

    # buffers ---------------------------------------------------------------------------------
    def _work(self, pairs: int, ffn: int, hidden: int) -> tuple[int, int, int]:
        """Device (h, y, iota) addresses holding at least ``pairs`` rows (grown on the compute stream)."""
        if self._h is None or self._h.size < pairs * ffn or self._y.size < pairs * hidden or self._iota.size < pairs:
            n = max(pairs, 2 * (0 if self._iota is None else self._iota.size), 64)
            wf = max(l.ffn for l in self.layers if l is not None)
            wh = max(l.hidden for l in self.layers if l is not None)
            with self.compute:
                self._h = cp.empty(n * max(wf, ffn), cp.float32)
                self._y = cp.empty(n * max(wh, hidden), cp.float32)
                self._iota = cp.arange(n, dtype=cp.int32)
        return self._h.data.ptr, self._y.data.ptr, self._iota.data.ptr

    # one token, metadata by value ------------------------------------------------------------
    def _one(self, layer: int) -> tuple[FixedLaunch, FixedLaunch]:
        """The layer's ``moe1_gate_up`` and ``moe1_down_combine`` launches (built on first use;
        their constants set, the pair table ``_ex`` by value, ``h`` the one-token buffer ``h1``)."""
        one = self._ones.get(layer)
        if one is None:
            hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = self._consts[layer]
            kl = self._kl[layer]
            rpb = _RPB_GQ if layer in self.generic_layers else _RPB
            one = self._ones[layer] = (
                FixedLaunch(kl[2].func, (0, self.h1, ffn, hidden, _RPW, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias),
                            -(-ffn // (_WARPS * _RPW)), self._ex, programmatic=kl[2].programmatic),
                FixedLaunch(kl[3].func, (self.h1, 0, 0, ffn, hidden, rpb, off_d, qt_d, rb_d, bias), -(-hidden // rpb),
                            self._ex, programmatic=kl[3].programmatic))
        return one

    def pack1(self, bases: Sequence[int], weights: Sequence[float], pick: Sequence[int]) -> None:
        """Write the pair table the next ``gate_up1`` / ``down_combine1`` launches pass by value:
        ``bases[j]`` / ``weights[j]`` of the token's j-th routed expert (k <= MAX_TOP_K) and the
        pairs ``pick`` the next ``gate_up1`` covers (entries past each list zeroed; copied at each launch)."""
        _pack1(self._ex, bases, weights, pick)

    def gate_up1(self, layer: int, x: cp.ndarray, k: int, picks: int) -> None:
        """``h1[j] = act(gate_j x, up_j x)`` for the first ``picks`` pairs of ``pick`` (``x``: (1, hidden))."""
        gu = self._one(layer)[0]
        gu.vals[0] = x.data.ptr
        gu.launch(picks, 32 * _WARPS, self.compute.ptr)

    def down_combine1(self, layer: int, k: int) -> cp.ndarray:
        """A new (1, hidden) output: ``sum_j weights[j] * down_j h1[j]`` over the k pairs, summed in
        j order as ``moe_combine`` does (one launch; ``h1`` from ``gate_up1``)."""
        dc = self._one(layer)[1]
        out = self._output(1, self._consts[layer][0])
        v = dc.vals
        v[1] = out.data.ptr
        v[2] = k
        dc.launch(1, 32 * k, self.compute.ptr)
        return out

    def routed_layer(self, layer: int, route: int, table: int, halt: int, x: int, h: int, out: int, k: int) -> list:
        """One token's layer in a token's graph (``moe1r_gate_up``, ``moe1r_down_combine``: gpu_kernels.cu)
        as callables of a stream address: the pairs come from the router's output at ``route`` and the
        layer's slot table row at ``table``; ``halt`` is the token's first missing layer; ``x`` the normed
        input, ``h`` a (k, ffn) float32 work buffer the graph owns, ``out`` (hidden,) (device addresses)."""
        if layer in self.generic_layers:
            raise ExecutorError(f"layer {layer}: a type the token graph's kernels do not read; run it block by block")
        hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = self._consts[layer]
        if self._k1r is None:  # MOELAB_DECODE_KERNELS=v2..v4: the *_v2 / *_v4 twins (same arguments)
            v = decode_kernels_env()
            v4 = v == "v4"  # v4: programmatic launches (down stages its weights before its wait)
            self._k1r = (Launch(_kernel(kernel_name("moe1r_gate_up", v)), 18, programmatic=v4),
                         Launch(_kernel(kernel_name("moe1r_down_combine", v)), 14, programmatic=v4),
                         _RPB_V4 if v4 else _RPB)
        gate_up, down, rpb = self._k1r
        a1 = (route, table, halt, layer, k, x, h, ffn, hidden, _RPW, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias)
        a2 = (route, table, halt, layer, h, out, k, ffn, hidden, rpb, off_d, qt_d, rb_d, bias)
        g1, g2 = (-(-ffn // (_WARPS * _RPW)), k), (-(-hidden // rpb), 1)
        return [lambda s: gate_up(g1, 32 * _WARPS, s, *a1), lambda s: down(g2, 32 * k, s, *a2)]

    def _output(self, rows: int, cols: int) -> cp.ndarray:
        """A (rows, cols) float32 array for a layer's output: an earlier output nobody holds any more
        (as CuPy's pool would reuse it, in compute-stream order), else a new one (saves its host cost)."""
        ring = self._outs.setdefault((rows, cols), [])
        for a in ring:
            if sys.getrefcount(a) == _FREE_REFS:
                return a
        with self.compute:
            a = cp.empty((rows, cols), cp.float32)
        if len(ring) < _OUT_RING:
            ring.append(a)
        return a

    # metadata --------------------------------------------------------------------------------
    def _meta_slot(self, nbytes: int) -> tuple[int, int, int]:
        """(ring index, host address, device address) of a metadata buffer of ``nbytes``."""
        _, i = self._meta.take()
        if nbytes > self._meta.arrays[i].nbytes:
            raise ExecutorError(f"kernel metadata of {nbytes} bytes exceeds the {self._meta.arrays[i].nbytes}-byte buffer")
        return i, self._meta.ptrs[i], self._meta.device[i].data.ptr

    def _send_meta(self, i: int, host: int, dev: int, nbytes: int) -> None:
        _rt.memcpyAsync(dev, host, nbytes, _H2D, self.compute.ptr)
        ev = self._meta_events[i]
        _rt.eventRecord(ev.ptr, self.compute.ptr)
        self._meta.events[i] = ev

    def _upload_meta(self, *arrays: np.ndarray) -> list[int]:
        """Copy small arrays to the device in one pinned transfer on the compute stream; returns
        their device addresses (the ring's device buffer is reused in stream order)."""
        offs, o = [], 0
        for a in arrays:
            offs.append(o)
            o += -(-a.nbytes // 16) * 16
        i, host, dev = self._meta_slot(o)
        buf = self._meta.arrays[i]
        for a, off in zip(arrays, offs):
            buf[off:off + a.nbytes] = a.view(np.uint8).reshape(-1)
        self._send_meta(i, host, dev, o)
        return [dev + off for off in offs]

    def layer_meta(self, bases: Sequence[int], gstart: Sequence[int], xrow: Sequence[int],
                   pair_of: Sequence[int], weights: Sequence[float], k: int) -> LayerMeta:
        """Send one layer's kernel metadata in one copy on the compute stream: ``bases`` (G,) expert
        addresses, ``gstart`` (G + 1,) absolute first pair of each group (a group's pairs are
        contiguous; pair ids index ``h`` and ``y``), ``xrow`` the row of x of each GPU pair,
        ``pair_of`` / ``weights`` (T * k,) flat, for the combine."""
        g, p, tk = len(bases), len(xrow), len(pair_of)
        fmt = self._structs.get((g, p, tk))
        if fmt is None:
            fmt = self._structs[(g, p, tk)] = struct.Struct(f"<{g}Q{g + 1}i{p}i{tk}i{tk}f")
        i, host, dev = self._meta_slot(fmt.size)
        fmt.pack_into(self._meta.arrays[i], 0, *bases, *gstart, *xrow, *pair_of, *weights)
        self._send_meta(i, host, dev, fmt.size)
        o_g = dev + 8 * g
        o_x = o_g + 4 * (g + 1)
        o_p = o_x + 4 * p
        return LayerMeta(dev, o_g, o_x, o_p, o_p + 4 * tk, g, tk // k if k else 0, k)

    # kernels ---------------------------------------------------------------------------------
    def run(self, layer: int, sources: Sequence[int], x: cp.ndarray, xrow: Sequence[int],
            wait: Sequence[cp.cuda.Event] = (), out: cp.ndarray | None = None) -> cp.ndarray:
        """Pairs i: ``y[i] = expert(sources[i]) applied to x[xrow[i]]``, ``sources[i]`` a slot (>= 0)
        or ``scratch_source(k)`` (equal sources share a read of the weights), on the compute stream
        after ``wait`` (the copies these experts need): ``out`` (or new), (len(sources), hidden) float32."""
        lx = self.layers[layer]
        n = len(sources)
        if out is None:
            with self.compute:
                out = cp.empty((n, lx.hidden), cp.float32)
        if out.shape != (n, lx.hidden) or not out.flags.c_contiguous or out.dtype != cp.float32:
            raise ValueError(f"layer {layer}: out must be C-contiguous float32 ({n}, {lx.hidden}), got {out.shape}")
        if n == 0:
            return out
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(sources):
            groups.setdefault(int(s), []).append(i)
        order = np.fromiter((i for g in groups.values() for i in g), np.int32, n)
        gstart = np.cumsum([0] + [len(g) for g in groups.values()], dtype=np.int32)
        base = np.array([self.source_ptr(layer, s) for s in groups], np.uint64)
        rows = np.asarray(xrow, np.int32)
        self.after_caller()
        for ev in wait:
            _rt.streamWaitEvent(self.compute.ptr, ev.ptr)
        d_base, d_gstart, d_order, d_rows = self._upload_meta(base, gstart, order, rows)
        x = self.as_input(x)
        h, _, _ = self._work(n, lx.ffn, lx.hidden)
        self._launch(layer, len(groups), d_base, d_gstart, d_order, d_rows, x, h, out.data.ptr, n)
        self.mark_read()
        self.to_caller()
        return out

    def as_input(self, x: cp.ndarray) -> cp.ndarray:
        """``x`` as a C-contiguous float32 device array (no copy when it is one already; the last
        two such inputs are known by identity: a decode step's alternate between two buffers)."""
        ok = self._inputs
        if x is ok[0] or x is ok[1]:
            return x
        if isinstance(x, cp.ndarray) and x.dtype == cp.float32 and x.flags.c_contiguous:
            ok[0], ok[1] = x, ok[0]
            return x
        with self.compute:
            return cp.ascontiguousarray(cp.asarray(x), cp.float32)

    def _launch(self, layer: int, groups: int, d_base: int, d_gstart: int, d_order: int, d_rows: int,
                x: cp.ndarray, h: int, y: int, nh: int) -> None:
        """moe_gate_up then moe_down over ``groups`` groups (h of ``nh`` rows, y: device addresses)."""
        hidden, ffn, off_g, qt_g, rb_g, off_u, qt_u, rb_u, off_d, qt_d, rb_d, act, bias = self._consts[layer]
        s, kl = self.compute.ptr, self._kl[layer]
        if kl[1] is None:  # a generic layer: its Int8Batch
            return kl[0](s, groups, d_base, d_gstart, d_order, d_rows, x.data.ptr, x.shape[0], h, nh, y, self._consts[layer])
        kl[0]((-(-ffn // (_WARPS * _RPW)), groups), 32 * _WARPS, s,
              d_base, d_gstart, d_order, d_rows, x.data.ptr, x.shape[1], h, ffn, hidden, _RPW,
              off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias)
        kl[1]((-(-hidden // (_WARPS * _RPW)), groups), 32 * _WARPS, s,
              d_base, d_gstart, d_order, h, y, ffn, hidden, _RPW, off_d, qt_d, rb_d, bias)

    def run_groups(self, layer: int, meta: LayerMeta, g0: int, g1: int, x: cp.ndarray, pairs: int) -> None:
        """Expert kernels for groups ``g0 .. g1 - 1`` of ``meta`` into ``y`` (rows: pair ids; x from ``as_input``)."""
        if g1 <= g0:
            return
        lx = self.layers[layer]
        h, y, iota = self._work(pairs, lx.ffn, lx.hidden)
        self._launch(layer, g1 - g0, meta.base + 8 * g0, meta.gstart + 4 * g0, iota, meta.xrow, x, h, y, pairs)

    def pair_outputs(self, layer: int, pairs: int) -> cp.ndarray:
        """The work buffer ``y`` as (pairs, hidden) float32 (compute-stream order; before ``run_groups``)."""
        lx = self.layers[layer]
        self._work(pairs, lx.ffn, lx.hidden)
        return self._y[:pairs * lx.hidden].reshape(pairs, lx.hidden)

    def fetch_input(self, x: cp.ndarray) -> tuple[np.ndarray, cp.cuda.Event]:
        """Queue ``x`` (T, hidden) to pinned host memory on compute: (host array, valid until the next call; event)."""
        host = self._x_host.view(*x.shape)
        _rt.memcpyAsync(host.ctypes.data, x.data.ptr, x.nbytes, _D2H, self.compute.ptr)
        self._x_host.copied(self.compute.ptr)
        return host, self._x_host.event

    def cpu_buffers(self, rows: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
        """Pinned (rows, hidden) float32 input and output buffers for a CPU job (the output's last upload done)."""
        out = self._cpu_out[self._next_out]
        return self._cpu_in.view(rows, hidden), out.view(rows, hidden)

    def put_rows(self, y: cp.ndarray, row0: int, rows: np.ndarray) -> None:
        """Queue ``y[row0:row0 + len(rows)] = rows`` on compute (through the ``cpu_buffers`` output)."""
        out = self._cpu_out[self._next_out]
        self._next_out ^= 1
        buf = out.f32
        if rows.ctypes.data != buf.ctypes.data:
            buf = out.view(*rows.shape)
            np.copyto(buf, rows)
        dst = y.data.ptr + row0 * y.shape[1] * 4
        _rt.memcpyAsync(dst, buf.ctypes.data, rows.size * 4, _H2D, self.compute.ptr)
        out.copied(self.compute.ptr)

    def combine_meta(self, meta: LayerMeta, y: cp.ndarray) -> cp.ndarray:
        """out[t] = sum_j weights[t, j] * y[pair_of[t, j]] from ``meta`` (new (T, hidden) array)."""
        with self.compute:
            out = cp.empty((meta.tokens, y.shape[1]), cp.float32)
        self._k_combine((meta.tokens, 1), 256, self.compute.ptr, y.data.ptr, meta.pair_of, meta.weights,
                        out.data.ptr, meta.k, y.shape[1])
        return out

    def combine(self, y: cp.ndarray, pair_of: np.ndarray, weights: np.ndarray) -> cp.ndarray:
        """out[t] = sum_j weights[t, j] * y[pair_of[t, j]] (j in order; -1 skipped), on compute."""
        t, k = pair_of.shape
        self.after_caller()
        with self.compute:
            out = cp.empty((t, y.shape[1]), cp.float32)
            y = cp.ascontiguousarray(y, cp.float32)
        if t == 0:
            return out
        d_pair, d_w = self._upload_meta(np.ascontiguousarray(pair_of, np.int32), np.ascontiguousarray(weights, np.float32))
        self._k_combine((t, 1), 256, self.compute.ptr, y.data.ptr, d_pair, d_w, out.data.ptr, k, y.shape[1])
        self.to_caller()
        return out
