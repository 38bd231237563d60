"""The one routing-trace schema: :class:`Trace`, and its memory-mapped directory format.

A trace is a table of rows, one per token position, in replay order. Per row: sequence id, position
in the sequence, phase (0 = prefill, 1 = decode) and, per layer, the top-k expert ids in router-rank
order (``expert_ids``, shape ``(T, L, k)``) with optional router weights (``weights``, same shape).
A missing entry is masked: id -1 (and weight NaN), never a valid id. A dense layer (0 experts) is
all -1. Recorded, imported and synthetic traces are all this object.

On disk (schema version 1) a trace is a directory::

    trace.json       header: schema_version, model, num_experts, top_k, num_tokens, meta, arrays
    expert_ids.npy   int16 (int32 when a layer has more than 32767 experts), (T, L, k)
    weights.npy      float32 (T, L, k), only when weights are known
    seq.npy pos.npy  int32 (T,)
    phase.npy        int8 (T,)

``load`` memory-maps the arrays, so opening is independent of the trace's length. ``save`` writes
a temporary directory beside the destination and renames it into place. A directory may hold other
files (a LICENSE, the original recording); ``load`` ignores them.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from scheduler import Geometry, Step, Token
from scheduler.files import OutputPathError, check_output, dir_mode

__all__ = ["Trace", "TraceError", "SCHEMA_VERSION", "MAX_EXPERTS", "HEADER_NAME", "PHASES", "load", "default_trace_path",
           "check_trace_dest"]

SCHEMA_VERSION = 1
HEADER_NAME = "trace.json"
PHASES = ("prefill", "decode")  # phase code -> name
_ARRAYS = ("expert_ids", "weights", "seq", "pos", "phase")
_CHUNK_ROWS = 256  # rows converted to Python lists at a time in ``tokens``
_CACHE_ENTRIES = 250_000  # traces with at most this many (row, layer) pairs cache their steps (~100 MiB)
_CHECK_ROWS = 65536  # rows read at a time by ``validate``
MAX_EXPERTS = 65535  # experts per layer: ids are 16-bit in the scheduler and in STRP profiles
_KINDS = {"expert_ids": "iu", "weights": "f", "seq": "iu", "pos": "iu", "phase": "iu"}  # dtype kinds on disk
_SHAPES = {"expert_ids": (3, "(T, L, k)"), "weights": (3, "(T, L, k)"), "seq": (1, "(T,)"), "pos": (1, "(T,)"),
           "phase": (1, "(T,)")}  # dimensions and shape of each array


class TraceError(ValueError):
    """A trace file or array that does not satisfy the schema; the message names file and field."""


def _phase_code(phase: str | None) -> int | None:
    if phase is None:
        return None
    if phase not in PHASES:
        raise ValueError(f"phase: {phase!r}, expected one of {PHASES} or None")
    return PHASES.index(phase)


class Trace:
    """Routing of a model over a sequence of token rows (see the module docstring).

    Invariants: ``expert_ids`` is ``(T, L, top_k)`` int16/int32 with ids in ``[0, num_experts[l])``
    or -1; ``weights`` is None or float32 of the same shape, NaN exactly where ids are -1;
    ``seq``, ``pos``, ``phase`` are ``(T,)``; ``phase`` is 0 (prefill) or 1 (decode).
    """

    def __init__(self, model: str, num_experts: Sequence[int], top_k: int, expert_ids: np.ndarray,
                 seq: np.ndarray, pos: np.ndarray, phase: np.ndarray, weights: np.ndarray | None = None,
                 meta: dict | None = None, check: bool = True):
        self.model = str(model)
        self.num_experts = tuple(int(n) for n in num_experts)
        self.top_k = int(top_k)
        self.meta = dict(meta or {})
        dtype = np.int16 if max(self.num_experts, default=0) <= np.iinfo(np.int16).max else np.int32
        self.expert_ids = expert_ids if expert_ids.dtype == dtype else np.asarray(expert_ids, dtype)
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float32)
        self.seq = np.asarray(seq, dtype=np.int32)
        self.pos = np.asarray(pos, dtype=np.int32)
        self.phase = np.asarray(phase, dtype=np.int8)
        self._steps: list | None = None
        self._check_shapes()
        if check:
            self.validate()

    # invariants --------------------------------------------------------------------------------
    def _check_shapes(self) -> None:
        if not self.num_experts or min(self.num_experts) < 0 or not any(self.num_experts):
            raise TraceError(f"num_experts: {self.num_experts}, expected one count >= 0 per layer, one > 0")
        if max(self.num_experts) > MAX_EXPERTS:
            raise TraceError(f"num_experts: {max(self.num_experts)} experts in a layer, expected at most "
                             f"{MAX_EXPERTS} (the scheduler's and STRP's 16-bit expert ids)")
        if self.top_k < 1 or any(0 < n < self.top_k for n in self.num_experts):
            raise TraceError(f"top_k: {self.top_k}, expected 1 <= top_k <= every MoE layer's experts")
        shape = (len(self.seq), self.num_layers, self.top_k)
        if self.expert_ids.shape != shape:
            raise TraceError(f"expert_ids: shape {self.expert_ids.shape}, expected (T, L, k) = {shape}")
        if self.weights is not None and self.weights.shape != shape:
            raise TraceError(f"weights: shape {self.weights.shape}, expected {shape}")
        for name in ("pos", "phase"):
            if getattr(self, name).shape != self.seq.shape:
                raise TraceError(f"{name}: shape {getattr(self, name).shape}, expected {self.seq.shape}")
        if self.seq.ndim != 1:
            raise TraceError(f"seq: shape {self.seq.shape}, expected (T,)")

    def validate(self) -> None:
        """Check every entry (ids in range or -1, NaN weights exactly where masked, phases 0/1).

        Reads the whole trace in blocks of rows (memory independent of its length); ``load`` skips
        it unless asked (``check=True``); every ``moelab`` command that opens a trace asks."""
        n = np.asarray(self.num_experts)
        for r0 in range(0, len(self), _CHECK_ROWS):
            ids = np.asarray(self.expert_ids[r0:r0 + _CHECK_ROWS])  # (R, L, k)
            if ids.size:
                lo, hi = ids.min(axis=(0, 2)), ids.max(axis=(0, 2))
                bad_layers = np.flatnonzero((lo < -1) | (hi >= n))
                if len(bad_layers):
                    l = int(bad_layers[0])
                    bad = int(lo[l]) if lo[l] < -1 else int(hi[l])
                    row = r0 + int(np.argwhere((ids[:, l] == bad).any(axis=1))[0, 0])
                    raise TraceError(f"expert_ids: row {row} layer {l}: id {bad} out of range "
                                     f"(layer has {n[l]} experts; -1 = masked)")
                srt = np.sort(ids, axis=2)
                dup = (srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)  # (R, L, k-1)
                if dup.any():
                    r, l, j = (int(x) for x in np.argwhere(dup)[0])
                    raise TraceError(f"expert_ids: row {r0 + r} layer {l}: expert {int(srt[r, l, j + 1])} listed twice "
                                     f"(a row routes top_k distinct experts; -1 = masked)")
            if self.weights is not None:
                nan = np.isnan(np.asarray(self.weights[r0:r0 + _CHECK_ROWS]))
                wrong = (nan != (ids < 0)).any(axis=(1, 2))
                if wrong.any():
                    row = r0 + int(np.flatnonzero(wrong)[0])
                    raise TraceError(f"weights: row {row}: NaN weight on a routed expert or a weight on a masked entry")
            phase = np.asarray(self.phase[r0:r0 + _CHECK_ROWS])
            if not np.isin(phase, (0, 1)).all():
                raise TraceError(f"phase: values {sorted(set(np.unique(phase).tolist()) - {0, 1})}, expected 0 or 1")
            if np.asarray(self.pos[r0:r0 + _CHECK_ROWS]).min(initial=0) < 0:
                raise TraceError("pos: negative position")

    # shape --------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.num_experts)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l, n in enumerate(self.num_experts) if n)

    def __len__(self) -> int:
        return len(self.seq)

    def __repr__(self) -> str:
        return (f"Trace({self.model!r}, {len(self)} rows, {self.num_layers} layers x "
                f"{max(self.num_experts)} experts, top-{self.top_k})")

    def geometry(self, expert_bytes: int | Sequence[int] = 1) -> Geometry:
        """The scheduler's geometry, with ``expert_bytes`` per expert (one int, or one per layer)."""
        if isinstance(expert_bytes, (int, np.integer)):
            per = [int(expert_bytes) if n else 0 for n in self.num_experts]
        else:
            per = [int(b) for b in expert_bytes]
        return Geometry(self.num_experts, self.top_k, tuple(per))

    # replay -------------------------------------------------------------------------------------
    def rows(self, phase: str | None = None) -> np.ndarray:
        """Indices of the rows of ``phase`` (all rows for None), in order."""
        code = _phase_code(phase)
        if code is None:
            return np.arange(len(self))
        return np.flatnonzero(np.asarray(self.phase) == code)

    def tokens(self, phase: str | None = None, start: int = 0, limit: int | None = None) -> Iterator[Token]:
        """The scheduler tokens of the rows of ``phase``, in order, from the ``start``-th such row.

        Each token's ``steps`` has one :class:`~scheduler.Step` per MoE layer routed at that row:
        distinct experts in router-rank order, masked entries dropped, weights when known.
        ``index`` counts from 0 in this replay.
        """
        rows = self.rows(phase)[start:]
        if limit is not None:
            rows = rows[:limit]
        cached = self._step_cache()
        seq, pos, ph = self.seq, self.pos, self.phase
        for i0 in range(0, len(rows), _CHUNK_ROWS):
            chunk = rows[i0:i0 + _CHUNK_ROWS]
            steps = [cached[r] for r in chunk.tolist()] if cached is not None else self._build_steps(chunk)
            for j, (s, p, h) in enumerate(zip(seq[chunk].tolist(), pos[chunk].tolist(), ph[chunk].tolist())):
                yield Token(i0 + j, s, p, PHASES[h], steps[j])

    def _step_cache(self) -> list | None:
        if self._steps is None and len(self) * self.num_layers <= _CACHE_ENTRIES:
            self._steps = self._build_steps(np.arange(len(self)))
        return self._steps

    def _build_steps(self, rows: np.ndarray) -> list[tuple[Step, ...]]:
        """Step tuples of ``rows``: one list conversion per array, then plain Python."""
        ids = np.asarray(self.expert_ids[rows])  # (R, L, k)
        ids_l = ids.tolist()
        w_l = None if self.weights is None else np.asarray(self.weights[rows]).tolist()
        srt = np.sort(ids, axis=2)
        clean = ((ids >= 0).all(axis=2) & (srt[:, :, 1:] != srt[:, :, :-1]).all(axis=2)).tolist()  # (R, L)
        layers = self.moe_layers
        out = []
        for r in range(len(rows)):
            row, ok = ids_l[r], clean[r]
            wrow = w_l[r] if w_l is not None else None
            steps = []
            for l in layers:
                if ok[l]:
                    steps.append(Step(l, tuple(row[l]), None, None if wrow is None else tuple(wrow[l])))
                else:
                    st = _masked_step(l, row[l], None if wrow is None else wrow[l])
                    if st is not None:
                        steps.append(st)
            out.append(tuple(steps))
        return out

    # summaries ---------------------------------------------------------------------------------
    def routing_counts(self, phase: str | None = None) -> np.ndarray:
        """Routes per (layer, expert), shape ``(L, max experts)``, over the rows of ``phase``."""
        rows = self.rows(phase)
        E = max(self.num_experts)
        counts = np.zeros((self.num_layers, E), dtype=np.int64)
        step = 65536
        for i in range(0, len(rows), step):
            ids = np.asarray(self.expert_ids[rows[i:i + step]]).astype(np.int64)  # (R, L, k)
            flat = ids + (np.arange(self.num_layers) * E)[None, :, None]
            counts += np.bincount(flat[ids >= 0], minlength=self.num_layers * E).reshape(self.num_layers, E)
        return counts

    def select(self, phase: str | None = None, seqs: Sequence[int] | None = None) -> "Trace":
        """A new in-memory trace of the rows of ``phase`` whose sequence id is in ``seqs``."""
        rows = self.rows(phase)
        if seqs is not None:
            rows = rows[np.isin(np.asarray(self.seq)[rows], np.asarray(list(seqs)))]
        w = None if self.weights is None else np.array(self.weights[rows])
        return Trace(self.model, self.num_experts, self.top_k, np.array(self.expert_ids[rows]),
                     np.array(self.seq[rows]), np.array(self.pos[rows]), np.array(self.phase[rows]),
                     w, self.meta, check=False)

    def sequences(self) -> list[int]:
        """Distinct sequence ids in order of first appearance."""
        s = np.asarray(self.seq)
        _, first = np.unique(s, return_index=True)
        return s[np.sort(first)].tolist()

    # files --------------------------------------------------------------------------------------
    def header(self) -> dict:
        arrays = {name: {"dtype": str(getattr(self, name).dtype), "shape": list(getattr(self, name).shape)}
                  for name in _ARRAYS if getattr(self, name) is not None}
        return {"schema_version": SCHEMA_VERSION, "model": self.model, "num_experts": list(self.num_experts),
                "top_k": self.top_k, "num_tokens": len(self), "meta": self.meta, "arrays": arrays}

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace directory at ``path`` atomically (temporary directory, then rename).

        An existing trace directory at ``path`` is replaced; anything else there is refused, as is
        a missing parent directory (``scheduler.files.check_output``)."""
        path = check_trace_dest(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            self._save_into(tmp, path)
        except OSError as e:  # a full disk: the error names the destination, not the temporary copy
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _save_into(self, tmp: Path, path: Path) -> None:
        """The arrays and header into ``tmp``, then ``tmp`` renamed to ``path`` (an old trace there replaced)."""
        os.chmod(tmp, dir_mode())
        for name in _ARRAYS:
            arr = getattr(self, name)
            if arr is not None:
                _save_array(tmp / f"{name}.npy", arr)
        (tmp / HEADER_NAME).write_text(json.dumps(self.header(), indent=1) + "\n")
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old / "t")
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)


def check_trace_dest(path: str | os.PathLike, what: str = "trace directory") -> Path:
    """``path`` if ``Trace.save`` can write there: its parent exists and is writable, and it is
    absent or a trace directory (replaced); raises TraceError naming ``what`` otherwise. Commands
    call it before their work."""
    path = Path(path)
    try:
        check_output(path, what, is_dir=True)
    except OutputPathError as e:
        raise TraceError(str(e)) from None
    if path.exists() and not (path / HEADER_NAME).is_file():
        raise TraceError(f"{what} {path}: exists and is not a trace directory; refusing to replace it")
    return path


def _masked_step(layer: int, ids: list[int], weights: list[float] | None) -> Step | None:
    """A step from a row with masked entries or repeated ids (weights of a repeat are summed)."""
    experts: list[int] = []
    ws: list[float] = []
    for i, e in enumerate(ids):
        if e < 0:
            continue
        if e in experts:
            if weights is not None:
                ws[experts.index(e)] += weights[i]
            continue
        experts.append(e)
        if weights is not None:
            ws.append(weights[i])
    if not experts:
        return None
    return Step(layer, tuple(experts), None, tuple(ws) if weights is not None else None)


def _save_array(path: Path, arr: np.ndarray) -> None:
    """np.save in row blocks, so a memory-mapped source is never read whole into memory."""
    arr_np = arr if isinstance(arr, np.ndarray) else np.asarray(arr)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(arr_np.dtype),
                                                "fortran_order": False, "shape": arr_np.shape})
        step = max(1, (64 << 20) // max(1, arr_np[:1].nbytes))
        for i in range(0, len(arr_np), step):
            f.write(np.ascontiguousarray(arr_np[i:i + step]).tobytes())


def _field(header: dict, name: str, kind, path: Path):
    if name not in header:
        raise TraceError(f"{path}: header field {name!r} missing")
    value = header[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceError(f"{path}: header field {name!r} is {type(value).__name__}, expected {kind}")
    return value


def load(path: str | os.PathLike | None = None, check: bool = False) -> Trace:
    """Open the trace directory at ``path`` (None: the bundled default trace), memory-mapped.

    Shapes, dtypes and the header are always checked; ``check=True`` also reads every entry."""
    path = Path(default_trace_path() if path is None else path)
    hpath = path / HEADER_NAME
    if not hpath.is_file():
        raise TraceError(f"{path}: not a trace directory (no {HEADER_NAME})")
    try:
        header = json.loads(hpath.read_text())
    except OSError as e:
        raise TraceError(f"{hpath}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TraceError(f"{hpath}: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise TraceError(f"{hpath}: expected a JSON object")
    version = _field(header, "schema_version", int, hpath)
    if version != SCHEMA_VERSION:
        raise TraceError(f"{hpath}: schema_version {version}, this moelab reads {SCHEMA_VERSION}")
    num_experts = _field(header, "num_experts", list, hpath)
    if not all(isinstance(n, int) for n in num_experts):
        raise TraceError(f"{hpath}: num_experts must be a list of ints")
    arrays = {}
    for name in _ARRAYS:
        f = path / f"{name}.npy"
        if not f.is_file():
            if name == "weights":
                arrays[name] = None
                continue
            raise TraceError(f"{path}: array file {f.name} missing")
        try:
            with open(f, "rb") as fh:
                magic = fh.read(6)
        except OSError as e:
            raise TraceError(f"{f}: cannot read ({e.strerror})") from None
        if magic != b"\x93NUMPY":
            raise TraceError(f"{f}: not a .npy array file (expected the magic b'\\x93NUMPY', got {magic!r})")
        try:
            arr = np.load(f, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # numpy parses the header with ast: ValueError, SyntaxError, tokenize errors...
            raise TraceError(f"{f}: cannot read as .npy ({type(e).__name__}: {e})") from None
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in _KINDS[name] or arr.dtype.hasobject:
            kinds = "integers" if _KINDS[name] == "iu" else "floats"
            raise TraceError(f"{f}: dtype {getattr(arr, 'dtype', type(arr).__name__)}, expected {kinds}")
        ndim, shape = _SHAPES[name]
        if arr.ndim != ndim:
            raise TraceError(f"{f}: shape {arr.shape}, expected {shape}")
        arrays[name] = arr
    n = _field(header, "num_tokens", int, hpath)
    if len(arrays["seq"]) != n:
        raise TraceError(f"{path / 'seq.npy'}: {len(arrays['seq'])} rows, header says num_tokens={n}")
    try:
        return Trace(_field(header, "model", str, hpath), num_experts, _field(header, "top_k", int, hpath),
                     arrays["expert_ids"], arrays["seq"], arrays["pos"], arrays["phase"], arrays["weights"],
                     _field(header, "meta", dict, hpath), check=check)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def default_trace_path() -> Path:
    """The bundled granite-3.0-1b-a400m trace (real decode and prefill routing; MIT)."""
    return Path(__file__).resolve().parent / "data" / "granite-3.0-1b-a400m"
