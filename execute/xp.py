"""The array module of a run (numpy, or cupy on a GPU), host copies of its arrays, and the switch
that lets the GPU's one-token path replay CUDA graphs (``MOELAB_CUDA_GRAPHS``)."""
from __future__ import annotations

import os

import numpy as np

from .experts import ExecutorError

__all__ = ["array_module", "cuda_graphs_env", "env_switch", "host"]


def env_switch(name: str, default: str = "1") -> bool:
    """An on/off environment variable of the executor: ``1`` -> True, ``0`` -> False, unset ->
    ``default``; anything else is an ExecutorError naming it."""
    v = os.environ.get(name, default).strip()
    if v not in ("0", "1"):
        raise ExecutorError(f"environment variable {name}: {v!r}, expected 0 or 1")
    return v == "1"


def cuda_graphs_env() -> bool:
    """The ``MOELAB_CUDA_GRAPHS`` environment variable: ``1`` (the default) lets the fused one-token
    path replay CUDA graphs, ``0`` keeps its plain launches."""
    return env_switch("MOELAB_CUDA_GRAPHS")


def array_module(use_gpu: bool):
    """numpy, or cupy when ``use_gpu`` (imported only then)."""
    if not use_gpu:
        return np
    try:
        import cupy
    except ImportError as exc:
        raise ExecutorError(f"use_gpu needs cupy ({exc}); install moelab[gpu] or run with --policy cpu") from None
    return cupy


def host(a) -> np.ndarray:
    """``a`` as a numpy array (a device array is copied to the host)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)
