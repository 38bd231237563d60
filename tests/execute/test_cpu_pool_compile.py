"""CpuExpertPool compiles its team's loop before any timed wait: with a cold Numba cache (a fresh
machine, e.g. a GPU host running the suite) the compile takes tens of seconds, which a call's
``result()`` timeout must not count (slow: it compiles every kernel type from scratch)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import numpy as np
from execute import quant as Q
from execute.cpu_pool import CpuExpertPool
from execute.experts import random_layer
layer = random_layer(np.random.default_rng(0), 0, 4, 64, 32, Q.Q8_0)
with CpuExpertPool(1, 2.0) as pool:  # 2 s: far below a cold compile
    pool.warmup(layer)
print("ok")
"""


@pytest.mark.slow
def test_a_cold_numba_cache_does_not_time_out_the_first_call(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
