"""Non-finite weights (and dense shapes that disagree with the metadata) found at load, before any
kernel sees them.

Every tensor of a GGUF file is checked in its stored form: float tensors (F32, F16, BF16) element
by element, block types through their scales (the f16 ``d``/``m`` fields, IQ1_M's split ``d``,
MXFP4's exponent; a block with finite scales dequantizes to finite weights). A NaN or Inf is
reported naming the tensor, and for a routed-expert tensor the expert, so a damaged file stops
with one line instead of a CPU worker dividing by NaN or a run printing text from NaN logits.

The check reads each tensor once through the memory map (chunks of ``_CHUNK_BYTES``), no copy of
a tensor is made; ``--allow-non-finite`` skips it for a user who wants to run anyway. A file found
finite is remembered (``check_file``: its path, inode, size and times in a small cache file), so
running the same unchanged file again costs no scan.
"""
from __future__ import annotations

import os

import numpy as np

from . import quant as Q
from .gguf_file import GGUFError, GGUFFile

__all__ = ["NonFiniteWeights", "first_non_finite", "check_file", "check_shapes", "load_checked", "ALLOW_FLAG"]

ALLOW_FLAG = "--allow-non-finite"
_CHUNK_BYTES = 64 << 20
_IQ1_M_SCALES = 48  # byte offset of IQ1_M's u16 scales[4], whose top nibbles hold the f16 d
_MXFP4_SAFE_E = 250  # an MXFP4 block exponent below this cannot overflow float32 (|value| <= 12 * 2^121)


class NonFiniteWeights(GGUFError):
    """A tensor of the file holds NaN or Inf; the message names the file, tensor and where."""


def _f16_bad(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7C00) == 0x7C00  # exponent all ones: Inf or NaN


def _bad_in(raw: np.ndarray, qtype: int) -> int | None:
    """Index of the first non-finite element (float types) or block (block types) of uint8
    ``raw`` (flat bytes of one tensor, or a chunk of whole blocks), or None."""
    if qtype == Q.F32:
        bad = ~np.isfinite(raw.view("<f4"))
    elif qtype == Q.F16:
        bad = _f16_bad(raw.view("<u2"))
    elif qtype == Q.BF16:
        bad = (raw.view("<u2") & 0x7F80) == 0x7F80
    elif qtype in Q._F16_FIELDS:
        b = raw.reshape(-1, Q.LAYOUTS[qtype].block_bytes)
        bad = np.zeros(len(b), bool)
        for off in Q._F16_FIELDS[qtype]:
            bad |= _f16_bad(b[:, off].astype(np.uint16) | (b[:, off + 1].astype(np.uint16) << 8))
    elif qtype == Q.IQ1_M:
        s = raw.reshape(-1, Q.LAYOUTS[qtype].block_bytes)[:, _IQ1_M_SCALES:_IQ1_M_SCALES + 8]
        s = s[:, 0::2].astype(np.uint16) | (s[:, 1::2].astype(np.uint16) << 8)  # (blocks, 4) u16
        bad = _f16_bad((s[:, 0] >> 12) | ((s[:, 1] >> 8) & 0xF0) | ((s[:, 2] >> 4) & 0xF00) | (s[:, 3] & 0xF000))
    elif qtype == Q.MXFP4:
        b = raw.reshape(-1, Q.LAYOUTS[qtype].block_bytes)
        bad = np.zeros(len(b), bool)
        hot = np.flatnonzero(b[:, 0] >= _MXFP4_SAFE_E)
        if len(hot):
            with np.errstate(over="ignore", invalid="ignore"):
                w = Q.dequantize(np.ascontiguousarray(b[hot]), Q.MXFP4, 32)
            bad[hot] = ~np.isfinite(w).all(axis=1)
    else:
        return None  # integer tensors and types without float fields
    hit = np.flatnonzero(bad)
    return int(hit[0]) if len(hit) else None


