"""Importers: each reads one recording format into a :class:`~traces.format.Trace`.

Every importer checks the whole file before anything is written; a problem raises
:class:`~traces.format.TraceError` naming the file, the record and what was expected (truncated
file, wrong field type, expert id out of range, k changing mid-trace, NaN weights).

Formats (``IMPORTERS``, name -> function ``(src, **options) -> Trace``):

- ``granite``: the onnx-genai ``moe_expert_trace.json`` (prompts -> prefill/decode rows of
  per-layer top-k ids, no weights). Sequence ids follow the prompts' order.
- ``switch``: ``router-trace.v2.json`` (``selections``: tokens x layers x k). Prompt spans, and so
  sequence ids, come from ``capture-metadata.json`` beside it when present (else one sequence).
  An encoder: every row is prefill.
- ``vllm``: vLLM-profiler JSONL, one record per (token, layer): ``dataset``, ``problem_id``,
  ``layer``, ``token_idx``, ``experts``, ``gating_probs`` (optional ``phase``; default decode).
  A sequence is a (dataset, problem_id) pair; sequences are numbered in sorted order (dataset,
  then problem_id), rows are each sequence's token indices in ascending order, so the file's
  record order does not matter; a (token, layer) with no record is masked.
- ``strata``: Strata's binary ``--dump-routing`` (little-endian records: int32 layer, int32 k,
  k int32 ids, k float32 weights). Token rule: a token's records are consecutive with strictly
  increasing layers; a record whose layer is not greater than the previous record's starts a new
  token. One sequence, all decode. Layers/experts default to the largest seen + 1.
- ``audit``: moelab's own audit JSONL (``Audit(record_routes=True).write_jsonl``): per-token
  records with ``routes`` and a final summary line holding the geometry. A record with
  ``positions`` (a multi-token batch) gives one row per position, from each position's routes.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from .format import PHASES, Trace, TraceError

__all__ = ["IMPORTERS", "import_trace", "import_granite", "import_switch", "import_vllm", "import_strata",
           "import_audit", "write_strata"]


MAX_LAYERS = 4096  # sanity bounds on geometry read or inferred from a file
MAX_EXPERTS = 65535


def _check_geometry(src, where: str, L: int, E: int, k: int) -> None:
    if not (1 <= L <= MAX_LAYERS and 1 <= E <= MAX_EXPERTS and 1 <= k <= E):
        raise _fail(src, where, f"geometry {L} layers x {E} experts, top_k {k} is impossible "
                                f"(limits {MAX_LAYERS} layers, {MAX_EXPERTS} experts, 1 <= k <= experts)")


def _fail(src, where: str, problem: str) -> TraceError:
    return TraceError(f"{src}: {where}: {problem}")


def _read_json(src: Path):
    try:
        return json.loads(Path(src).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{src}: not valid JSON ({e})") from None
    except OSError as e:
        raise TraceError(f"{src}: cannot read ({e.strerror})") from None


def _int(value, src, where: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(src, where, f"field {name!r} is {type(value).__name__}, expected an integer")
    return value


def _ids(value, k: int | None, num_experts: int | None, src, where: str) -> list[int]:
    """A list of expert ids: integers, in range, distinct, ``k`` long when k is given."""
    if not isinstance(value, list):
        raise _fail(src, where, f"experts are {type(value).__name__}, expected a list of ids")
    for e in value:
        if not isinstance(e, int) or isinstance(e, bool):
            raise _fail(src, where, f"expert id {e!r} is {type(e).__name__}, expected an integer")
        if e < 0 or (num_experts is not None and e >= num_experts):
            raise _fail(src, where, f"expert id {e} out of range 0..{(num_experts or 0) - 1}")
    if k is not None and len(value) != k:
        raise _fail(src, where, f"{len(value)} experts, expected top_k={k} (k may not change mid-trace)")
    if len(set(value)) != len(value):
        raise _fail(src, where, f"repeated expert id in {value}")
    return value


def _weights(value, n: int, src, where: str) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise _fail(src, where, f"weights {value!r:.80} are not a list of {n} numbers")
    for w in value:
        if not isinstance(w, (int, float)) or isinstance(w, bool):
            raise _fail(src, where, f"weight {w!r} is {type(w).__name__}, expected a number")
        if not math.isfinite(w):
            raise _fail(src, where, f"weight {w} is not finite")
    return [float(w) for w in value]


# granite onnx-genai JSON ----------------------------------------------------------------------
def import_granite(src) -> Trace:
    """The onnx-genai granite ``moe_expert_trace.json`` (see the module docstring)."""
    d = _read_json(src)
    if not isinstance(d, dict):
        raise _fail(src, "top level", "expected a JSON object")
    L = _int(d.get("num_layers"), src, "header", "num_layers")
    E = _int(d.get("num_experts"), src, "header", "num_experts")
    k = _int(d.get("top_k"), src, "header", "top_k")
    _check_geometry(src, "header", L, E, k)
    prompts = d.get("prompts")
    if not isinstance(prompts, dict) or not prompts:
        raise _fail(src, "field 'prompts'", "expected a non-empty object of prompts")
    rows, seq, pos, phase = [], [], [], []
    for s, (name, p) in enumerate(prompts.items()):
        if not isinstance(p, dict):
            raise _fail(src, f"prompt {name!r}", "expected an object")
        plen = _int(p.get("prompt_len"), src, f"prompt {name!r}", "prompt_len")
        for ph, key in enumerate(PHASES):
            block = p.get(key)
            if not isinstance(block, list):
                raise _fail(src, f"prompt {name!r}", f"field {key!r} is {type(block).__name__}, expected a list")
            if key == "prefill" and len(block) != plen:
                raise _fail(src, f"prompt {name!r}", f"{len(block)} prefill rows, prompt_len says {plen}")
            for i, row in enumerate(block):
                where = f"prompt {name!r} {key} row {i}"
                if not isinstance(row, list) or len(row) != L:
                    raise _fail(src, where, f"expected a list of {L} layers")
                rows.append([_ids(r, k, E, src, f"{where} layer {l}") for l, r in enumerate(row)])
                seq.append(s)
                pos.append(i if ph == 0 else plen + i)
                phase.append(ph)
    meta = {"source": str(Path(src).name), "format": "onnx-genai moe_expert_trace.json",
            "prompts": list(prompts), "recorded": "ONNX f16 inference, greedy decoding; ids in router-rank order, no router weights"}
    return Trace(d.get("model", "unknown"), (E,) * L, k, np.array(rows, dtype=np.int16).reshape(len(rows), L, k),
                 seq, pos, phase, None, meta)


# switch-base-8 router-trace.v2.json ----------------------------------------------------------
def import_switch(src, metadata=None) -> Trace:
    """A ``router-trace.v2.json``; prompt spans from ``metadata`` (default: capture-metadata.json beside)."""
    d = _read_json(src)
    if not isinstance(d, dict):
        raise _fail(src, "top level", "expected a JSON object")
    L = _int(d.get("layers"), src, "header", "layers")
    E = _int(d.get("expertsPerLayer"), src, "header", "expertsPerLayer")
    k = _int(d.get("topK"), src, "header", "topK")
    T = _int(d.get("tokens"), src, "header", "tokens")
    _check_geometry(src, "header", L, E, k)
    sel = d.get("selections")
    if not isinstance(sel, list):
        raise _fail(src, "field 'selections'", f"is {type(sel).__name__}, expected a list")
    if len(sel) != T:
        raise _fail(src, "field 'selections'", f"{len(sel)} tokens, header says tokens={T} (truncated?)")
    rows = []
    for t, row in enumerate(sel):
        if not isinstance(row, list) or len(row) != L:
            raise _fail(src, f"token {t}", f"expected a list of {L} layers")
        rows.append([_ids(r, k, E, src, f"token {t} layer {l}") for l, r in enumerate(row)])
    seq = np.zeros(T, dtype=np.int32)
    pos = np.arange(T, dtype=np.int32)
    meta = {"source": str(Path(src).name), "format": "router-trace.v2.json", "recorded": "encoder router argmax, no router weights",
            "scenario": d.get("scenario"), "origin": d.get("source")}
    mpath = Path(metadata) if metadata is not None else Path(src).parent / "capture-metadata.json"
    if mpath.is_file():
        m = _read_json(mpath)
        spans = m.get("prompt_spans") if isinstance(m, dict) else None
        if not isinstance(spans, list):
            raise _fail(mpath, "field 'prompt_spans'", "expected a list")
        covered = np.zeros(T, dtype=bool)
        for i, sp in enumerate(spans):
            a = _int(sp.get("token_start") if isinstance(sp, dict) else None, mpath, f"span {i}", "token_start")
            b = _int(sp.get("token_end_exclusive"), mpath, f"span {i}", "token_end_exclusive")
            if not 0 <= a < b <= T or covered[a:b].any():
                raise _fail(mpath, f"span {i}", f"tokens {a}..{b} overlap another span or leave 0..{T}")
            covered[a:b] = True
            seq[a:b] = i
            pos[a:b] = np.arange(b - a)
        if not covered.all():
            raise _fail(mpath, "prompt_spans", f"token {int(np.argmin(covered))} is in no span")
        meta["prompts"] = [sp.get("id") for sp in spans]
        meta["sparse_encoder_block_indices"] = m.get("sparse_encoder_block_indices")
    ids = np.array(rows, dtype=np.int16).reshape(T, L, k)
    origin = d.get("source")
    model = origin.get("model") if isinstance(origin, dict) else None
    model = str(model.get("id", "switch")) if isinstance(model, dict) else "switch"
    return Trace(model, (E,) * L, k, ids, seq, pos, np.zeros(T, dtype=np.int8), None, meta)


# vLLM-profiler JSONL ---------------------------------------------------------------------------
def _jsonl(src):
    """(line number, parsed object) for each non-blank line; a bad line is an error."""
    try:
        f = open(src, "rb")
    except OSError as e:
        raise TraceError(f"{src}: cannot read ({e.strerror})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise _fail(src, f"line {n}", f"not UTF-8 text ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise _fail(src, f"line {n}", f"not valid JSON ({e.msg}; truncated?)") from None


def import_vllm(src, num_layers: int | None = None, num_experts: int | None = None, model: str = "unknown") -> Trace:
    """vLLM-profiler JSONL (see the module docstring)."""
    recs: dict[tuple[int, int, int], tuple[list[int], list[float] | None]] = {}
    seq_ids: dict[tuple, int] = {}
    phases: dict[tuple[int, int], int] = {}
    k = None
    for n, r in _jsonl(src):
        where = f"line {n}"
        if not isinstance(r, dict):
            raise _fail(src, where, "expected a JSON object")
        for f in ("dataset", "problem_id", "layer", "token_idx", "experts"):
            if f not in r:
                raise _fail(src, where, f"field {f!r} missing")
        for f in ("dataset", "problem_id"):
            if not isinstance(r[f], (str, int)) or isinstance(r[f], bool):
                raise _fail(src, where, f"field {f!r} is {type(r[f]).__name__}, expected a string or integer")
        layer = _int(r["layer"], src, where, "layer")
        tok = _int(r["token_idx"], src, where, "token_idx")
        if layer < 0 or (num_layers is not None and layer >= num_layers) or tok < 0:
            raise _fail(src, where, f"layer {layer} / token_idx {tok} out of range")
        k = len(r["experts"]) if k is None else k
        ids = _ids(r["experts"], k, num_experts, src, where)
        w = _weights(r.get("gating_probs"), len(ids), src, where)
        s = seq_ids.setdefault((r["dataset"], r["problem_id"]), len(seq_ids))
        ph = r.get("phase", "decode")
        if ph not in PHASES:
            raise _fail(src, where, f"phase {ph!r}, expected one of {PHASES}")
        if phases.setdefault((s, tok), PHASES.index(ph)) != PHASES.index(ph):
            raise _fail(src, where, f"phase {ph!r} differs from another layer of the same token")
        if (s, tok, layer) in recs:
            raise _fail(src, where, f"second record for token {tok} layer {layer} of {r['dataset']}/{r['problem_id']}")
        recs[(s, tok, layer)] = (ids, w)
    if not recs:
        raise TraceError(f"{src}: no records")
    L = num_layers or 1 + max(key[2] for key in recs)
    E = num_experts or 1 + max(max(v[0]) for v in recs.values())
    _check_geometry(src, "records", L, E, k)
    order = sorted(seq_ids, key=lambda key: (str(key[0]), isinstance(key[1], str), key[1]))
    renumber = {seq_ids[key]: i for i, key in enumerate(order)}
    recs = {(renumber[s], tok, layer): v for (s, tok, layer), v in recs.items()}
    phases = {(renumber[s], tok): ph for (s, tok), ph in phases.items()}
    row_keys = sorted(phases)
    row_of = {key: i for i, key in enumerate(row_keys)}
    T = len(row_keys)
    ids_a = np.full((T, L, k), -1, dtype=np.int16 if E <= 32767 else np.int32)
    any_w = any(v[1] is not None for v in recs.values())
    w_a = np.full((T, L, k), np.nan, dtype=np.float32) if any_w else None
    for (s, tok, layer), (ids, w) in recs.items():
        i = row_of[(s, tok)]
        ids_a[i, layer] = ids
        if any_w:
            if w is None:
                raise TraceError(f"{src}: token {tok} layer {layer} has no gating_probs while others do")
            w_a[i, layer] = w
    meta = {"source": Path(src).name, "format": "vLLM-profiler JSONL",
            "sequences": [list(key) for key in order], "masked_entries": int(T * L - len(recs))}
    return Trace(model, (E,) * L, k, ids_a, [key[0] for key in row_keys], [key[1] for key in row_keys],
                 [phases[key] for key in row_keys], w_a, meta)


# Strata binary routing dump ----------------------------------------------------------------------
_REC = struct.Struct("<ii")


def write_strata(path, records) -> None:
    """Write ``(layer, ids, weights)`` records in Strata's ``--dump-routing`` layout."""
    with open(path, "wb") as f:
        for layer, ids, weights in records:
            f.write(_REC.pack(layer, len(ids)))
            f.write(np.asarray(ids, dtype="<i4").tobytes())
            f.write(np.asarray(weights, dtype="<f4").tobytes())


