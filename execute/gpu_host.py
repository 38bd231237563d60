"""Host-side helpers of the GPU expert path: kernel launches through ``cuLaunchKernel`` with a
reusable argument block, page-locked host buffers guarded by events, and the unregistering of
page-locked (``cudaHostRegister``) host ranges."""
from __future__ import annotations

import struct

import cupy as cp
import numpy as np

from .pdl_launch import launch_programmatic

__all__ = ["Launch", "PinnedRing", "Staging", "cuda_module", "unregister"]

_rt = cp.cuda.runtime
_MODULES: dict[tuple[str, ...], cp.RawModule] = {}


def cuda_module(*files: str) -> cp.RawModule:
    """This package's CUDA sources ``files``, concatenated in that order (a later file may use an
    earlier one's helpers) and compiled once per process."""
    m = _MODULES.get(files)
    if m is None:
        from importlib import resources

        src = "\n".join(resources.files(__package__).joinpath(f).read_text() for f in files)
        m = _MODULES[files] = cp.RawModule(code=src, options=("-std=c++14",))
    return m


def unregister(ptrs: list[int], arrays: list[np.ndarray]) -> None:
    """Unregister page-locked host ranges, then let their arrays go (they were kept until now)."""
    for ptr in ptrs:
        try:
            _rt.hostUnregister(ptr)
        except _rt.CUDARuntimeError:  # a context already gone
            pass
    ptrs.clear()
    arrays.clear()


class Launch:
    """A compiled kernel launched through ``cuLaunchKernel`` with a reusable argument block.

    ``launch(grid, block, stream_ptr, *args)``: every argument is a Python int written to its own
    64-bit slot as a signed 64-bit value (device pointers as addresses, below 2**63; an ``int``
    parameter reads the slot's low 32 bits; ``f32(x)`` gives a ``float`` parameter's bits). The driver
    copies the values at launch, so the block is reused at once. ``nargs`` must match the kernel.
    With ``blob`` (a uint8 array laid out as a struct parameter), the kernel's first parameter is
    that struct, passed by value (its current bytes at each launch); ``args`` are the rest.
    ``programmatic``: launched with programmatic dependent launch (``execute.pdl_launch``; the
    kernel waits for its inputs itself).
    """

    def __init__(self, kernel: cp.RawKernel, nargs: int, blob: np.ndarray | None = None, programmatic: bool = False):
        self.func = kernel.kernel.ptr
        self.nargs = nargs
        self.programmatic = programmatic
        self._vals = np.zeros(nargs, np.uint64)
        self._view = memoryview(self._vals).cast("B")  # written by one pack (a numpy slice assignment costs more)
        self._pack = struct.Struct(f"<{nargs}q").pack_into  # signed: an int parameter may be negative
        ptrs = [self._vals.ctypes.data + 8 * i for i in range(nargs)]
        self._blob = blob  # a by-value struct as the kernel's first parameter (kept alive here)
        if blob is not None:
            ptrs.insert(0, blob.ctypes.data)
        self._params = np.array(ptrs, np.uint64)
        self._params_ptr = int(self._params.ctypes.data)

    @staticmethod
    def f32(x: float) -> int:
        """The bits of ``x`` as a float32, for a ``float`` kernel parameter."""
        return int(np.float32(x).view(np.uint32))

    def __call__(self, grid: tuple[int, int], block: int, stream_ptr: int, *args: int) -> None:
        if len(args) != self.nargs:
            raise ValueError(f"kernel launch: {len(args)} arguments, expected {self.nargs}")
        self._pack(self._view, 0, *args)
        if self.programmatic:
            launch_programmatic(self.func, grid, block, 0, stream_ptr, self._params_ptr)
        else:
            cp.cuda.driver.launchKernel(self.func, grid[0], grid[1], 1, block, 1, 1, 0, stream_ptr, self._params_ptr, 0)


class PinnedRing:
    """Reusable page-locked host buffers; a buffer is reused only after its copy's event."""

    def __init__(self, n: int, nbytes: int, device: bool = False):
        self.bufs = [cp.cuda.alloc_pinned_memory(nbytes) for _ in range(n)]
        self.arrays = [np.frombuffer(b, np.uint8, nbytes) for b in self.bufs]
        self.ptrs = [b.ptr for b in self.bufs]
        self.events: list[cp.cuda.Event | None] = [None] * n
        self.device = [cp.empty(nbytes, cp.uint8) for _ in range(n)] if device else []
        self.next = 0

    def take(self) -> tuple[np.ndarray, int]:
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        return self.arrays[i], i


class Staging:
    """Grow-only pinned host buffer + float32 view, with an event guarding its last async copy."""

    def __init__(self):
        self.mem = None
        self.f32 = np.empty(0, np.float32)
        self.event = cp.cuda.Event(disable_timing=True)
        self.pending = False

    def view(self, rows: int, cols: int) -> np.ndarray:
        """(rows, cols) float32 over the buffer, after its last async copy has finished."""
        if self.pending:
            self.event.synchronize()
            self.pending = False
        n = rows * cols
        if n > self.f32.size:
            self.mem = cp.cuda.alloc_pinned_memory(4 * max(n, 2 * self.f32.size))
            self.f32 = np.frombuffer(self.mem, np.float32, self.mem.size() // 4)
        return self.f32[:n].reshape(rows, cols)

    def copied(self, stream_ptr: int) -> None:
        _rt.eventRecord(self.event.ptr, stream_ptr)
        self.pending = True
