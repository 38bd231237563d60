"""Whether two trees' expert engines ask the GPU for the same work: their runtime calls compared.

Each tree's engine (``execute.engine.ExpertEngine`` over ``execute.gpu_experts.GpuExperts``) runs the
same policies over the same ``traces.synth`` trace as ``bench_engine_host.py`` does (``begin_layer``,
the driver's plan, ``run_layer``), over its stand-in cupy, in a child process per tree. Every runtime
call is recorded with what the GPU would see: event records and stream waits (which stream, which
event), each kernel launch's grid, block, stream, argument values and the one-token pair table it
passes by value (``Experts1``: bases, weights, picks), each copy's destination, source and size.
Addresses are written relative to what they point into (a slot of the arena, a row of a host
expert stack, otherwise the order in which the run first used them), so two processes compare.
Equal records mean the same kernels on the same inputs in the same stream order: the same outputs.

``--base REV``: REV's ``execute`` / ``scheduler`` / ``traces`` beside this tree's; prints, per
policy, the number of calls and the first record that differs (exit 1 if any).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import numpy as np

import bench_engine_host as H
from engine_standin import Dev, standin_cupy


class Recorder:
    """The runtime calls of one run, with addresses made relative (see the module docstring)."""

    def __init__(self):
        self.calls: list = []
        self.gx = None
        self.late = None  # the engine's gpu_step.LateStart, if any
        self._seen: dict[int, int] = {}

    def addr(self, v: int):
        gx = self.gx
        if gx is not None and v >= 0x10000:
            for i, a in enumerate(gx.arenas):
                if gx._arena_ptr[i] <= v < gx._arena_ptr[i] + a.size:
                    return f"A{i}+{v - gx._arena_ptr[i]}"
            for layer, rows in gx._rows.items():
                for p, (base, stride, n) in enumerate(rows or ()):
                    if base <= v < base + stride * gx.layers[layer].num_experts:
                        return f"H{layer}.{p}+{v - base}"
        if v < 0x10000:
            return v
        return f"P{self._seen.setdefault(v, len(self._seen))}"

    def launch(self, func, gx_, gy, gz, bx, by, bz, smem, stream, params, extra):
        late = self.late._launches.values() if self.late is not None else ()
        one = {fl.ptr: fl for fl in [f for pair in self.gx._ones.values() for f in pair] + list(late)}.get(params)
        if one is None:
            self.calls.append(("launch?", func, gx_, gy, bx))
            return
        ex = self.gx._ex
        m = len(ex) // 16
        table = ([self.addr(int(b)) for b in ex[:8 * m].view(np.uint64)], ex[8 * m:12 * m].view(np.float32).tolist(),
                 ex[12 * m:].view(np.int32).tolist())
        self.calls.append(("launch", gx_, gy, bx, self.addr(stream), [self.addr(int(v)) for v in one.vals], table))

    def copy(self, d, s, n, kind, st):
        """A copy; one into the late table with the (step number, address) entries it carries."""
        rec = ("copy", self.addr(d), self.addr(s), n, self.addr(st))
        late = self.late
        if late is not None and d == late._dev:
            e = np.frombuffer(late._mem, np.uint64, n // 8, s - late._src_ptr).tolist()
            rec = ("late", n, self.addr(st), [(q, self.addr(b)) for q, b in zip(e[::2], e[1::2])])
        self.calls.append(rec)

    def batch(self, d, s, z, n, *rest):
        a = self.gx._batch._a[:, :n].tolist()  # dst, src, size
        self.calls.append(("batch", self.addr(rest[-1]), [(self.addr(d), self.addr(s), z) for d, s, z in zip(*a)]))
        return 0


def record(args) -> dict:
    """Per policy: the runtime calls of one pass over the trace (this process's tree)."""
    os.environ["MOELAB_HANDOFF"] = "0"
    cp = sys.modules["cupy"] = standin_cupy()
    from execute.engine import ExpertEngine
    from execute.gpu_experts import GpuExperts
    from scheduler import Capacity, make_policy
    from scheduler.drive import EndToken, RunLayer, drive

    layers, geo, tokens, weights = H.workload(args)
    out = {}
    for name in args.policies.split(","):
        cap = Capacity.per_layer(geo, args.experts if name == "gpu" else args.slots)
        rec = Recorder()
        rt = cp.cuda.runtime
        rt.eventRecord = lambda ev, s: rec.calls.append(("record", rec.addr(ev), rec.addr(s)))
        rt.streamWaitEvent = lambda s, ev: rec.calls.append(("wait", rec.addr(s), rec.addr(ev)))
        rt.memcpyAsync = rec.copy
        cp.cuda.driver.launchKernel = rec.launch
        import execute.gpu_step as S
        S._launch_kernel = rec.launch  # (bound at import)
        pol = make_policy(name, geo, cap)
        gx = rec.gx = GpuExperts(layers, cap, scratch_slots=16, pinned=False)
        gx._batch._fn, gx._batch._fail_idx = rec.batch, False
        for l in range(args.layers):
            gx._host_rows(l)
        engine = ExpertEngine(layers, cap, threads=1, use_gpu=True, gpu=gx)
        rec.late = getattr(engine, "_late", None)
        engine.load_residents(pol.cache.slot)
        rec.calls.clear()
        x, state = Dev((1, 256)), {}

        def forward(tok):
            for step in tok.steps:
                state["ids"], state["w"] = np.array([step.experts], np.int64), weights[tok.index, step.layer]
                engine.begin_layer(step.layer, x, state["ids"])
                yield step

        for item in drive(pol, (replace(t, steps=forward(t)) for t in tokens)):
            if isinstance(item, RunLayer):
                engine.run_layer(item, x, state["ids"], state["w"])
            elif not isinstance(item, EndToken):
                raise SystemExit(f"background moves are not recorded here ({type(item).__name__})")
        engine.close()
        out[name] = rec.calls
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision whose engine to compare with this tree's")
    ap.add_argument("--policies", default="lru,gpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16, help="cache slots per layer (gpu: every expert)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens < 1 or args.layers < 1 or not 8 <= args.slots <= args.experts:
        ap.error("--tokens and --layers must be >= 1, --slots in 8..--experts")
    if not set(args.policies.split(",")) <= {"lru", "gpu"}:
        ap.error(f"--policies: lru and gpu only (no CPU work over the stand-in), got {args.policies!r}")
    if args.record:
        print(json.dumps(record(args)))
        return 0
    cmd = [sys.executable, __file__, "--record", "--base", args.base, "--policies", args.policies] + [
        f"--{k}={getattr(args, k)}" for k in ("tokens", "layers", "experts", "slots", "seed")]
    got = dict(H.in_both_trees(args.base, cmd))
    same = True
    for name in args.policies.split(","):
        a, b = got["base"][name], got["this"][name]
        diff = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), None)
        if diff is None and len(a) == len(b):
            print(f"{name}: the same {len(a)} runtime calls")
            continue
        same = False
        i = min(len(a), len(b)) if diff is None else diff
        print(f"{name}: {len(a)} calls at {args.base}, {len(b)} here; first difference at call {i}:\n"
              f"  {args.base}: {a[i] if i < len(a) else None}\n  here: {b[i] if i < len(b) else None}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
