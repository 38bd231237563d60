"""The stand-in for cupy of ``bench_engine_host.py`` and ``engine_calls_check.py``: device arrays,
streams and events with distinct addresses and no data; runtime and driver calls are plain Python
functions that count themselves in ``CALLS`` (the parts the engine's one-token path and its set-up
touch). ``current(cp, stream)`` makes ``stream`` the current stream of ``cp``."""
from __future__ import annotations

import types
from collections import Counter
from itertools import count

import numpy as np

CALLS: Counter = Counter()
_ptrs = count(1 << 36, 1 << 36)  # each array or handle a range of its own (64 GiB apart)


class Dev:
    """A device array: shape, dtype and a distinct address; no data."""

    def __init__(self, shape, dtype=np.float32, *_, **__):
        self.shape = tuple(shape) if isinstance(shape, tuple) else (int(shape),)
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.data = types.SimpleNamespace(ptr=next(_ptrs))


class Handle:
    """A stream or an event."""

    def __init__(self, *_, **__):
        self.ptr = next(_ptrs)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        pass

    def record(self, *_):
        CALLS["eventRecord"] += 1

    def wait_event(self, *_):
        CALLS["streamWaitEvent"] += 1

    synchronize = record  # (a stream's synchronize: at close only)


class Pinned(bytearray):
    ptr = property(lambda self: np.frombuffer(self, np.uint8).ctypes.data)
    size = bytearray.__len__


def counted(name: str, result=None):
    def call(*_, **__):
        CALLS[name] += 1
        return result
    return call


def standin_cupy() -> types.ModuleType:
    """The parts of cupy the engine's one-token path and its set-up touch."""
    cp = types.ModuleType("cupy")
    cp.float32, cp.int32, cp.uint8, cp.uint16, cp.uint64 = np.float32, np.int32, np.uint8, np.uint16, np.uint64
    cp.ndarray = Dev
    cp.empty = cp.zeros = lambda shape, dtype=np.float32, *a, **k: Dev(shape, dtype)
    cp.arange = lambda n, dtype=np.int32: Dev(n, dtype)
    kernel = types.SimpleNamespace(get_function=lambda name: types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1)))
    cp.RawModule = lambda *a, **k: kernel
    rt = types.SimpleNamespace(memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3,
                               CUDARuntimeError=RuntimeError)
    for name in ("eventRecord", "streamWaitEvent", "memcpyAsync", "memcpy2DAsync", "hostRegister", "hostUnregister"):
        setattr(rt, name, counted(name))
    rt.eventQuery, rt.getDeviceCount = counted("eventQuery", 0), counted("getDeviceCount", 1)
    cp.cuda = types.SimpleNamespace(runtime=rt, driver=types.SimpleNamespace(launchKernel=counted("launchKernel")),
                                    Stream=Handle, Event=Handle, alloc_pinned_memory=Pinned)
    current(cp, Handle())
    return cp


def current(cp, stream) -> None:
    """Make ``stream`` the current stream of the stand-in ``cp`` (``cupy.cuda.get_current_stream``)."""
    cp.cuda.get_current_stream = lambda: stream