def import_strata(src, num_layers: int | None = None, num_experts: int | None = None, model: str = "unknown") -> Trace:
    """Strata's binary routing dump (see the module docstring for the token rule)."""
    try:
        raw = Path(src).read_bytes()
    except OSError as e:
        raise TraceError(f"{src}: cannot read ({e.strerror})") from None
    off, n, k = 0, 0, None
    tokens: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    prev = None
    while off < len(raw):
        where = f"record {n} (byte {off})"
        if off + 8 > len(raw):
            raise _fail(src, where, f"truncated header: {len(raw) - off} of 8 bytes")
        layer, kk = _REC.unpack_from(raw, off)
        if k is None:
            k = kk
        if kk != k or kk < 1:
            raise _fail(src, where, f"k={kk}, expected {k} (k may not change mid-trace)" if kk >= 1 else f"k={kk}, expected >= 1")
        if layer < 0 or (num_layers is not None and layer >= num_layers):
            raise _fail(src, where, f"layer {layer} out of range 0..{(num_layers or 0) - 1}")
        end = off + 8 + 8 * k
        if end > len(raw):
            raise _fail(src, where, f"truncated: {len(raw) - off} of {end - off} bytes")
        ids = np.frombuffer(raw, "<i4", k, off + 8)
        w = np.frombuffer(raw, "<f4", k, off + 8 + 4 * k)
        if (ids < 0).any() or (num_experts is not None and (ids >= num_experts).any()):
            raise _fail(src, where, f"expert id in {ids.tolist()} out of range 0..{(num_experts or 0) - 1}")
        if len(np.unique(ids)) != k:
            raise _fail(src, where, f"repeated expert id in {ids.tolist()}")
        if not np.isfinite(w).all():
            raise _fail(src, where, f"non-finite weight in {w.tolist()}")
        if prev is None or layer <= prev:
            tokens.append({})
        tokens[-1][layer] = (ids, w)
        prev, off, n = layer, end, n + 1
    if not tokens:
        raise TraceError(f"{src}: empty file, no records")
    L = num_layers or 1 + max(max(t) for t in tokens)
    E = num_experts or 1 + max(int(ids.max()) for t in tokens for ids, _ in t.values())
    _check_geometry(src, "records", L, E, k)
    T = len(tokens)
    ids_a = np.full((T, L, k), -1, dtype=np.int16 if E <= 32767 else np.int32)
    w_a = np.full((T, L, k), np.nan, dtype=np.float32)
    for t, recs in enumerate(tokens):
        for layer, (ids, w) in recs.items():
            ids_a[t, layer] = ids
            w_a[t, layer] = w
    meta = {"source": Path(src).name, "format": "Strata --dump-routing", "records": n,
            "token_rule": "a record whose layer does not increase starts a new token",
            "geometry": "given" if num_layers and num_experts else "inferred from the largest ids seen"}
    return Trace(model, (E,) * L, k, ids_a, np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                 np.ones(T, np.int8), w_a, meta)


