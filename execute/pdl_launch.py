"""Kernel launches with programmatic dependent launch (``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``, sm_90): the launched grid may start
while the grid before it on the stream still runs, once every block of that one has called
``griddepcontrol.launch_dependents`` or exited; the kernel itself must call
``griddepcontrol.wait`` before it reads anything an earlier grid writes (``dense_kernels_v2.cu``'s
v2 kernels do). Stream capture records the edge as a programmatic one in the graph. Used by
``MOELAB_DECODE_KERNELS=v3`` (``execute.kernel_variants``). ctypes over the driver library; no
cupy here.
"""
from __future__ import annotations

import ctypes

__all__ = ["LaunchAttribute", "LaunchConfig", "PROGRAMMATIC_STREAM_SERIALIZATION", "launch_programmatic", "refused"]

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (here its first int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("num_attrs", ctypes.c_uint)]


_launch = None
refused: int | None = None  # the CUDA error of the first launch the driver refused with the attribute
_ATTR = LaunchAttribute(PROGRAMMATIC_STREAM_SERIALIZATION, b"", 1)  # read by the driver at each launch
_CONFIGS: dict[tuple[int, int, int, int, int], tuple[LaunchConfig, int]] = {}
_MAX_CONFIGS = 4096  # distinct (grid, block, shared, stream) kept; past it the cache starts afresh


def _driver():
    global _launch
    if _launch is None:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        _launch = f
    return _launch


def _config(grid: tuple[int, int], block: int, shared: int, stream: int) -> tuple[LaunchConfig, int]:
    """A ``CUlaunchConfig`` with the attribute, and its address, built once per launch shape and
    stream (building the two structures cost more than the launch's other host work)."""
    key = (grid[0], grid[1], block, shared, stream)
    c = _CONFIGS.get(key)
    if c is None:
        if len(_CONFIGS) >= _MAX_CONFIGS:
            _CONFIGS.clear()
        cfg = LaunchConfig(grid[0], grid[1], 1, block, 1, 1, shared, stream or None, ctypes.addressof(_ATTR), 1)
        c = _CONFIGS[key] = (cfg, ctypes.addressof(cfg))
    return c


def launch_programmatic(func: int, grid: tuple[int, int], block: int, shared: int, stream: int, params: int) -> None:
    """Launch ``func`` (a CUfunction) on ``stream`` with ``params`` (the address of its argument
    pointer array, as for ``cuLaunchKernelEx``), programmatically dependent on the grid before it.
    Where the driver refuses the attribute, the same launch without it (a plain one: the kernel's
    wait is then a no-op), and ``refused`` keeps the first error (tests check it stays None)."""
    global refused
    cfg, ptr = _config(grid, block, shared, stream)
    launch = _launch or _driver()
    err = launch(ptr, func, params, None)
    if err:
        refused = err if refused is None else refused
        cfg.num_attrs = 0
        try:
            err = launch(ptr, func, params, None)
        finally:
            cfg.num_attrs = 1
    if err:
        raise RuntimeError(f"cuLaunchKernelEx: CUDA error {err}")
