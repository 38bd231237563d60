"""Expert-kernel rates on this machine: CPU pool GB/s per quant type and thread count, GPU kernel
GB/s per type (8 experts x 1 token, and 8 experts x 4 tokens), host->device upload GB/s.

Shapes: hidden 2048, ffn 768 (Qwen3-30B-A3B's experts), 96 random experts per type so that
rotating 8-expert sets defeats the 300 MiB L3. Prints a table; writes OUT/kernels.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from execute import quant as Q
from execute.cpu_experts import run_experts, tensor_views
from execute.experts import random_layer

import numba


def cpu_rate(layer, threads: int, reps: int = 12) -> float:
    numba.set_num_threads(threads)
    views = (tensor_views(layer.gate), tensor_views(layer.up), tensor_views(layer.down))
    x = np.random.default_rng(0).standard_normal((8, layer.hidden)).astype(np.float32)
    run_experts(layer, list(range(8)), x, threads, views)
    ts = []
    for r in range(reps):
        base = (r * 8) % (layer.num_experts - 8)
        t0 = time.perf_counter()
        run_experts(layer, list(range(base, base + 8)), x, threads, views)
        ts.append(time.perf_counter() - t0)
    return 8 * layer.expert_bytes / float(np.median(ts)) / 1e9


def gpu_rates(cp, layer, tokens: int, reps: int = 20) -> tuple[float, float]:
    from execute.gpu_experts import GpuExperts
    from scheduler.core import Capacity, Geometry

    geo = Geometry((layer.num_experts,), 8, (layer.expert_bytes,))
    gx = GpuExperts([layer], Capacity.per_layer(geo, 64), scratch_slots=1, pinned=False)
    gx.begin_copies()
    for s in range(64):
        gx.upload(0, s, s)
    gx.wait(gx.copies_event())
    x = cp.asarray(np.random.default_rng(0).standard_normal((tokens, layer.hidden)).astype(np.float32))
    ts = []
    for r in range(reps):
        base = (r * 8) % 56
        src = [base + i for i in range(8) for _ in range(tokens)]
        rows = [t for _ in range(8) for t in range(tokens)]
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(gx.compute)
        gx.run(0, src, x, rows)
        b.record(gx.compute)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    gx.close()
    return 8 * layer.expert_bytes / float(np.median(ts[3:])) / 1e9, float(np.median(ts[3:]))


def upload_rate(cp, pinned: bool, nbytes: int = 5_013_504, n: int = 64) -> float:
    host = np.ones(nbytes * 8, np.uint8)
    if pinned:
        cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 0)
    dev = cp.empty(nbytes * 8, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    s.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        o = (i % 8) * nbytes
        cp.cuda.runtime.memcpyAsync(dev.data.ptr + o, host.ctypes.data + o, nbytes, cp.cuda.runtime.memcpyHostToDevice, s.ptr)
    s.synchronize()
    dt = time.perf_counter() - t0
    if pinned:
        cp.cuda.runtime.hostUnregister(host.ctypes.data)
    return n * nbytes / dt / 1e9


def main() -> int:
    import cupy as cp

    rng = np.random.default_rng(0)
    out = {"cpu": {}, "gpu": {}, "upload": {}}
    types = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.BF16, Q.F16, Q.F32]
    for qt in types:
        name = Q.QTYPES[qt].name
        layer = random_layer(rng, 0, 96 if qt not in (Q.F32,) else 72, 2048, 768, qt, exact=False)
        threads = [4, 8, 12, 15, 16] if qt == Q.Q8_0 else [15]
        out["cpu"][name] = {t: cpu_rate(layer, t) for t in threads}
        g1, t1 = gpu_rates(cp, layer, 1)
        g4, t4 = gpu_rates(cp, layer, 4)
        out["gpu"][name] = {"gbps_1tok": g1, "us_1tok": t1 * 1e6, "gbps_4tok": g4, "us_4tok": t4 * 1e6,
                            "expert_bytes": layer.expert_bytes}
        print(f"{name:5} cpu " + " ".join(f"{t}t:{v:.1f}" for t, v in out['cpu'][name].items())
              + f" GB/s | gpu 8x1: {g1:.0f} GB/s ({t1 * 1e6:.0f} us), 8x4: {g4:.0f} GB/s ({t4 * 1e6:.0f} us)", flush=True)
        del layer
    out["upload"] = {"pinned_gbps": upload_rate(cp, True), "pageable_gbps": upload_rate(cp, False)}
    print(f"upload 5 MB experts: pinned {out['upload']['pinned_gbps']:.1f} GB/s, pageable {out['upload']['pageable_gbps']:.1f} GB/s")
    d = Path(os.environ.get("OUT", "."))
    (d / "kernels.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