# moelab audit JSONL -------------------------------------------------------------------------------
def import_audit(src) -> Trace:
    """moelab's audit JSONL with ``routes`` (see the module docstring)."""
    records, summary = [], None
    for n, r in _jsonl(src):
        if not isinstance(r, dict):
            raise _fail(src, f"line {n}", "expected a JSON object")
        if summary is not None:
            raise _fail(src, f"line {n}", "record after the summary line")
        if r.get("summary") is True:
            summary = r
        else:
            records.append((n, r))
    if summary is None:
        raise TraceError(f"{src}: no summary line (truncated file?)")
    g = summary.get("geometry")
    if not isinstance(g, dict) or not isinstance(g.get("num_experts"), list):
        raise TraceError(f"{src}: summary line: field 'geometry' with 'num_experts' missing")
    num_experts = [_int(x, src, "summary line", "geometry.num_experts") for x in g["num_experts"]]
    k = _int(g.get("top_k"), src, "summary line", "geometry.top_k")
    L = len(num_experts)
    _check_geometry(src, "summary line", L, max(num_experts, default=0), k)
    if min(num_experts) < 0 or any(0 < n < k for n in num_experts):
        raise _fail(src, "summary line", f"geometry.num_experts {num_experts} does not fit top_k {k}")
    rows = []  # (line, record, pos, routes): one per trace row
    for n, r in records:
        if r.get("positions") is None:
            rows.append((n, r, r.get("pos"), r.get("routes")))
            continue
        if not isinstance(r["positions"], list) or not all(isinstance(p, dict) for p in r["positions"]):
            raise _fail(src, f"line {n}", "field 'positions' is not a list of {pos, routes} objects")
        rows.extend((n, r, p.get("pos"), p.get("routes")) for p in r["positions"])
    T = len(rows)
    ids_a = np.full((T, L, k), -1, dtype=np.int16 if max(num_experts) <= 32767 else np.int32)
    w_a = np.full((T, L, k), np.nan, dtype=np.float32)
    any_w = False
    seq, pos, phase = [], [], []
    for t, (n, r, p, routes) in enumerate(rows):
        where = f"line {n}"
        seq.append(_int(r.get("seq"), src, where, "seq"))
        pos.append(_int(p, src, where, "pos"))
        if r.get("phase") not in PHASES:
            raise _fail(src, where, f"phase {r.get('phase')!r}, expected one of {PHASES}")
        phase.append(PHASES.index(r["phase"]))
        if not isinstance(routes, list):
            raise _fail(src, where, "field 'routes' missing or not a list (write the audit with record_routes=True)")
        for route in routes:
            if not isinstance(route, list) or len(route) != 3:
                raise _fail(src, where, f"route {route!r:.60} is not [layer, experts, weights]")
            layer = _int(route[0], src, where, "route layer")
            if not 0 <= layer < L or not num_experts[layer]:
                raise _fail(src, where, f"route layer {layer} is not a MoE layer of the geometry")
            ids = _ids(route[1], None, num_experts[layer], src, f"{where} layer {layer}")
            if len(ids) > k:
                raise _fail(src, where, f"layer {layer}: {len(ids)} experts > top_k {k} (a multi-token batch "
                                        f"written without 'positions'; moelab run --audit writes them)")
            w = _weights(route[2], len(ids), src, f"{where} layer {layer}")
            ids_a[t, layer, :len(ids)] = ids
            if w is not None:
                any_w = True
                w_a[t, layer, :len(ids)] = w
    meta = {"source": Path(src).name, "format": "moelab audit JSONL",
            "run": {key: v for key, v in summary.items() if key in ("policy", "model", "seed", "backend")}}
    if any_w and np.isnan(w_a[ids_a >= 0]).any():
        raise TraceError(f"{src}: some routes carry weights and others do not")
    return Trace(str(summary.get("model", "unknown")), num_experts, k, ids_a, seq, pos, phase,
                 w_a if any_w else None, meta)


IMPORTERS = {
    "granite": import_granite,
    "switch": import_switch,
    "vllm": import_vllm,
    "strata": import_strata,
    "audit": import_audit,
}


def import_trace(fmt: str, src, **options) -> Trace:
    """Import ``src`` with the importer named ``fmt`` (a key of ``IMPORTERS``)."""
    try:
        fn = IMPORTERS[fmt]
    except KeyError:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {', '.join(IMPORTERS)}") from None
    try:
        return fn(src, **options)
    except TraceError as e:
        if str(e).startswith(str(src)):
            raise
        raise TraceError(f"{src}: {e}") from None
