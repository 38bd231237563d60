"""Write, reopen and start replaying a 1,000,000-token x 48-layer x top-8 trace.

The routing is cheap but valid (each row a rotation of a per-layer permutation, so ids are
distinct); what is measured is the on-disk format: the atomic save, the memory-mapped open, and
the first tokens handed to the scheduler. The trace is written to a temporary directory and removed.

    python experiments/trace_open_speed.py [--tokens 1000000]
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import traces
from traces.format import Trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    args = ap.parse_args()
    T, L, K, E = args.tokens, 48, 8, 128
    rng = np.random.default_rng(0)
    base = np.argsort(rng.random((1, L, E)), axis=2)[:, :, :K].astype(np.int16)  # (1, L, K)
    ids = np.empty((T, L, K), np.int16)
    for i in range(0, T, 100_000):
        n = min(100_000, T - i)
        ids[i:i + n] = (base + rng.integers(0, E, size=(n, 1, 1), dtype=np.int16)) % E
    trace = Trace("synthetic-rotations", (E,) * L, K, ids, np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                  np.ones(T, np.uint8), meta={"source": "experiments/trace_open_speed.py"})
    root = tempfile.mkdtemp(prefix="moelab-trace-")
    try:
        path = os.path.join(root, "trace")
        t0 = time.perf_counter()
        trace.save(path)
        t1 = time.perf_counter()
        opened = traces.load(path)
        t2 = time.perf_counter()
        steps = sum(len(tok.steps) for tok in opened.tokens(limit=2000))
        t3 = time.perf_counter()
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    finally:
        shutil.rmtree(root)
    print(f"{T:,} tokens x {L} layers x top-{K}: {size / 2**20:,.0f} MiB on disk")
    print(f"  save (atomic)            {t1 - t0:8.3f} s")
    print(f"  open (memory-mapped)     {t2 - t1:8.4f} s")
    print(f"  first 2,000 tokens       {t3 - t2:8.3f} s  ({steps:,} steps)")


if __name__ == "__main__":
    main()
