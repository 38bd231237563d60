"""The host side of one token's expert step, kept to few Python operations and driver calls.

:class:`FixedLaunch`: a kernel launch whose argument block is built once (per layer and kernel)
and of which a call rewrites only the slots that change (the input, the output, the pair count):
no argument tuple is converted per launch.

:class:`CopyBatch`: a step's host -> device copies (an expert is one copy per part: gate, up,
down, and its biases where it has them) queued by one driver call, ``cuMemcpyBatchAsync`` (CUDA
12.8 drivers and later; its 13.0 form ``cuMemcpyBatchAsync_v2`` where exported), looked up in the
driver library at run time. Without it (an older driver, no driver library, ``MOELAB_BATCH_COPY=0``,
or a first batch the driver refuses: ``refused`` keeps its error), the same copies go one
``cudaMemcpyAsync`` each, in the same order. Every copy of a batch is stream-ordered (the copies
of a batch may run in any order among themselves: they write distinct slots).

:func:`pack1` (``engine_one``'s, needing no cupy): the one-token pair table (``Experts1`` of
gpu_kernels.cu: bases, weights, picks) written by one ``struct.pack_into`` per layout.

:class:`LateStart`: a one-token step begun before its decision covers its uploads too. The early
``moe1_gate_up_late`` runs every routed pair: the resident ones at once, each of the others once
its word of a device table ``late`` (8 bytes per pair: the slot address, 256-byte aligned, with
the step's tag ``seq % 255 + 1`` in its low byte, so the kernel sees tag and address together)
carries the step's tag, which one host -> device copy on the copy stream writes after the step's
uploads (the compute stream no longer waits for the copy stream: the kernel's blocks do, and the
down/combine launch comes after them), or a release writes with address 0 (the decision hands the
pairs to the CPU or does not keep the early start: those blocks write nothing and the step runs
them as before). Each step's copy into ``late`` follows the previous step's (steps are resolved
in order) and waits for ``last_read``, which a release moves past the released kernel, so a
waiting block never misses its tag (it sees the previous step's or its own). The copies' sources
are a ring of pinned entries; before a block of 32 entries is rewritten, the host waits for the
event recorded after the copies of the block before last (in practice long done).

The kernel waits on another stream's copy, a progress CUDA does not promise (streams may run
concurrently; a profiler, ``CUDA_LAUNCH_BLOCKING`` or an implicit synchronization serializes
them), so the wait is bounded: past ``timeout_s`` (at most :data:`LATE_TIMEOUT_S`) the pairs are
left unwritten and the step's number, the word last seen and the pair go to ``err`` (mapped);
the next ``begin`` and :meth:`LateStart.check` raise it, naming the step's layer and when its
entries were queued. Off by default (``MOELAB_LATE_START=1``).
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys
import time
import types

import cupy as cp
import numpy as np

from .engine_one import pack1
from .experts import ExecutorError
from .gpu_host import cuda_module

__all__ = ["CopyBatch", "FREE_REFS", "FixedLaunch", "LATE_TIMEOUT_S", "LateStart", "pack1", "queue_copies"]

_rt = cp.cuda.runtime
_H2D = _rt.memcpyHostToDevice
_launch_kernel = cp.cuda.driver.launchKernel
_ACCESS_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_MAX_K = 32  # MAXK of gpu_kernels.cu
LATE_TIMEOUT_S = 1.0  # the longest a late pair waits for its slot address (a step's uploads take ms)


class FixedLaunch:
    """``func`` (a CUfunction address) with argument values ``args`` (64-bit slots, as
    ``gpu_host.Launch``'s) and, with ``blob``, a by-value struct as the first parameter (its bytes
    at each launch). ``vals`` is the argument block: a caller writes the slots that change
    (``vals[i] = v``) and calls ``launch(grid_y, block, stream_ptr)``; ``grid_x`` is fixed.
    ``programmatic``: by programmatic dependent launch (the kernel waits for its inputs itself)."""

    __slots__ = ("func", "vals", "grid_x", "_params", "ptr", "programmatic")

    def __init__(self, func: int, args, grid_x: int, blob: np.ndarray | None = None, programmatic: bool = False):
        self.programmatic = programmatic
        self.func = int(func)
        self.vals = np.array(args, np.uint64)
        self.grid_x = int(grid_x)
        ptrs = [self.vals.ctypes.data + 8 * i for i in range(len(args))]
        if blob is not None:
            ptrs.insert(0, blob.ctypes.data)
        self._params = np.array(ptrs, np.uint64)
        self.ptr = int(self._params.ctypes.data)

    def launch(self, grid_y: int, block: int, stream_ptr: int) -> None:
        if self.programmatic:
            from .pdl_launch import launch_programmatic

            return launch_programmatic(self.func, (self.grid_x, grid_y), block, 0, stream_ptr, self.ptr)
        _launch_kernel(self.func, self.grid_x, grid_y, 1, block, 1, 1, 0, stream_ptr, self.ptr, 0)


def _driver_batch():
    """(function, takes failIdx) of the driver's cuMemcpyBatchAsync, or (None, False)."""
    if os.environ.get("MOELAB_BATCH_COPY", "1") == "0" or not isinstance(cp, types.ModuleType):
        return None, False  # off, or a stand-in cupy (tests): no driver behind it
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, False
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        f = getattr(lib, name, None)
        if f is None:
            continue
        f.argtypes = [vp, vp, vp, sz, vp, vp, sz] + ([vp] if fail_idx else []) + [vp]
        f.restype = ctypes.c_int
        return f, fail_idx
    return None, False


