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

NMSE per expert quant type, measured with llama-cpp-python 0.3.36 on 2 CPU cores, seed 0 (every
architecture, dense weights F16 unless said; ``check`` writes the table):

- F32 experts: 1e-14 to 1e-13 (1.2e-14 granitemoe .. 5.8e-14 gpt-oss; deepseek2 9.6e-14 with
  ``--dense-quant F32``). Both sides compute in float32 from the same weights; what is left is
  summation order. deepseek2 with F16 dense weights: 4.7e-8, llama.cpp rounding activations to
  F16 somewhere in its MLA path (the other architectures show none from F16 dense weights), so
  F32 rows are held to 1e-10 only with ``--dense-quant F32``: a row's bound is the looser of its
  expert type's and its dense type's (``LIMITS``).
- F16 experts: 1.8e-11 .. 1.0e-7; BF16: 9.3e-10 .. 3.1e-6. llama.cpp's CPU matmul rounds the
  activations to the weights' type before the dot products (``vec_dot_type``); moelab multiplies
  by float32 activations.
- Q8_0, Q4_0, Q4_K, Q6_K, MXFP4 experts: 2.1e-8 (granitemoe) .. 2.6e-4. llama.cpp quantizes the
  activations to 8 bits per block (Q8_0 / Q8_K) before its integer dot products; moelab
  dequantizes the weights and keeps float32 activations. Top-1 agreement 11 or 12 of 12
  positions; a flip only where llama.cpp's two best logits are within 4x that position's RMS
  difference (``top1_unexplained`` counts the others and fails the row).
