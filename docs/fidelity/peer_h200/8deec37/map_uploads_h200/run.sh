#!/bin/bash
# fidelity: do uploads out of a registered file map cost more than out of pinned buffers on the
# H200? (the peer rows at 2 GiB, 182 uploads a decode token, come out 17-31% fast from every
# calibration; docs/FIDELITY.md). execute.calibrate_memory.measure_map_uploads, not yet run on a
# GPU: n uploads back to back (one copy round, waited for) out of random Q8_0 experts of the
# qwen3-30b-a3b shape (5.0 MB each) in anonymous buffers registered in place ("anon"), in a
# read-only map of the same bytes written to a file and registered in place as moelab run does
# ("mapped"), and through the staging ring ("staged"). At most ~80 s. Writes $OUT/fidelity/.
set -u
T0=$(date +%s)
D="$OUT/fidelity"
mkdir -p "$D"
{ git rev-parse HEAD 2>/dev/null; uptime; nproc; nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1; } > "$D/host.txt" 2>&1
probe() {  # layers experts n rounds tag
  timeout $(( 80 - ($(date +%s) - T0) )) python3 - "$@" > "$D/map_uploads_$5.json" 2> "$D/map_uploads_$5.log" <<'PY'
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
from execute.experts import random_layer
from execute.calibrate_memory import measure_map_uploads
L, E, n, rounds = (int(x) for x in sys.argv[1:5])
t0 = time.perf_counter()
rng = np.random.default_rng(0)
layers = [random_layer(rng, l, E, 2048, 768, 8, exact=False) for l in range(L)]  # Q8_0, 5.0 MB an expert
print(f"built {L} x {E} experts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
with tempfile.TemporaryDirectory(dir=".") as d:
    out = measure_map_uploads(layers, Path(d) / "experts.bin", n=n, rounds=rounds)
out["args"] = {"layers": L, "experts": E, "n": n, "rounds": rounds}
print(json.dumps(out, indent=1, default=float))
print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
PY
  rc=$?
  echo "$(( $(date +%s) - T0 )) s: probe $* rc=$rc" >> "$D/steps.txt"
}
probe 4 64 32 5 a          # 1.3 GB of experts, 32 uploads a round (a 2 GiB lru layer step moves ~4)
probe 8 48 128 3 b         # 1.9 GB, 128 uploads back to back (most of a 2 GiB lru decode token's 182)