def first_non_finite(reader: GGUFFile) -> str | None:
    """Where the first non-finite value of ``reader``'s tensors is, in words, or None."""
    for t in reader.tensors:
        if t.qtype not in Q.LAYOUTS:
            continue
        q = Q.LAYOUTS[t.qtype]
        raw = reader.raw(t).reshape(-1)
        step = max(1, _CHUNK_BYTES // q.block_bytes) * q.block_bytes
        for start in range(0, len(raw), step):
            i = _bad_in(raw[start:start + step], t.qtype)
            if i is None:
                continue
            i += start // q.block_bytes
            unit = "element" if q.block_weights == 1 else "block"
            where = f"{unit} {i}"
            if len(t.shape) == 3:  # routed experts (experts, rows, cols): name the expert
                per = t.nbytes // t.shape[0] // q.block_bytes
                where += f", expert {i // per}"
            return f"tensor {t.name} holds a NaN or Inf ({q.name} {where})"
    return None


def _cache_file() -> str | None:
    """Where files found finite are remembered: ``$MOELAB_CACHE_DIR`` (empty: nowhere), else
    ``$XDG_CACHE_HOME/moelab`` or ``~/.cache/moelab``; ``finite_checked.json`` there."""
    root = os.environ.get("MOELAB_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "moelab")
    return os.path.join(root, "finite_checked.json") if root else None


def _fingerprint(path) -> str:
    """The file's identity and version: real path, device, inode, size, modification and change
    times (ns); any write to the file changes it."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _cached(key: str) -> bool:
    import json

    f = _cache_file()
    try:
        with open(f) as fh:
            return key in json.load(fh)
    except (OSError, TypeError, ValueError):
        return False


def _remember(key: str, keep: int = 64) -> None:
    """Add ``key`` to the cache (the newest ``keep`` kept); any error leaves the cache as it was."""
    import json
    import tempfile

    f = _cache_file()
    if f is None:
        return
    try:
        try:
            with open(f) as fh:
                keys = [k for k in json.load(fh) if isinstance(k, str) and k != key]
        except (OSError, ValueError):
            keys = []
        os.makedirs(os.path.dirname(f), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(f), prefix=".finite_checked.")
        with os.fdopen(fd, "w") as fh:
            json.dump((keys + [key])[-keep:], fh)
        os.replace(tmp, f)
    except (OSError, TypeError, ValueError):
        pass


def check_file(path: str | os.PathLike) -> None:
    """Raise NonFiniteWeights naming the tensor when ``path``'s weights hold NaN or Inf. A file found
    finite is remembered by its fingerprint (path, inode, size, times; ``_cache_file``), so the next
    run of the same unchanged file skips the scan (the whole file read: seconds for tens of GB)."""
    key = _fingerprint(path)
    if _cached(key):
        return
    where = first_non_finite(GGUFFile(path))
    if where:
        raise NonFiniteWeights(f"{path}: {where}; the model cannot run on it ({ALLOW_FLAG} runs it anyway)")
    _remember(key)


def check_shapes(weights) -> None:
    """Raise GGUFError when a dense tensor's shape disagrees with the file's metadata (a damaged key,
    e.g. ``head_count_kv`` lost and its default taken), naming the tensor and the shape expected."""
    info = weights.info
    h = info.hidden
    want = [("token_embd.weight", weights.token_embd, (info.vocab, h)), ("output_norm.weight", weights.output_norm, (h,)),
            ("output.weight", weights.output, (info.vocab, h))]
    for l, lw in enumerate(weights.layers):
        p = f"blk.{l}."
        want += [(p + "attn_norm.weight", lw.attn_norm, (h,)), (p + "attn_output.weight", lw.wo, (h, None)),
                 (p + "ffn_gate_inp.weight", lw.router, (info.num_experts[l], h))]
        if lw.wq is not None:  # GQA
            kv = info.num_kv_heads * info.head_dim
            want += [(p + "attn_q.weight", lw.wq, (None, h)), (p + "attn_k.weight", lw.wk, (kv, h)),
                     (p + "attn_v.weight", lw.wv, (kv, h))]
        for group, tensors in (("shexp", lw.shared), ("", lw.dense_ffn)):
            for k in ("gate", "up"):
                if tensors and tensors.get(k) is not None:
                    want.append((f"{p}ffn_{k}{'_' + group if group else ''}.weight", tensors[k], (None, h)))
    for name, arr, shape in want:
        if arr is None:
            continue
        if arr.ndim != len(shape) or any(w is not None and w != n for w, n in zip(shape, arr.shape)):
            expected = tuple("any" if w is None else w for w in shape)
            raise GGUFError(f"{info.path}: tensor {name} has shape {tuple(arr.shape)} (numpy order); the file's "
                            f"metadata ({info.arch}: hidden {h}, heads {info.num_heads}, kv heads "
                            f"{info.num_kv_heads}, head_dim {info.head_dim}, vocab {info.vocab}) needs {expected}")


def load_checked(path: str | os.PathLike, allow_non_finite: bool = False, timings: dict | None = None, **kwargs):
    """``gguf_model.load_model(path, **kwargs)`` after ``check_file`` (skipped by ``allow_non_finite``),
    then ``check_shapes``; with the finite check skipped, dequantizing a non-finite tensor stays
    silent (no numpy warnings). ``timings``: a dict that receives ``finite_check_s`` and
    ``load_model``'s timings."""
    import time

    from .gguf_model import load_model

    t0 = time.perf_counter()
    if not allow_non_finite:
        check_file(path)
    if timings is not None:
        timings["finite_check_s"] = time.perf_counter() - t0
    with np.errstate(over="ignore", invalid="ignore"):
        weights = load_model(path, timings=timings, **kwargs)
    check_shapes(weights)
    return weights