- ``--dense-quant Q8_0`` (run without extra buffer types, below): 8.5e-6 (granitemoe) .. 3.6e-4 for
  every expert type and both MLA layouts, held to the Q8_0 bound; llama.cpp quantizes the
  activations of every dense matmul to 8 bits, which also moves routing margins by up to about
  1e-2 (seed 0's qwen3moe: margins of 1.2e-3 .. 1.8e-3 gave 0.02 .. 0.1 at their positions), so
  ties are taken within ``NEAR_TIE_Q8``.

A token whose routing is a near tie in moelab's float64 reference (relative margin < ``NEAR_TIE``
between the k-th and next expert, or between the last expert group kept and the next) may get
other experts in llama.cpp, which rounds: such positions are left out of the NMSE and listed
(seed 0's deepseek2 model: token 5, group margin 1e-4, NMSE 0.5 at that position). Both MLA
layouts give the same figures (``--mla split kv_b``).

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
evaluates a file with a quantized dense matmul weight (:func:`amx_weights`) without extra buffer
types (``--extra-bufts auto``; ``on`` forces them, to reproduce the crash; the row's
``extra_bufts`` says which was used).

Commands (the build takes tens of minutes on two cores; run it once)::

    python experiments/llamacpp_check.py build --jobs 1
    python experiments/llamacpp_check.py check --out experiments/out/llamacpp_check
    python experiments/llamacpp_check.py check --dense-quant Q8_0 --out experiments/out/llamacpp_check_q8

``check`` prints a table and writes ``OUT/result.json`` (config, one row per file) and
``OUT/config.json``. Exit status: 0 every row within its bound (``LIMITS``), 1 a row failed, 2 bad
input or no build.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")
LIMITS = {"F32": 1e-10, "F16": 1e-5, "BF16": 1e-4, "Q8_0": 1e-3, "Q4_0": 1e-3, "Q4_K": 1e-3, "Q6_K": 1e-3,
          "MXFP4": 1e-3}  # NMSE bound per expert quant type; the module docstring has the measured figures
DENSE_QUANTS = ("F32", "F16", "BF16", "Q8_0")  # synth's --dense-quant choices
AMX_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # llama.cpp's AMX buffer takes these
TOKENS = (5, 300, 17, 17, 42, 256, 1, 9, 100, 77, 3, 250)
NEAR_TIE = 1e-3  # relative routing margin within which llama.cpp's rounding may pick other experts
NEAR_TIE_Q8 = 1e-2  # the same with Q8_0 dense weights (llama.cpp rounds the attention's activations to 8 bits)

_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp.llama_cpp as C
from llama_cpp import Llama
model, tokens, out, extra = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
defaults = C.llama_model_default_params
def params():
    p = defaults()
    p.use_extra_bufts = extra
    return p
C.llama_model_default_params = params  # Llama() takes no use_extra_bufts of its own
llm = Llama(model_path=model, n_ctx=64, n_batch=64, logits_all=True, n_threads=1, n_gpu_layers=0,
            type_k=0, type_v=0, flash_attn=False, verbose=False)
llm.eval(tokens)
np.save(out, np.asarray(llm.scores[:len(tokens)], dtype=np.float32))
"""


def site(cache: Path, version: str) -> Path:
    return cache / f"llama-cpp-python-{version}"


def built(cache: Path, version: str) -> bool:
    """True when the cache holds an importable llama_cpp of ``version``."""
    target = site(cache, version)
    if not (target / "llama_cpp").is_dir():
        return False
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == version


def build(cache: Path, version: str, jobs: int, src: str | None) -> int:
    """pip-install llama-cpp-python ``version`` for the CPU into the cache (skipped when there)."""
    if built(cache, version):
        print(f"llama-cpp-python {version}: already in {site(cache, version)}")
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs), "FORCE_CMAKE": "1",
           "CMAKE_ARGS": "-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF "
                         "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF"}
    cmd = [sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python", "--target",
           str(site(cache, version)), src or f"llama-cpp-python=={version}"]
    print("building:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, env=env).returncode
    if rc or not built(cache, version):
        print(f"build of llama-cpp-python {version} failed (pip exit {rc})", file=sys.stderr)
        return 2
    return 0


def cases(archs, quants, layouts=("split",)) -> list[tuple[str, str, str]]:
    """(arch, expert quant, MLA layout) of every file to check."""
    from execute.archs import ARCHS

    out = []
    for arch in archs:
        for q in quants:
            for mla in (tuple(layouts) if ARCHS[arch].attn == "mla" else ("",)):
                out.append((arch, q, mla))
    return out


def synth_case(folder: Path, arch: str, quant: str, mla: str, dense_quant: str, seed: int) -> Path:
    from execute.synth import config_from_preset, synth_model

    wide = quant in ("Q4_K", "Q6_K")
    cfg = config_from_preset("tiny", arch=arch, quant=quant, dense_quant=dense_quant, seed=seed, mla=mla or None,
                             hidden=256 if wide else None, ffn=256 if wide else None)
    return synth_model(folder / f"{arch}_{quant}{'_' + mla if mla else ''}.gguf", cfg)


def moelab_logits(path: Path, tokens) -> np.ndarray:
    """Logits ``(len(tokens), vocab)`` of moelab's executor (cpu policy, numpy experts)."""
    from execute import model as M
    from execute.gguf_model import load_model
    from scheduler import Capacity, make_policy

    w = load_model(path)
    g = w.info.geometry()
    policy = make_policy("cpu", g, Capacity.per_layer(g, 0))
    inputs = [M.TokenInput(i, 0, i, "decode", int(t), None) for i, t in enumerate(tokens)]
    res = M.run(M.MoeModel(w, max_tokens=len(tokens) + 1), M.NumpyExperts(w), policy, inputs, keep_logits=True)
    return np.stack(res.logits).astype(np.float64)


def routing_gaps(path: Path, tokens) -> np.ndarray:
    """Per position, the smallest routing margin over the MoE blocks in moelab's float64 reference:
    the gap between the k-th and (k+1)-th expert's selection score and, with expert groups,
    between the last group kept and the first dropped. A gap within rounding (``NEAR_TIE``) lets
    llama.cpp, which rounds activations, pick other experts for that token."""
    from execute import reference as R
    from execute.gguf_model import load_model

    gaps, select = [], R._select

    def spy(info, logits, lw, forced):
        g = info.gating
        probs = 1.0 / (1.0 + np.exp(-logits)) if g == "sigmoid" else (
            np.exp(logits - logits.max()) if g == "softmax" else logits.copy())
        score = probs + (np.asarray(lw.exp_probs_b, np.float64) if lw.exp_probs_b is not None else 0.0)
        ranked = np.sort(score)[::-1]
        gap = ranked[info.top_k - 1] - ranked[info.top_k] if len(score) > info.top_k else np.inf
        if info.expert_groups > 1:
            per = len(score) // info.expert_groups
            gs = np.sort([np.sort(score[i * per:(i + 1) * per])[-2:].sum() for i in range(info.expert_groups)])[::-1]
            gap = min(gap, gs[info.expert_groups_used - 1] - gs[info.expert_groups_used])
        gaps.append(gap / max(abs(ranked[0]), 1e-30))
        return select(info, logits, lw, forced)

    w = load_model(path)
    R._select = spy
    try:
        R.reference_forward(w, list(tokens))
    finally:
        R._select = select
    moe = len(w.info.moe_layers)
    return np.asarray(gaps).reshape(moe, len(tokens)).min(axis=0) if moe else np.full(len(tokens), np.inf)


def amx_weights(path: Path) -> list[str]:
    """Dense matmul weights of the file in a type llama.cpp's AMX buffer repacks (``AMX_TYPES``):
    2-D ``.weight`` tensors other than ``token_embd`` (read by row lookup) and the experts (3-D)."""
    from execute.gguf_io import read_model_info

    return [t.name for t in read_model_info(path).tensors if len(t.shape) == 2 and t.name.endswith(".weight")
            and t.name != "token_embd.weight" and t.qtype_name in AMX_TYPES]


def llamacpp_logits(target: Path, path: Path, tokens, extra_bufts: bool = True) -> tuple[np.ndarray | None, str]:
    """llama.cpp's logits (``extra_bufts``: its repacking buffer types, AMX among them, allowed),
    or None and the tail of its error output (and the signal that killed it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.npy"
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(list(tokens)), str(out),
                               "1" if extra_bufts else "0"],
                              env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            tail = (proc.stderr or proc.stdout)[-400:].strip()
            if proc.returncode < 0:
                tail = (tail + "\n" if tail else "") + f"killed by {signal.Signals(-proc.returncode).name}"
            return None, tail
        return np.load(out).astype(np.float64), ""


def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    """NMSE over all positions, worst position's NMSE, top-1 agreement, and the positions whose
    top-1 differs although llama.cpp's margin between the two tokens is more than 4x that
    position's RMS difference (a flip that rounding does not explain)."""
    per = ((ours - ref) ** 2).sum(axis=1) / (ref ** 2).sum(axis=1)
    a, b = ours.argmax(axis=1), ref.argmax(axis=1)
    rows = np.arange(len(ref))
    margin = ref[rows, b] - ref[rows, a]
    rms = np.sqrt(((ours - ref) ** 2).mean(axis=1))
    return {"nmse": float(((ours - ref) ** 2).sum() / (ref ** 2).sum()), "nmse_max_position": float(per.max()),
            "top1": float(np.mean(a == b)), "top1_unexplained": int(np.sum((a != b) & (margin > 4 * rms)))}


def check(a) -> int:
    from execute.gguf_io import llamacpp_problems

    target = site(Path(a.cache), a.version)
    if not built(Path(a.cache), a.version):
        print(f"llama-cpp-python {a.version} is not built in {a.cache}: run the build stage first", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(a).items() if k != "func"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rows, failed = [], 0
    print(f"{'file':34s} {'NMSE':>10s} {'worst pos':>10s} {'top-1':>6s}  bound")
    for arch, quant, mla in cases(a.archs, a.quants, a.mla):
        path = synth_case(out, arch, quant, mla, a.dense_quant, a.seed)
        extra = a.extra_bufts == "on" or (a.extra_bufts == "auto" and not amx_weights(path))
        row = {"arch": arch, "quant": quant, "mla": mla, "file": path.name, "problems": llamacpp_problems(path),
               "extra_bufts": extra}
        ref, err = llamacpp_logits(target, path, TOKENS[:a.tokens], extra)
        if ref is None:
            row.update(ok=False, error=err)
        else:
            toks = TOKENS[:a.tokens]
            ties = routing_gaps(path, toks) < (NEAR_TIE_Q8 if a.dense_quant == "Q8_0" else NEAR_TIE)
            row["near_ties"] = [int(i) for i in np.flatnonzero(ties)]
            ours = moelab_logits(path, toks)
            row.update(compare(ours[~ties], ref[~ties]) if (~ties).any() else {"nmse": 0.0, "nmse_max_position": 0.0,
                                                                             "top1": 1.0, "top1_unexplained": 0})
            bound = max(LIMITS[quant], LIMITS[a.dense_quant])
            row["ok"] = row["nmse"] <= bound and row["top1_unexplained"] == 0
        failed += not row["ok"]
        rows.append(row)
        if "nmse" in row:
            ties = f"  (near routing ties left out: positions {row['near_ties']})" if row["near_ties"] else ""
            print(f"{path.name:34s} {row['nmse']:10.2e} {row['nmse_max_position']:10.2e} {row['top1']:6.2f}  "
                  f"{bound:.0e} {'ok' if row['ok'] else 'FAILED'}{ties}", flush=True)
        else:
            print(f"{path.name:34s} llama.cpp failed: {row['error'].splitlines()[-1] if row['error'] else '?'}", flush=True)
    (out / "result.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"{len(rows) - failed}/{len(rows)} within bounds; {out / 'result.json'}")
    return 1 if failed else 0


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
    p.add_argument("--quants", nargs="+", default=list(QUANTS), help="expert quant types (default all)")
    p.add_argument("--dense-quant", default="F16", help=f"dense weights' type: {', '.join(DENSE_QUANTS)} (default F16)")
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
    bad = [x for x in a.archs if x not in ARCHS] + [q for q in a.quants if q.upper() not in QUANTS]
    if bad:
        p.error(f"unknown architecture or quant type: {', '.join(bad)}")
    a.quants = [q.upper() for q in a.quants]
    if a.dense_quant.upper() not in DENSE_QUANTS:
        p.error(f"--dense-quant: {a.dense_quant}, expected one of {', '.join(DENSE_QUANTS)}")
    a.dense_quant = a.dense_quant.upper()
    if not 1 <= a.tokens <= len(TOKENS):
        p.error(f"--tokens: {a.tokens}, expected 1..{len(TOKENS)}")
    if a.jobs < 1:
        p.error(f"--jobs: {a.jobs}, expected >= 1")
    if a.src and not Path(a.src).is_file():
        p.error(f"--src: {a.src} is not a file")
    return a


def main(argv=None) -> int:
    a = _args(argv)
    if a.stage in ("build", "all"):
        rc = build(Path(a.cache), a.version, a.jobs, a.src)
        if rc or a.stage == "build":
            return rc
    return check(a)


if __name__ == "__main__":
    sys.exit(main())
