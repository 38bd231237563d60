"""moelab's executor against llama.cpp (through llama-cpp-python, in a child process) on synthetic files.

The pieces of ``experiments/llamacpp_check.py``: building llama-cpp-python into a cache folder, the
files checked (:func:`cases`, :func:`synth_case`), both sides' logits, the comparison, and the
routing ties left out of it.

Routing ties. llama.cpp rounds the activations of every matmul to its weights' ``vec_dot_type``
(8-bit blocks of 32 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/MXFP4, of 256 for the K- and i-quants, F16
for F16, BF16 for BF16); moelab keeps float32 activations. Both sides' router scores therefore
differ by about the rounding of the router's input, and a token whose routing margin is within that
may get other experts in llama.cpp, which changes its logits by far more than any bound. Such
positions are left out of the comparison and counted. :func:`routing_ties` measures, in moelab's
float64 reference, for every MoE block and position: the router input ``h``, the expected rounding
noise of each router logit when ``h`` is rounded to the file's activation formats (``sigma_i^2 =
sum_j W_ij^2 step_j^2 / 12`` per format, summed over the expert type's and the dense type's
formats; ``step_j`` is the block's ``amax / 127`` for 8-bit formats, ``h_j``'s unit in the last
place for F16/BF16/F32), carried to the selection scores through their derivative (logits for
softmax ranking, ``sigmoid'`` for sigmoid gating), and the margin between every selected and
unselected expert (and, with expert groups, kept and dropped group) in units of the pair's combined
noise. A position is a tie when that ratio is below ``TIE_Z`` in any block.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")
LIMITS = {"F32": 1e-10, "F16": 1e-5, "BF16": 1e-4, "Q8_0": 1e-3, "Q4_0": 1e-3, "Q4_K": 1e-3, "Q6_K": 1e-3,
          "MXFP4": 1e-3}  # NMSE bound per expert quant type (the script's docstring has the measured figures)
DENSE_QUANTS = ("F32", "F16", "BF16", "Q8_0")  # synth's dense_quant choices
AMX_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # llama.cpp's AMX buffer takes these
TOKENS = (5, 300, 17, 17, 42, 256, 1, 9, 100, 77, 3, 250)
TIE_Z = 4.0  # a routing margin below TIE_Z x its expected rounding noise is a tie
# llama.cpp's vec_dot_type per weight type: the format its CPU matmul rounds the activations to
_Q8_32 = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")


def act_format(qtype: str) -> str:
    """The format llama.cpp's CPU matmul rounds activations to for weights of ``qtype``:
    F32, F16, BF16, Q8_32 (8 bits per 32 values) or Q8_256 (8 bits per 256: K- and i-quants)."""
    q = qtype.upper()
    if q in ("F32", "F16", "BF16"):
        return q
    return "Q8_32" if q in _Q8_32 else "Q8_256"


def rounding_step(h: np.ndarray, fmt: str) -> np.ndarray:
    """Step of the rounding grid at each value of ``h`` (..., n) in activation format ``fmt``."""
    h = np.asarray(h, np.float64)
    if fmt.startswith("Q8_"):
        block = int(fmt[3:])
        if h.shape[-1] % block:
            raise ValueError(f"rounding_step: {h.shape[-1]} values do not split into blocks of {block}")
        amax = np.abs(h.reshape(*h.shape[:-1], -1, block)).max(axis=-1, keepdims=True)
        return np.broadcast_to(amax / 127.0, h.shape[:-1] + (h.shape[-1] // block, block)).reshape(h.shape)
    mant = {"F32": 23, "F16": 10, "BF16": 7}[fmt]
    e = np.floor(np.log2(np.maximum(np.abs(h), 1e-300)))
    return np.exp2(e - mant) * (h != 0)


def logit_noise(h: np.ndarray, router: np.ndarray, formats) -> np.ndarray:
    """Expected RMS change ``(T, experts)`` of the router logits ``h @ router.T`` when ``h`` (T, n)
    is rounded to each of ``formats`` (independent, uniform rounding errors; summed in quadrature)."""
    w2 = np.asarray(router, np.float64) ** 2  # (experts, n)
    var = sum((rounding_step(h, f) ** 2 / 12.0) @ w2.T for f in formats)
    return np.sqrt(var)


def tie_ratio(score: np.ndarray, noise: np.ndarray, top_k: int, groups: int = 1, groups_used: int = 1) -> float:
    """Smallest margin between a selected and an unselected expert's score (and a kept and a
    dropped group's) in units of the pair's combined noise; inf when nothing is left out."""
    n = len(score)
    ratio = np.inf
    allowed = np.ones(n, bool)
    if groups > 1:
        per = n // groups
        order = np.argsort(-score.reshape(groups, per), axis=1, kind="stable")[:, :2]
        gsc = np.take_along_axis(score.reshape(groups, per), order, 1).sum(1)
        gno = np.sqrt((np.take_along_axis(noise.reshape(groups, per), order, 1) ** 2).sum(1))
        gk = np.argsort(-gsc, kind="stable")
        kept, dropped = gk[:groups_used], gk[groups_used:]
        if len(dropped):
            d = gsc[kept][:, None] - gsc[dropped][None, :]
            ratio = min(ratio, float((d / np.hypot(gno[kept][:, None], gno[dropped][None, :]).clip(1e-300)).min()))
        allowed = np.isin(np.arange(n) // per, kept)
    idx = np.flatnonzero(allowed)
    ranked = idx[np.argsort(-score[idx], kind="stable")]
    sel, rest = ranked[:top_k], ranked[top_k:]
    if len(rest):
        d = score[sel][:, None] - score[rest][None, :]
        ratio = min(ratio, float((d / np.hypot(noise[sel][:, None], noise[rest][None, :]).clip(1e-300)).min()))
    return ratio


def _scores(info, lw, logits: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Selection scores of one token and their noise, from the router logits and theirs."""
    bias = np.asarray(lw.exp_probs_b, np.float64) if lw.exp_probs_b is not None else None
    if info.gating == "sigmoid":
        p = 1.0 / (1.0 + np.exp(-logits))
        return p + (bias if bias is not None else 0.0), noise * p * (1.0 - p)
    if info.gating == "softmax" and bias is not None:
        p = np.exp(logits - logits.max())
        p = p / p.sum()
        return p + bias, noise * p * (1.0 - p)
    return logits, noise  # the ranking of softmax / softmax_topk / plain logits is the logits'


