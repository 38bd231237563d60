"""Where ``moelab run``'s time to first token goes: host-clock phases from the command's start to the
first sampled token (``first_token_breakdown`` in ``moelab run --json``).

Phases (seconds), in the order they run:

- ``import_s``: process start to the command's start (Python start-up, imports); read from the
  kernel's process start time (Linux), None elsewhere; it precedes ``first_token_s``'s clock and is
  not part of it;
- ``finite_check_s``: the NaN/Inf scan of the file's weights (``weights_check``; skipped by
  ``--allow-non-finite``, or answered from the check cache for a file checked before);
- ``model_open_s``: parsing the GGUF file and mapping it (expert tensors are views on the map);
- ``dense_dequantize_s``: dense tensors expanded to float32 at load (the matrices a run reads as
  stored stay stored: ``gguf_model.StoredDense``); ``expert_convert_s``: experts of a type no
  expert kernel reads, converted to F16;
- ``tokenizer_s``: the vocabulary read and the prompt encoded;
- ``policy_s``: capacity and policy built;
- ``kernel_compile_s``: the run's CuPy modules compiled by NVRTC, or loaded from CuPy's cache;
- ``backend_s``: the expert backend built (GPU arenas and scratch, the CPU pool's state); with
  ``MOELAB_FAST_LOAD`` (the default) a background thread starts here that page-locks the expert
  weights (``cudaHostRegister``) and uploads the experts the policy placed, overlapping the phases
  up to ``expert_upload_s``; without it the weights are page-locked here;
- ``dense_upload_s``: the model's dense weights put on their device in the kernels' layout (GPU: the
  stored bytes copied, through pinned staging buffers with ``MOELAB_FAST_LOAD``, Q8_0 split; CPU:
  float32 arrays), the KV cache allocated;
- ``prefill_warmup_s`` (GPU): the process's first uses of the chunk path paid on stand-in tokens
  (one block and the head: library kernels loaded, cuBLAS set up) and the decode graphs captured,
  so that the prompt and decode clocks start warm, as llama-bench's warm-up run does;
- ``numba_warmup_s``: the CPU expert kernels compiled, or loaded from Numba's cache, by one call;
- ``expert_upload_s``: the experts the policy placed at construction uploaded (all of them for
  ``gpu``); with ``MOELAB_FAST_LOAD``, the wait for the background load that remains;
- ``prefill_s``: the prompt run; ``first_sample_s``: its logits to the host and the first token
  sampled and printed;
- ``other_s``: ``first_token_s`` minus the phases above (argument checks, bookkeeping).

:class:`GpuInit`, started by ``moelab run`` as soon as its arguments are read when the run wants a
GPU: the CUDA context is created (``cudaFree(0)``, which CuPy calls without the GIL) and cuBLAS
initialised on a thread while the main thread imports, maps the file and reads the vocabulary;
the main thread's first CUDA call then finds them made (``policy_s`` shrinks by what overlapped).
Given the model's shapes (:meth:`GpuInit.warm`), the thread then runs the chunk path's library
work on zeros (``prefill_dense.warm_library``) while the weights go up, which the warm-up would
otherwise pay first.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

__all__ = ["GpuInit", "Phases", "process_age_s", "precompile_kernels", "PHASES"]

PHASES = ("finite_check_s", "model_open_s", "dense_dequantize_s", "expert_convert_s", "tokenizer_s", "policy_s",
          "kernel_compile_s", "backend_s", "dense_upload_s", "prefill_warmup_s", "numba_warmup_s", "expert_upload_s",
          "prefill_s", "first_sample_s")


def process_age_s() -> float | None:
    """Seconds since this process started, from ``/proc`` (clock-tick resolution), or None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - start, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Phases:
    """Host-clock seconds per phase of one command (names of :data:`PHASES`), summed over calls."""

    def __init__(self, import_s: float | None = None):
        self.import_s = import_s
        self.s: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"phase {name!r}: expected one of {', '.join(PHASES)}")
        self.s[name] = self.s.get(name, 0.0) + max(float(seconds), 0.0)

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def breakdown(self, first_token_s: float | None) -> dict:
        """Every phase (0.0 when it did not run), ``other_s`` (first_token_s minus them, None without a
        first token) and ``import_s``."""
        out = {name: self.s.get(name, 0.0) for name in PHASES}
        out["other_s"] = None if first_token_s is None else max(first_token_s - sum(out.values()), 0.0)
        out["import_s"] = self.import_s
        return out


def precompile_kernels(gpu: bool) -> None:
    """Compile (or load from CuPy's cache) the CuPy modules a GPU run builds its launches from: the
    dense path's (one token's; a chunk's when ``MOELAB_PREFILL_DENSE`` allows), the expert arena's
    and, on GPUs with mma.sync (compute capability >= 8.0) when ``MOELAB_PREFILL`` allows, the
    batched prefill's; modules of rarer paths compile when first used."""
    if not gpu:
        return
    try:
        import cupy as cp
    except ImportError:  # the backend reports it, in its own words
        return

    from . import gpu_dense, gpu_experts

    gpu_dense._function("dense_gemv")
    gpu_experts._kernel("moe_gate_up")
    from . import prefill_dense

    if prefill_dense.dense_env():
        try:
            prefill_dense._kernel("pd_rmsnorm")
        except Exception:  # noqa: BLE001 - MoeModel says it in one warning line and keeps the CuPy path
            pass
    from .prefill import _kernel, prefill_env

    if int(cp.cuda.Device().compute_capability) >= 80 and prefill_env():
        _kernel("pf_mm")
        from . import prefill_mm2

        if prefill_mm2.mm_env() == 2:
            prefill_mm2.kernel()


class GpuInit:
    """The CUDA context and cuBLAS's initialisation on a background thread, started at once. Nothing
    waits for it: CuPy's and the driver's own locks make a caller's first CUDA call wait for the
    context (or create it) as usual. Errors are kept in :attr:`error`, never raised: the main
    thread's own first CUDA call reports them in its words."""

    def __init__(self, cublas: bool = True, wait_s: float = 30.0):
        self.error: BaseException | None = None
        self.done_s: float | None = None  # perf_counter when the thread ended
        self.warmed = False
        self._cublas, self._wait_s = cublas, wait_s
        self._job = None
        self._given = threading.Event()
        self._thread = threading.Thread(target=self._main, name="moelab-gpu-init", daemon=True)
        self._thread.start()

    def warm(self, info, tokens: int, cache_len: int) -> None:
        """Once the context is made, run the chunk path's library work for a model of ``info`` on
        ``tokens`` tokens (``prefill_dense.warm_library``; GQA models with the chunk dense path);
        given at most once, ignored after the thread has ended."""
        if self._job is None and not info.spec.attn == "mla":
            self._job = (info, int(tokens), int(cache_len))
        self._given.set()

    def _main(self) -> None:
        try:
            import cupy as cp

            cp.cuda.runtime.free(0)  # the primary context, created with the GIL released
            if self._cublas:
                from cupy_backends.cuda.libs import cublas

                cublas.destroy(cublas.create())  # the library's one-time set-up (this thread's handle dropped)
            if self._given.wait(self._wait_s) and self._job is not None:
                from .prefill_dense import dense_env, warm_library

                if dense_env() and int(cp.cuda.Device().compute_capability) >= 80:
                    warm_library(*self._job)
                    self.warmed = True
        except BaseException as exc:  # noqa: BLE001 - kept; the main thread's own call reports it
            self.error = exc
        finally:
            self.done_s = time.perf_counter()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread (at most ``timeout_s``); True when it has ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
