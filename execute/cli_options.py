"""What the executor's commands share: the user-error exception and its guard, and the checks and
builders of the options ``moelab replay`` and ``moelab run`` both take (policy, cache budget,
``--hardware`` cost model, ``--profile``, the GPU or CPU backend).

Errors in the input (a bad GGUF file, a trace of another geometry, a policy that needs a GPU on a
machine without one) print one line naming what was wrong and exit with status 2.
"""
from __future__ import annotations

import sys

from scheduler.files import OutputPathError, check_output

from .experts import ExecutorError

__all__ = ["Fail", "guard", "check_common", "build_capacity", "cost_options", "read_profile", "wants_gpu",
           "make_backend", "DEFAULT_CONTEXT", "context_limit", "gpu_free_bytes", "check_gpu_room", "cpu_kernels_cold"]

DEFAULT_CONTEXT = 4096  # positions a run may use when the file states no context length (llama.cpp's default)


class Fail(Exception):
    """A user error: message printed, exit 2."""


def guard(fn, args) -> int:
    from .gguf_io import GGUFError

    try:
        return fn(args)
    except Fail as exc:
        print(exc, file=sys.stderr)
        return 2
    except (GGUFError, ExecutorError) as exc:
        print(f"moelab: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as exc:  # writing a result (an audit, a trace) onto a full disk: name the file
        print(f"moelab: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def check_common(args, prog: str) -> None:
    """The arguments ``run`` and ``replay`` share, checked before the model is loaded."""
    from scheduler import POLICIES

    if args.policy not in POLICIES:
        raise Fail(f"{prog}: --policy {args.policy!r}: expected one of {', '.join(POLICIES)}")
    if args.cpu_dense and args.policy != "cpu":
        raise Fail(f"{prog}: --cpu-dense: only with --policy cpu (policy {args.policy!r} runs experts on the GPU)")
    if args.threads is not None:
        import numba

        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            raise Fail(f"{prog}: --threads {args.threads}: expected 1..{numba.config.NUMBA_NUM_THREADS} "
                        f"(this machine's cores)")
    for flag, value, ok, want in (("--cache-mib", args.cache_mib, lambda v: v >= 0, ">= 0"),
                                  ("--cache-slots", args.cache_slots, lambda v: v >= 0, ">= 0"),
                                  ("--timeout-s", args.timeout_s, lambda v: v > 0, "> 0 seconds"),
                                  ("--lag-tokens", args.lag_tokens, lambda v: v >= 0, ">= 0")):
        if value is not None and not ok(value):
            raise Fail(f"{prog}: {flag} {value}: expected {want}")
    try:
        if args.audit:
            check_output(args.audit, "--audit")
        if getattr(args, "record_trace", None):
            from traces.format import check_trace_dest

            check_trace_dest(args.record_trace, "--record-trace")
    except (OutputPathError, ValueError) as exc:
        raise Fail(f"{prog}: {exc}") from None
    if getattr(args, "profile", None):
        from scheduler.profile import read_strp

        try:
            read_strp(args.profile)
        except (ValueError, OSError) as exc:
            raise Fail(f"{prog}: --profile: {exc}") from None


def context_limit(args, info) -> tuple[int, str]:
    """The positions a run may use (prompt and generated tokens) and the words naming where the
    limit came from: ``--ctx`` when given, else the file's ``<arch>.context_length``, else
    ``DEFAULT_CONTEXT``; checked before anything is allocated."""
    if getattr(args, "ctx", None) is not None:
        return args.ctx, f"--ctx {args.ctx}"
    key = f"{info.arch}.context_length"
    if info.context_length:
        return info.context_length, f"the model's context length {info.context_length} ({key}; --ctx N overrides it)"
    return DEFAULT_CONTEXT, (f"the default context {DEFAULT_CONTEXT}, as the file has no {key} "
                             f"(--ctx N sets it)")


def gpu_free_bytes() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the current CUDA device's memory, or None without CuPy or a device
    (the backend then says why it cannot run)."""
    try:
        import cupy as cp
    except ImportError:
        return None
    try:
        free, total = cp.cuda.runtime.memGetInfo()
    except cp.cuda.runtime.CUDARuntimeError:
        return None
    return int(free), int(total)


def check_gpu_room(cache_bytes: int, flag: str, prog: str) -> None:
    """Refuse an expert cache larger than the GPU's free memory, before anything is allocated there
    (the dense weights and buffers then need room too)."""
    room = gpu_free_bytes() if cache_bytes else None
    if room is not None and cache_bytes > room[0]:
        free, total = room
        raise Fail(f"{prog}: {flag}: the expert cache ({cache_bytes / 2**20:.0f} MiB) is more than the GPU's free "
                   f"memory ({free / 2**20:.0f} MiB of {total / 2**20:.0f} MiB); give a smaller cache")


def build_capacity(args, geometry, prog: str = "moelab replay"):
    """The expert cache the arguments ask for, refused when the GPU's free memory cannot hold it."""
    capacity = _capacity(args, geometry, prog)
    if args.cache_slots is not None:
        flag = f"--cache-slots {args.cache_slots}"
    elif args.cache_mib is not None:
        flag = f"--cache-mib {args.cache_mib:g}"
    else:
        flag = f"--policy {args.policy} (every expert resident)"
    check_gpu_room(capacity.slot_bytes(geometry), flag, prog)
    return capacity


def _capacity(args, geometry, prog: str):
    from scheduler import Capacity
    from scheduler.core import CapacityError

    if args.cache_slots is not None and args.cache_mib is not None:
        raise Fail(f"{prog}: give --cache-mib or --cache-slots, not both")
    try:
        if args.cache_slots is not None:
            return Capacity.per_layer(geometry, args.cache_slots)
        if args.cache_mib is None:
            if args.policy == "cpu":
                return Capacity.per_layer(geometry, 0)
            if args.policy == "gpu":  # every expert resident
                return Capacity.per_layer(geometry, list(geometry.num_experts))
            raise Fail(f"{prog}: policy {args.policy!r} needs --cache-mib or --cache-slots")
        return Capacity.from_mib(geometry, args.cache_mib)
    except (ValueError, CapacityError) as exc:
        raise Fail(f"{prog}: {exc}") from None


def cost_options(args, prog: str) -> dict:
    """``cost_model=`` for ``hybrid-cost`` (and ``hybrid``'s PCIe share when ``--hardware`` is given),
    from ``--hardware`` and the model file's geometry."""
    if args.policy not in ("hybrid", "hybrid-cost"):
        if args.hardware:
            raise Fail(f"{prog}: --hardware is used only by --policy hybrid-cost and hybrid")
        return {}
    if args.policy == "hybrid" and not args.hardware:  # the fixed share (--miss-fraction, default 44/256)
        return {}
    from scheduler.costs import Costs, ExecConfig
    from scheduler.hardware import hardware_presets, load_hardware
    from .model_spec import model_spec

    if not args.hardware:
        raise Fail(f"{prog}: policy 'hybrid-cost' needs --hardware NAME|FILE for its cost model (a preset: "
                    f"{', '.join(hardware_presets())}; or a hardware JSON, e.g. from moelab calibrate)")
    try:
        cfg = ExecConfig(pinned=not args.pageable)  # the link rate the uploads will see
        return {"cost_model": Costs(model_spec(args.model), load_hardware(args.hardware), cfg).cost_model()}
    except ValueError as exc:
        raise Fail(f"{prog}: --hardware {args.hardware}: {exc}") from None


def read_profile(args, geometry, prog: str):
    """The ``--profile`` STRP file checked against the model's geometry, or None."""
    if not args.profile:
        return None
    from scheduler.profile import read_strp

    try:
        profile = read_strp(args.profile)
        profile.check_geometry(geometry)
    except (ValueError, OSError) as exc:
        raise Fail(f"{prog}: --profile: {exc}") from None
    return profile


def wants_gpu(args) -> bool:
    """Whether the dense path and the expert engine use the GPU: always for policies with GPU
    experts; for ``cpu`` (every expert on the CPU pool, as llama.cpp's ``--cpu-moe``) when a CUDA
    device is present, unless ``--backend numpy`` or ``--cpu-dense`` asks for a host-only run."""
    if args.policy != "cpu":
        return True
    if args.backend == "numpy" or getattr(args, "cpu_dense", False):
        return False
    try:
        from .gpu_experts import gpu_available
    except ImportError:  # no cupy
        return False
    return gpu_available()


def make_backend(args, weights, use_gpu: bool, capacity, prog: str = "moelab replay"):
    import os

    from . import model as M

    if args.pageable and args.policy == "cpu":
        raise Fail(f"{prog}: --pageable changes how experts are uploaded to the GPU; policy 'cpu' uploads none")
    if args.backend == "numpy":
        if use_gpu:
            raise Fail(f"{prog}: --backend numpy runs only policy 'cpu'")
        return M.NumpyExperts(weights)
    # the backend's prepare() compiles them, unless every expert goes to the GPU (policy gpu)
    if not getattr(args, "quiet", False) and args.policy != "gpu" and cpu_kernels_cold():
        print(f"{prog}: compiling the CPU expert kernels (first run after an install or update, ~10-30 s)...",
              file=sys.stderr, flush=True)
    return M.EngineExperts(weights, capacity, args.threads or os.cpu_count() or 1, use_gpu, args.timeout_s,
                           pinned=not args.pageable and args.policy != "cpu")


def cpu_kernels_cold(dispatcher=None) -> bool:
    """Whether the CPU pool's kernels will be compiled rather than loaded from Numba's on-disk cache:
    the cache index of ``dispatcher`` (default: the pool's team loop, whose index goes with every
    kernel's when their sources change; a type first run later compiles its own row kernel, a few
    seconds) is missing, of another Numba version, or older than its source. Reads Numba's cache
    object, which is not a public API: False (nothing said) where this Numba keeps it otherwise.
    False as well once this process has compiled or loaded them."""
    import pickle

    if dispatcher is None:
        from .cpu_pool import _team_worker as dispatcher
    if getattr(dispatcher, "signatures", None):
        return False
    try:
        return not dispatcher._cache._cache_file._load_index()
    except (AttributeError, OSError, EOFError, ValueError, pickle.UnpicklingError):
        return False