def routing_ties(path: Path, tokens, formats) -> np.ndarray:
    """Per position, the smallest routing margin over the MoE blocks of moelab's float64 reference
    in units of its expected rounding noise under activation ``formats`` (:func:`tie_ratio`);
    inf for a model without MoE blocks."""
    from . import reference as R
    from .gguf_model import load_model

    ratios, moe = [], R._moe

    def spy(info, lw, ex, h, routes_l):
        logits = h @ np.asarray(lw.router, np.float64).T
        if lw.router_bias is not None:
            logits = logits + np.asarray(lw.router_bias, np.float64)
        noise = logit_noise(h, lw.router, formats)
        ratios.append([tie_ratio(*_scores(info, lw, logits[t], noise[t]), info.top_k, info.expert_groups,
                                 info.expert_groups_used) for t in range(len(h))])
        return moe(info, lw, ex, h, routes_l)

    w = load_model(path)
    R._moe = spy
    try:
        R.reference_forward(w, list(tokens))
    finally:
        R._moe = moe
    return np.asarray(ratios).min(axis=0) if ratios else np.full(len(tokens), np.inf)


def site(cache: Path, version: str) -> Path:
    return Path(cache) / f"llama-cpp-python-{version}"


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
    Path(cache).mkdir(parents=True, exist_ok=True)
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
    from .archs import ARCHS

    return [(arch, q, mla) for arch in archs for q in quants
            for mla in (tuple(layouts) if ARCHS[arch].attn == "mla" else ("",))]


def synth_case(folder: Path, arch: str, quant: str, mla: str, dense_quant: str, seed: int) -> Path:
    from .synth import config_from_preset, synth_model

    wide = act_format(quant) == "Q8_256"  # K-quant blocks are 256 long
    cfg = config_from_preset("tiny", arch=arch, quant=quant, dense_quant=dense_quant, seed=seed, mla=mla or None,
                             hidden=256 if wide else None, ffn=256 if wide else None)
    return synth_model(Path(folder) / f"{arch}_{quant}{'_' + mla if mla else ''}.gguf", cfg)


def moelab_logits(path: Path, tokens) -> np.ndarray:
    """Logits ``(len(tokens), vocab)`` of moelab's executor (cpu policy, numpy experts)."""
    from scheduler import Capacity, make_policy

    from . import model as M
    from .gguf_model import load_model

    w = load_model(path)
    g = w.info.geometry()
    policy = make_policy("cpu", g, Capacity.per_layer(g, 0))
    inputs = [M.TokenInput(i, 0, i, "decode", int(t), None) for i, t in enumerate(tokens)]
    res = M.run(M.MoeModel(w, max_tokens=len(tokens) + 1), M.NumpyExperts(w), policy, inputs, keep_logits=True)
    return np.stack(res.logits).astype(np.float64)