class CopyBatch:
    """Host -> device copies gathered by ``add`` and queued by ``flush`` on a stream (see the
    module docstring). ``batches`` / ``copies`` count the driver calls and copies queued."""

    refused: int | None = None  # the CUDA error of a first batch the driver refused (then one by one)

    def __init__(self, capacity: int = 4 * 2 * _MAX_K):
        self.capacity = capacity
        self._a = np.zeros((3, capacity), np.uint64)  # dst, src, size
        self._addr = tuple(int(self._a[i].ctypes.data) for i in range(3))
        self._view = memoryview(self._a).cast("B")  # packed into (cheaper than packing into the array)
        self._attrs = np.zeros(6, np.uint32)  # CUmemcpyAttributes: order, src hint, dst hint, flags
        self._attrs[0] = _ACCESS_STREAM
        self._idx = np.zeros(1, np.uint64)
        self._fail = np.zeros(1, np.uint64)
        self._fn, self._fail_idx = _driver_batch()
        self._consts = (self._attrs.ctypes.data, self._idx.ctypes.data, 1)
        if self._fail_idx:  # the older form's failIdx (numpy's ctypes.data costs a microsecond a call)
            self._consts += (self._fail.ctypes.data,)
        self._packs: dict[int, struct.Struct] = {}  # n -> the three rows of _a in one pack
        self.dst: list[int] = []
        self.src: list[int] = []
        self.size: list[int] = []
        self.batches = self.copies = 0

    @property
    def batched(self) -> bool:
        """Whether ``flush`` queues its copies by one driver call."""
        return self._fn is not None

    def add(self, dst: int, rows, expert: int) -> int:
        """Gather the copies of one expert: ``rows`` = [(host base, row stride, row bytes)] per
        part (``GpuExperts._host_rows``), the parts laid out from ``dst`` on; returns its bytes."""
        off = 0
        d, s, z = self.dst, self.src, self.size
        for base, stride, n in rows:
            d.append(dst + off)
            s.append(base + expert * stride)
            z.append(n)
            off += n
        return off

    def flush(self, stream_ptr: int) -> None:
        """Queue the gathered copies on ``stream_ptr`` (not the legacy default stream) and forget them."""
        n = len(self.dst)
        if not n:
            return
        d, s, z = self.dst, self.src, self.size
        self.dst, self.src, self.size = [], [], []
        self.copies += n
        fn = self._fn
        if fn is not None and n <= self.capacity:
            f = self._packs.get(n)
            if f is None:
                pad = 8 * (self.capacity - n)
                f = self._packs[n] = struct.Struct(f"<{n}Q{pad}x{n}Q{pad}x{n}Q")
            f.pack_into(self._view, 0, *d, *s, *z)
            err = fn(*self._addr, n, *self._consts, stream_ptr)
            if not err:
                self.batches += 1
                return
            if self.batches:  # it worked before: a real failure
                raise ExecutorError(f"cuMemcpyBatchAsync: CUDA error {err}")
            CopyBatch.refused = err  # refused at once: copies one by one from now on
            self._fn = None
        for i in range(n):
            _rt.memcpyAsync(d[i], s[i], z[i], _H2D, stream_ptr)


def _copy_plan(gx, layer: int):
    """(experts, slots, bytes per expert, each slot's part addresses, each expert's host part
    addresses, the parts' bytes, their offsets in a slot) of a layer whose host rows are contiguous
    (``GpuExperts._host_rows``), else False; cached in ``gx._copy_plans`` (reset by
    ``set_capacity``). The address tables make a step's gather a lookup per expert."""
    rows = gx._host_rows(layer)
    plan = False
    if rows is not None:
        ptr, stride, n_slots = gx.slot_tables[layer] or (0, 0, 0)
        offs = [sum(r[2] for r in rows[:i]) for i in range(len(rows))]  # each part's place in a slot
        plan = (gx.layers[layer].num_experts, n_slots, sum(r[2] for r in rows),
                [tuple(ptr + s * stride + o for o in offs) for s in range(n_slots)],
                [tuple(base + e * row for base, row, _ in rows) for e in range(gx.layers[layer].num_experts)],
                tuple(r[2] for r in rows), tuple(offs))
    gx._copy_plans[layer] = plan
    return plan


