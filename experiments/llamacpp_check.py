"""moelab's logits against llama.cpp's on synthetic GGUFs of every architecture, on the CPU.

Method: ``build`` installs llama-cpp-python (``--version``, default 0.3.36, built from its sdist
for the CPU without its multimodal library, ``CMAKE_BUILD_PARALLEL_LEVEL=--jobs``) into a cache
folder (``--cache``, default ``~/.cache/moelab/llamacpp``); nothing is built when the cache already
holds that version.
``check`` writes one ``moelab model synth`` file per architecture and expert quant type (2 blocks,
8 experts top-2, seed ``--seed``; hidden and ffn 64, or 256 for the K-quants, whose blocks are 256
long; deepseek2 in the ``--mla`` layouts), evaluates ``--tokens`` fixed token ids with llama.cpp in a
child process (``logits_all``, F32 KV cache, no flash attention, 1 thread) and with moelab's
executor (``execute.model``, ``cpu`` policy, numpy experts), and compares the logits of every
position: NMSE = sum (moelab - llama.cpp)^2 / sum llama.cpp^2, top-1 agreement, and what
``gguf_io.llamacpp_problems`` says of the file. A file llama.cpp refuses to load is a failed row.

NMSE per expert quant type, measured with llama-cpp-python 0.3.36 built here (2-core AMD EPYC VM,
AVX2), seed 0, at the positions left after routing ties (below); ``docs/perf/llamacpp_check_cpu``
holds the tables:

- F32 experts and ``--dense-quant F32``: 1.1e-14 (granitemoe) .. 9.4e-14 (deepseek2). Both sides
  compute in float32 from the same weights; what is left is summation order. With F16 dense weights
  (the default) every architecture shows 3.9e-8 .. 2.4e-7: llama.cpp's CPU matmul rounds the
  activations to the weights' type before the dot products (``vec_dot_type``), moelab multiplies
  by float32 activations. A row's bound is therefore the looser of its expert type's and its dense
  type's (``execute.llamacpp_check.LIMITS``).
- F16 experts: 3.9e-8 .. 2.4e-7; BF16: 4.0e-8 .. 2.9e-6 (F16 dense weights).
- Q8_0, Q4_0, Q4_K, Q6_K, MXFP4 experts: 5.1e-8 (granitemoe) .. 2.5e-4 (gpt-oss Q4_K). llama.cpp
  quantizes the activations to 8 bits per block (Q8_0 / Q8_K) before its integer dot products;
  moelab dequantizes the weights and keeps float32 activations. Top-1 agreement 0.90 .. 1.00; a
  flip only where llama.cpp's two best logits are within 4x that position's RMS difference
  (``top1_unexplained`` counts the others and fails the row).
- ``--dense-quant Q8_0`` (run without extra buffer types, below): 8.5e-6 (granitemoe) .. 3.6e-4 for
  every expert type and both MLA layouts, held to the Q8_0 bound; llama.cpp quantizes the
  activations of every dense matmul to 8 bits, which also moves routing margins: the Q8_0 dense
  format enters every row's tie rule.

Routing ties. A token whose routing margin is within llama.cpp's rounding may get other experts
there, which changes its logits far beyond any bound, so such positions are left out of the NMSE
and top-1 and counted (column ``ties``, ``near_ties`` in the result). The margin is measured in
moelab's float64 reference against the router scores' expected noise when the router input is
rounded to llama.cpp's activation formats for the file's types (8 bits per 32 or 256 values, F16,
BF16; ``execute.llamacpp_check.routing_ties``), and a position is a tie when some selected and
unselected expert (or kept and dropped expert group) are within ``TIE_Z`` = 4 of those noises in
any block. The table states the formats of each row. Checked against a float64 reference that
rounds the experts' activations the way llama.cpp does: on seed 0 it moves the experts of llama
BF16 (Q8_0 dense weights, position 11) and gpt-oss MXFP4 (position 2) and nothing else, both
within the rule (ratios 0.01 and 1.6). Seed 0 with F16 dense weights leaves out 0 to 3 of the 12
positions per file (none for F32 and F16 experts but deepseek2's position 0, group margin 1e-4).
llama Q4_K's position 11 has a margin of 3e-3 of the top score (0.34 noises): llama.cpp gives it
other experts (NMSE 0.12 at that position; 1.0e-2 and top-1 11 of 12 over all positions, the row
an older rule, a relative margin below 1e-3, failed; 1.3e-4 without it). Left out in all: 64 of
672 positions by default, 82 of 768 with ``--dense-quant Q8_0 --mla split kv_b``, none with F32
weights throughout. The rule is conservative: of the ties, llama.cpp routes 1 of 64 (default) and
5 of 76 (Q8_0 dense, split layout) otherwise (position NMSE > 1e-2), all at ratios below 0.75;
no position outside the rule is routed otherwise.

Known limit, llama.cpp's (not the file's): a llama-cpp-python built with GCC 12 and
``GGML_NATIVE`` on an AMX CPU dies (SIGSEGV, no message) on the first matmul of two or more tokens
by a quantized dense weight, on every architecture (Q8_0 measured; by the source every type of
``AMX_TYPES`` takes the same path). Such weights go to llama.cpp's AMX buffer type (expert tensors
and ``token_embd`` do not: their ops are MUL_MAT_ID and GET_ROWS), and its kernel for M > 1 loads
its tile configuration with ``_tile_loadconfig`` from a local struct; GCC 12's
``amxtileintrin.h`` declares that asm's memory operand as 8 bytes, so the compiler drops the
stores of the rows and column widths and ``ldtilecfg`` reads stack garbage: a general-protection
fault (``si_code`` SI_KERNEL) at ``ldtilecfg`` in ``ggml_backend_amx_mul_mat`` (its disassembly
stores only the palette byte). A Q8_0 file written by llama.cpp's own ``llama_model_quantize``
from the F16 file dies the same way; one token at a time (the M = 1 path, no tiles) runs.
llama.cpp has no environment switch for it; its model parameter ``use_extra_bufts = false``
(``--no-repack`` of its own tools) keeps the weights in plain CPU buffers. ``check`` therefore
evaluates a file with a quantized dense matmul weight (``amx_weights``) without extra buffer
types (``--extra-bufts auto``; ``on`` forces them, to reproduce the crash; the row's
``extra_bufts`` says which was used).

Commands (the build takes tens of minutes on two cores; run it once)::

    python experiments/llamacpp_check.py build --jobs 1
    python experiments/llamacpp_check.py check --out experiments/out/llamacpp_check
    python experiments/llamacpp_check.py check --dense-quant Q8_0 --out experiments/out/llamacpp_check_q8

The logic is ``execute.llamacpp_check``; this script reads the arguments. ``check`` prints a table
and writes ``OUT/result.json`` (config, one row per file) and ``OUT/config.json``. Exit status: 0
every row within its bound (``LIMITS``), 1 a row failed, 2 bad input or no build.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from execute import llamacpp_check as lc  # noqa: E402

TOKENS = lc.TOKENS


def _args(argv):
    from execute.archs import ARCHS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("build", "check", "all"))
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "moelab" / "llamacpp"),
                   help="folder of the llama-cpp-python build (default ~/.cache/moelab/llamacpp)")
    p.add_argument("--version", default="0.3.36", help="llama-cpp-python version (default 0.3.36)")
    p.add_argument("--src", help="a local llama-cpp-python sdist to build instead of the registry's")
    p.add_argument("--jobs", type=int, default=1, help="parallel compile jobs of the build (default 1)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), help="architectures (default all)")
    p.add_argument("--quants", nargs="+", default=list(lc.QUANTS), help="expert quant types (default all)")
    p.add_argument("--dense-quant", default="F16",
                   help=f"dense weights' type: {', '.join(lc.DENSE_QUANTS)} (default F16)")
    p.add_argument("--extra-bufts", default="auto", choices=("auto", "on", "off"),
                   help="llama.cpp's repacking buffer types (AMX among them): auto (default) turns them off for "
                        "files with quantized dense matmul weights, on/off for every file")
    p.add_argument("--mla", nargs="+", default=["split"], choices=("split", "kv_b"),
                   help="deepseek2's MLA layouts (default split: attn_k_b/attn_v_b)")
    p.add_argument("--tokens", type=int, default=len(TOKENS), help=f"positions evaluated (1..{len(TOKENS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/out/llamacpp_check",
                   help="output folder (default experiments/out/llamacpp_check)")
    a = p.parse_args(argv)
    bad = [x for x in a.archs if x not in ARCHS] + [q for q in a.quants if q.upper() not in lc.QUANTS]
    if bad:
        p.error(f"unknown architecture or quant type: {', '.join(bad)}")
    a.quants = [q.upper() for q in a.quants]
    if a.dense_quant.upper() not in lc.DENSE_QUANTS:
        p.error(f"--dense-quant: {a.dense_quant}, expected one of {', '.join(lc.DENSE_QUANTS)}")
    a.dense_quant = a.dense_quant.upper()
    if not 1 <= a.tokens <= len(TOKENS):
        p.error(f"--tokens: {a.tokens}, expected 1..{len(TOKENS)}")
    if a.jobs < 1:
        p.error(f"--jobs: {a.jobs}, expected >= 1")
    if a.src and not Path(a.src).is_file():
        p.error(f"--src: {a.src} is not a file")
    return a


def main(argv=None, llamacpp=lc.llamacpp_logits) -> int:
    """``llamacpp``: llama.cpp's logits function (a stand-in in tests)."""
    a = _args(argv)
    cache = Path(a.cache)
    if a.stage in ("build", "all"):
        rc = lc.build(cache, a.version, a.jobs, a.src)
        if rc or a.stage == "build":
            return rc
    if llamacpp is lc.llamacpp_logits and not lc.built(cache, a.version):
        print(f"llama-cpp-python {a.version} is not built in {a.cache}: run the build stage first", file=sys.stderr)
        return 2
    config = dict(vars(a))
    return lc.check(lc.site(cache, a.version), Path(a.out), config, llamacpp)


if __name__ == "__main__":
    sys.exit(main())