def amx_weights(path: Path) -> list[str]:
    """Dense matmul weights of the file in a type llama.cpp's AMX buffer repacks (``AMX_TYPES``):
    2-D ``.weight`` tensors other than ``token_embd`` (read by row lookup) and the experts (3-D)."""
    from .gguf_io import read_model_info

    return [t.name for t in read_model_info(path).tensors if len(t.shape) == 2 and t.name.endswith(".weight")
            and t.name != "token_embd.weight" and t.qtype_name in AMX_TYPES]


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
    if not len(ref):
        return {"nmse": 0.0, "nmse_max_position": 0.0, "top1": 1.0, "top1_unexplained": 0}
    per = ((ours - ref) ** 2).sum(axis=1) / (ref ** 2).sum(axis=1)
    a, b = ours.argmax(axis=1), ref.argmax(axis=1)
    rows = np.arange(len(ref))
    margin = ref[rows, b] - ref[rows, a]
    rms = np.sqrt(((ours - ref) ** 2).mean(axis=1))
    return {"nmse": float(((ours - ref) ** 2).sum() / (ref ** 2).sum()), "nmse_max_position": float(per.max()),
            "top1": float(np.mean(a == b)), "top1_unexplained": int(np.sum((a != b) & (margin > 4 * rms)))}


def file_formats(quant: str, dense_quant: str) -> tuple[str, ...]:
    """Activation formats llama.cpp rounds to in a file of these expert and dense types."""
    return tuple(dict.fromkeys((act_format(quant), act_format(dense_quant))))


def tie_rule(quant: str, dense_quant: str) -> str:
    """The exclusion rule of a row, in words (printed and stored with the row)."""
    return (f"routing margin < {TIE_Z:g} x the router scores' expected rounding noise with activations in "
            f"{' + '.join(file_formats(quant, dense_quant))}")


def check_row(target: Path, folder: Path, arch: str, quant: str, mla: str, dense_quant: str, seed: int,
              tokens, extra_bufts: str = "auto", llamacpp=llamacpp_logits) -> dict:
    """One file: written, run by llama.cpp (``llamacpp``: its logits function) and by moelab, compared
    at the positions that are not routing ties; ``ok`` when within the bound of its types."""
    from .gguf_io import llamacpp_problems

    path = synth_case(folder, arch, quant, mla, dense_quant, seed)
    extra = extra_bufts == "on" or (extra_bufts == "auto" and not amx_weights(path))
    bound = max(LIMITS[quant], LIMITS[dense_quant])
    row = {"arch": arch, "quant": quant, "mla": mla, "file": path.name, "problems": llamacpp_problems(path),
           "extra_bufts": extra, "bound": bound, "tie_rule": tie_rule(quant, dense_quant),
           "formats": "+".join(file_formats(quant, dense_quant))}
    ref, err = llamacpp(target, path, list(tokens), extra)
    if ref is None:
        return {**row, "ok": False, "error": err}
    ratio = routing_ties(path, tokens, file_formats(quant, dense_quant))
    ties = ratio < TIE_Z
    row["near_ties"] = [int(i) for i in np.flatnonzero(ties)]
    row["tie_ratio_min"] = float(ratio.min())
    ours = moelab_logits(path, tokens)
    row.update(compare(ours[~ties], ref[~ties]), positions=int((~ties).sum()))
    row["ok"] = row["nmse"] <= bound and row["top1_unexplained"] == 0
    return row


def format_row(row: dict) -> str:
    if "nmse" not in row:
        return f"{row['file']:34s} llama.cpp failed: {row['error'].splitlines()[-1] if row['error'] else '?'}"
    return (f"{row['file']:34s} {row['nmse']:10.2e} {row['nmse_max_position']:10.2e} {row['top1']:6.2f} "
            f"{len(row['near_ties']):5d}  {row['bound']:.0e}  {row['formats']:12s} {'ok' if row['ok'] else 'FAILED'}"
            + (f"  (ties left out: positions {row['near_ties']})" if row["near_ties"] else ""))


def check(target: Path, out: Path, config: dict, llamacpp=llamacpp_logits) -> int:
    """Every case of ``config`` (archs, quants, mla, dense_quant, seed, tokens, extra_bufts): prints
    the table, writes ``out/config.json`` and ``out/result.json``; 0 when every row is within its bound."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    toks = TOKENS[:config["tokens"]]
    rows, failed = [], 0
    print(f"positions left out as routing ties: margin between a selected and an unselected expert < {TIE_Z:g} x\n"
          "  the pair's expected router-score noise from rounding the router input to llama.cpp's activation formats")
    print(f"{'file':34s} {'NMSE':>10s} {'worst pos':>10s} {'top-1':>6s} {'ties':>5s}  bound  formats")
    for arch, quant, mla in cases(config["archs"], config["quants"], config["mla"]):
        row = check_row(target, out, arch, quant, mla, config["dense_quant"], config["seed"], toks,
                        config["extra_bufts"], llamacpp)
        failed += not row["ok"]
        rows.append(row)
        print(format_row(row), flush=True)
    (out / "result.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    ties = sum(len(r.get("near_ties", ())) for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} within bounds; {ties} routing-tie positions left out; "
          f"{out / 'result.json'}")
    return 1 if failed else 0
