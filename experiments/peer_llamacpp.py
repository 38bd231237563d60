"""moelab's executor against llama.cpp: the same GGUF, the same GPU, measured side by side in one run.

llama.cpp's ``llama-bench -o json -ngl 99 -fa on -p 256 -n 64 -r 2 -t 16`` runs with ``-ncmoe N``
(the routed experts of the first N blocks kept on the CPU) at N = 0 (every expert in VRAM), at the
smallest N whose remaining expert bytes fit ``--budget-mib`` (from the GGUF's per-block expert
bytes), and at N = all blocks (every expert on the CPU, as ``--cpu-moe``). ``moelab run MODEL -p
PROMPT -n 64 --raw --threads 15 --json`` runs with ``--policy gpu``, ``lru``, ``hybrid`` and
``hybrid-cost`` (``--cache-mib`` = the budget; hybrid-cost with docs/fidelity/h200-calibrated.json)
and ``cpu``; ``--graph-cpu POLICIES`` adds rows ``POLICY+cpugraph``: the same runs with ``moelab run
--graph-cpu`` (a decode token's misses on the CPU pool inside its graph). The prompt is fixed text cut to at most ``--prompt-tokens`` tokens by moelab's
tokenizer on the GGUF's vocabulary (``--raw``: no chat template); llama-bench's pp256 feeds 256
random token ids. result.json records moelab's count (256 on the 32000-token synthetic vocabulary).

Each round runs every configuration once, llama.cpp's then moelab's, the order reversed on odd
rounds; one unrecorded ``-n 4`` moelab run precedes the first moelab run of each invocation
(llama-bench warms up by itself). Figures are medians over rounds of llama-bench's mean tokens/s
(over its ``-r`` repetitions) and of moelab's prompt and decode tokens/s. The comparisons, as
moelab / llama.cpp: ``gpu`` vs ``-ncmoe 0``; each budget policy, and the best of them, vs
llama.cpp's best configuration with no more expert bytes in VRAM (the max over the measured
``-ncmoe N`` with N >= the budget's N); ``cpu`` vs ``-ncmoe`` all blocks.

Stages, each within one 10-minute command on a GPU machine without network:

    python experiments/peer_llamacpp.py pack --out .peer/lcpp.tgz    # with network, once
    python experiments/peer_llamacpp.py prepare --src .peer/lcpp.tgz --work .peer
    python experiments/peer_llamacpp.py bench --work .peer --budget-mib 4096 --rounds 2 \
        --out .peer/result --deadline-s 450                          # again until it exits 0 or 1

``pack`` keeps of llama.cpp's source (vendored in the llama-cpp-python sdist) what a CUDA + CPU
build of llama-bench and llama-completion needs, LICENSE included; the sdist's name and version
are in the sidecar ``lcpp.tgz.json`` and in the tarball (``llama.cpp/PEER_SOURCE.json``).
``prepare`` builds llama.cpp and writes the synthetic Qwen3-30B-A3B-shaped Q8_0 GGUF (``moelab
model synth --preset qwen3-30b-a3b --vocab 32000 --quant Q8_0 --seed 0``) in parallel, printing
each one's progress; each is skipped when its output is there and matches (a build stamp with the
tarball's sha256; a sidecar with the synth command), so an interrupted prepare is run again as is.
``bench`` appends every run to ``OUT/raw.jsonl`` as it ends; with ``--deadline-s`` it starts no
run expected to end later (each configuration's last time), and the same command continues (a
failed run stays recorded; delete its line to run it again).
Exit status: 0 complete, 1 a configuration failed (recorded, the others still run), 2 bad input,
3 runs missing. ``all`` = prepare, then bench, for machines without a time limit.

Writes OUT/config.json, raw.jsonl, logs/, result.json (config, raw rows, medians, comparisons),
result.png and a generated README.md (config, tables, command).

The work is done by moelab.peer_build (pack, prepare), moelab.peer_runs (configurations, runs,
parsing), moelab.peer_report (medians, comparisons, tables, plot, README) and moelab.peer (bench).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an installed moelab
    sys.path.insert(0, str(ROOT))

from moelab.peer import bench  # noqa: E402
from moelab.peer_build import SDIST, SDIST_VERSION, Fail, pack, prepare  # noqa: E402
from moelab.peer_runs import HARDWARE, POLICIES  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    pk = sub.add_parser("pack", help="slim llama.cpp source tarball from the llama-cpp-python sdist")
    pk.add_argument("--out", default=".peer/lcpp.tgz")
    pk.add_argument("--sdist", help=f"the {SDIST} sdist (.tar.gz); default: pip download {SDIST}=={SDIST_VERSION}")
    for name in ("prepare", "bench", "all"):
        s = sub.add_parser(name)
        s.add_argument("--work", default=".peer")
        s.add_argument("--moelab", help="moelab command (default: moelab beside this Python)")
        if name in ("prepare", "all"):
            s.add_argument("--src", default=".peer/lcpp.tgz")
            s.add_argument("--jobs", type=int, default=max(len(os.sched_getaffinity(0)) - 1, 1),
                           help="build jobs (default: the cores this process may use, less one for synth)")
            s.add_argument("--cpu-only", action="store_true", help="build llama.cpp without CUDA")
            s.add_argument("--cuda-arch", default="90")
            s.add_argument("--preset", default="qwen3-30b-a3b", help="moelab model synth preset (tiny: a smoke test)")
            s.add_argument("--model-name", default="q8.gguf")
            s.add_argument("--progress-s", type=float, default=20.0)
        if name in ("bench", "all"):
            s.add_argument("--model", help="GGUF (default: WORK/q8.gguf)")
            s.add_argument("--llama-bench", help="default: WORK/build/bin/llama-bench")
            s.add_argument("--budget-mib", type=int, default=4096)
            s.add_argument("--rounds", type=int, default=2)
            s.add_argument("--repetitions", type=int, default=2, help="llama-bench -r")
            s.add_argument("--prompt-tokens", type=int, default=256)
            s.add_argument("--tokens", type=int, default=64)
            s.add_argument("--threads", type=int, default=15, help="moelab run --threads")
            s.add_argument("--llama-threads", type=int, default=16, help="llama-bench -t")
            s.add_argument("--policies", default=",".join(POLICIES))
            s.add_argument("--graph-cpu", default="", metavar="POLICIES",
                           help="also run these policies with moelab run --graph-cpu, as rows POLICY+cpugraph "
                                "(comma list; default none)")
            s.add_argument("--hardware", default=str(HARDWARE))
            s.add_argument("--timeout-s", type=float, default=300.0, help="per llama-bench / moelab run")
            s.add_argument("--deadline-s", type=float, default=0.0,
                           help="start no run that would end later than this after the start (0: none)")
            s.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="no unrecorded moelab run before the first measured one")
            s.add_argument("--out", default=".peer/result")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        if args.stage == "pack":
            return pack(args)
        if args.stage == "prepare":
            return prepare(args)
        if args.stage == "bench":
            return bench(args)
        if args.stage == "all" and args.model is None:
            args.model = str(Path(args.work) / args.model_name)
        return prepare(args) or bench(args)
    except Fail as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a time limit: clean up, then exit
    sys.exit(main())