def _bad_copy(gx, layer: int, experts, slots, streamed, n: int, n_slots: int) -> None:
    """Raise the ExecutorError of the first expert or slot out of range."""
    for e, s in zip(experts, slots):
        if not 0 <= s < n_slots:
            gx._slot_ptr(layer, s)  # raises: no pool, or the slot out of range
        if not 0 <= e < n:
            raise ExecutorError(f"layer {layer}: expert {e} out of range")
    for e in streamed:
        if not 0 <= e < n:
            raise ExecutorError(f"layer {layer}: expert {e} out of range")


def queue_copies(gx, layer: int, experts, slots, streamed, scratch, late=None) -> None:
    """``GpuExperts.copy_in``: the copy stream waits for ``last_read``, the copies are gathered
    into ``gx``'s CopyBatch (or go as ``upload`` / ``stream_to`` while the host rows are staged,
    not yet registered or being loaded), then the compute stream waits for the copy stream (with
    ``late`` = (LateStart, seq, bases): the step's late entries are copied instead). As
    ``upload``, an upload into a slot the background load filled with the same expert is skipped.
    Every expert and slot is checked before anything is queued."""
    copy = gx.copy.ptr
    _rt.streamWaitEvent(copy, gx.last_read.ptr)
    plan = False
    if gx.staging is None and gx._load is None and gx._defer is None:
        plan = gx._copy_plans.get(layer)
        if plan is None:
            plan = _copy_plan(gx, layer)
    if not plan:
        for e, s in zip(experts, slots):
            gx.upload(layer, e, s)
        for e, k in zip(streamed, scratch):
            gx.stream_to(layer, e, k)
    else:
        n, n_slots, nbytes, dst, src, sizes, offs = plan
        if experts and (min(slots) < 0 or max(slots) >= n_slots or min(experts) < 0 or max(experts) >= n) or \
                streamed and (min(streamed) < 0 or max(streamed) >= n):  # checked before anything is gathered
            _bad_copy(gx, layer, experts, slots, streamed, n, n_slots)
        b, filled = gx._batch, gx.filled
        d, h, z = b.dst.extend, b.src.extend, b.size.extend  # as CopyBatch.add, inline
        m = 0
        for e, s in zip(experts, slots):
            if filled and filled.pop((layer, s), None) == e:
                continue  # put there by the background load, and nothing has written the slot since
            d(dst[s])
            h(src[e])
            m += 1
        for e, k in zip(streamed, scratch):
            d(map(gx.source_ptr(layer, -1 - k).__add__, offs))
            h(src[e])
            m += 1
        if m:
            z(sizes * m)
            gx.bytes_uploaded += m * nbytes
            b.flush(copy)
    if late is None:
        gx.compute_after_copies()
    else:
        late[0].put(late[1], late[2], copy)


