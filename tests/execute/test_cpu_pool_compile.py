"""CpuExpertPool compiles before any timed wait, and only what its layers need: with a cold Numba
cache (a fresh machine, e.g. a GPU host running the suite) a pool compiles its team's loop and the
row kernel of each type it is given, time a call's ``result()`` timeout must not count; every type's
kernel compiles on its own and is loaded from Numba's cache by the next process (slow: it compiles
every kernel type from scratch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_COLD = """
import numpy as np
from execute import quant as Q
from execute.cpu_experts import _KERNELS, row_kernel
from execute.cpu_pool import CpuExpertPool
from execute.experts import random_layer
layer = random_layer(np.random.default_rng(0), 0, 4, 64, 32, Q.Q8_0)
with CpuExpertPool(1, 2.0) as pool:  # 2 s: far below a cold compile
    pool.warmup(layer)
assert sorted(_KERNELS) == [Q.Q8_0], sorted(_KERNELS)  # the pool compiled its layer's type alone
for qt in sorted(Q.CPU_QTYPES):
    assert row_kernel(qt).address
print("ok")
"""

_WARM = """
from execute import quant as Q
from execute.cpu_experts import row_kernel
cold = [Q.LAYOUTS[qt].name for qt in sorted(Q.CPU_QTYPES) if row_kernel(qt).cache_hits != 1]
print(cold or "ok")
"""


@pytest.mark.slow
def test_a_cold_numba_cache_does_not_time_out_the_first_call_and_a_second_run_is_warm(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    root = Path(__file__).resolve().parents[2]
    for script in (_COLD, _WARM):
        r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                           timeout=1800)
        assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout[-2000:], r.stderr[-2000:])