class LateStart:
    """The late pairs of early-started one-token steps for ``gx`` (a ``GpuExperts``); see the
    module docstring. ``begin`` numbers a step and launches its gate/up over every routed pair,
    ``put`` queues its entries after its uploads, ``release`` sets its late pairs free."""

    RING = 64  # pinned source entries (a block of 32 rewritten after the block before last was copied)

    def __init__(self, gx, timeout_s: float):
        self.gx = gx
        self.timeout_ns = int(min(timeout_s, LATE_TIMEOUT_S) * 1e9)
        self.seq = 0
        self._n = 0  # entries copied so far
        n = self.RING * 8 * _MAX_K
        self._mem = cp.cuda.alloc_pinned_memory(n + 64)
        self._src = memoryview(np.frombuffer(self._mem, np.uint8, n + 64)).cast("B")
        self._src_ptr = int(np.frombuffer(self._mem, np.uint8, 1).ctypes.data)
        self._err = np.frombuffer(self._mem, np.int64, 3, n)  # mapped (unified addressing): seq, word seen, pair
        self._err[:] = 0
        with gx.compute:
            self._late = cp.zeros(_MAX_K, cp.uint64)  # per pair: slot address | tag; tag 0: none yet
        gx.compute.synchronize()  # zeroed before any copy stream writes it
        self._dev = int(self._late.data.ptr)
        self._events = [cp.cuda.Event(disable_timing=True) for _ in range(2)]
        self._launches: dict[int, FixedLaunch] = {}
        self._packs = [struct.Struct(f"<{k}Q") for k in range(_MAX_K + 1)]
        self._log = np.zeros((self.RING, 3))  # per seq % RING: layer, host time begun, host time put (0: not yet)

    def _launch(self, layer: int) -> FixedLaunch:
        """The layer's ``moe1_gate_up_late``: the table, step number, timeout and error words, then
        the arguments and grid of its ``moe1_gate_up`` (``GpuExperts._one``)."""
        f = self._launches.get(layer)
        if f is None:
            gu = self.gx._one(layer)[0]
            func = cuda_module("gpu_kernels.cu", "expert_kernels_v4.cu").get_function("moe1_gate_up_late")
            f = self._launches[layer] = FixedLaunch(
                func.kernel.ptr, [self._dev, 0, self.timeout_ns, self._src_ptr + self.RING * 8 * _MAX_K] +
                gu.vals.tolist(), gu.grid_x, self.gx._ex)
        return f

    def begin(self, layer: int, x, bases, pick, k: int) -> int:
        """Launch the gate/up of a step's ``k`` routed pairs on the compute stream (``bases[j]``
        the slot address of a resident pair, 0 for a late one; ``pick``: every pair, resident
        first); returns the step's number, which ``put`` or ``release`` must resolve. Raises the
        error of an earlier step whose late pair timed out."""
        if self._err[0]:
            self.check()
        self.seq = seq = self.seq + 1
        gx = self.gx
        pack1(gx._ex, bases, (), pick)
        f = self._launches.get(layer) or self._launch(layer)
        v = f.vals
        v[1] = seq
        v[4] = x.data.ptr  # (moe1_gate_up's x)
        f.launch(k, 128, gx.compute.ptr)  # block 32 * WARPS, as gate_up1
        log = self._log[seq % self.RING]
        log[0], log[1], log[2] = layer, time.perf_counter(), 0.0
        return seq

    def copy_in(self, layer: int, experts, slots, seq: int, bases) -> None:
        """``GpuExperts.copy_in`` of step ``seq``'s uploads, then its entries (``bases``: every pair's)."""
        queue_copies(self.gx, layer, experts, slots, (), (), (self, seq, bases))

    def put(self, seq: int, bases, stream_ptr: int) -> None:
        """Queue the copy of step ``seq``'s entries (``bases[j]`` for pair j, 256-byte aligned; the
        late pairs read theirs) on ``stream_ptr`` (after the step's uploads, behind ``last_read``)."""
        n = self._n
        if not n & 31 and n >= 64:
            self.gx.wait(self._events[(n >> 5) & 1], "copy of a late entry")
        i = (n % self.RING) * 8 * _MAX_K
        tag = seq % 255 + 1
        k = len(bases)
        self._packs[k].pack_into(self._src, i, *map(tag.__or__, bases))
        _rt.memcpyAsync(self._dev, self._src_ptr + i, 8 * k, _H2D, stream_ptr)
        self._n = n + 1
        if n & 31 == 31:
            _rt.eventRecord(self._events[(n >> 5) & 1].ptr, stream_ptr)
        self._log[seq % self.RING, 2] = time.perf_counter()

    def release(self, seq: int, k: int) -> None:
        """Set step ``seq``'s late pairs free (address 0: they write nothing), on the copy stream;
        ``last_read`` then moves past its kernel, so the next step's entries wait for its blocks
        to have read these (a later tag in their words would leave them waiting)."""
        gx = self.gx
        _rt.streamWaitEvent(gx.copy.ptr, gx.last_read.ptr)
        self.put(seq, [0] * k, gx.copy.ptr)
        gx.mark_read()

    def check(self) -> None:
        """ExecutorError when a late pair waited past the timeout (its step's output is wrong)."""
        seq = int(self._err[0])
        if not seq:
            return
        word, j = int(self._err[1]), int(self._err[2])
        layer, t_begin, t_put = self._log[seq % self.RING] if self.seq - seq < self.RING else (-1, 0.0, 0.0)
        queued = (f"its entries were queued {1e3 * (t_put - t_begin):.3f} ms after its kernel" if t_put else
                  "its entries had not been queued when the error was read")
        raise ExecutorError(f"pair {j} of one-token step {seq} (layer {int(layer)}) waited for its slot address past "
                            f"{self.timeout_ns / 1e9:g} s (its output was not computed): {queued}; the word it "
                            f"last saw carried tag {word & 0xFF} (its own: {seq % 255 + 1})")


def _free_refs() -> int:
    """``sys.getrefcount`` of an object only a list holds, seen from a loop over the list as
    ``GpuExperts._output`` loops (the count depends on the interpreter's reference borrowing)."""
    ring = [object()]
    for a in ring:
        return sys.getrefcount(a)
    return 0


FREE_REFS = _free_refs()
