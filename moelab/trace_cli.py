"""``moelab trace``: import, inspect, fit and synthesise routing traces.

Subcommands: ``import FORMAT SRC DEST``, ``info PATH``, ``stats [PATH]``, ``fit [PATH]``,
``synth DEST``. Every PATH defaults to the bundled granite trace. Errors go to stderr with a
non-zero exit; nothing is written for a bad input.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from scheduler.args import ArgumentParser, int_at_least
from scheduler.files import atomic_open, atomic_write, check_output

from traces.format import MAX_EXPERTS, Trace, TraceError, check_trace_dest, load
from traces.importers import IMPORTERS, import_trace

__all__ = ["main"]


def _slots(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected cache sizes >= 1 slot")
    return out



def _load(path) -> "Trace":
    """The trace at ``path`` (None: the bundled one), every entry checked."""
    return load(path, check=True)


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moelab trace", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="convert a recording into a trace directory")
    imp.add_argument("format", choices=sorted(IMPORTERS))
    imp.add_argument("src")
    imp.add_argument("dest")
    imp.add_argument("--layers", type=int_at_least(1), help="layers (vllm, strata: when the file cannot tell)")
    imp.add_argument("--experts", type=int_at_least(1), help="experts per layer (vllm, strata)")
    imp.add_argument("--model", help="model name (vllm, strata)")
    imp.add_argument("--metadata", help="switch: capture-metadata.json (default: beside SRC)")
    imp.add_argument("--quiet", action="store_true", help="nothing on stderr but errors")
    info = sub.add_parser("info", help="header and shape of a trace")
    info.add_argument("path", nargs="?")
    st = sub.add_parser("stats", help="coverage, overlap, reuse distances and hit rates per policy")
    st.add_argument("path", nargs="?")
    st.add_argument("--phase", choices=("prefill", "decode"))
    st.add_argument("--slots", type=_slots, default=[], help="cache slots per layer, e.g. 8,16,32")
    st.add_argument("--policies", default="lru,belady", help="scheduler policies, comma-separated")
    st.add_argument("--reset-per-sequence", action="store_true", help="fresh cache for every sequence")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--out", help="directory for stats.json, hit_rates.csv and hit_rates.png")
    st.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    st.add_argument("--hardware", default=None, help="hardware preset the policies are simulated on (link and "
                    "CPU charged; the trace's geometry on the default model's expert sizes); default: the simulator's")
    fit = sub.add_parser("fit", help="fit synthetic-trace parameters to a trace")
    fit.add_argument("path", nargs="?")
    fit.add_argument("--phase", choices=("prefill", "decode"), default="decode")
    fit.add_argument("--slots", type=_slots, help="capacities to match (default k/2, k, 2k, 3k)")
    fit.add_argument("--reset-per-sequence", action="store_true")
    fit.add_argument("--seed", type=int_at_least(0), default=0)
    fit.add_argument("--out", help="write the parameters as JSON here")
    fit.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    syn = sub.add_parser("synth", help="write a synthetic trace")
    syn.add_argument("dest")
    syn.add_argument("--preset", help="named preset (geometry + parameters); see traces.synth.PRESETS")
    syn.add_argument("--params", help="JSON file of parameters (from moelab trace fit)")
    syn.add_argument("--layers", type=int_at_least(1))
    syn.add_argument("--experts", type=int_at_least(1))
    syn.add_argument("--top-k", type=int_at_least(1))
    syn.add_argument("--tokens", type=int_at_least(1))
    syn.add_argument("--seqs", type=int_at_least(1))
    syn.add_argument("--seed", type=int_at_least(0), default=0)
    syn.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    return p


def _import(a) -> int:
    check_trace_dest(a.dest, "DEST")
    opts = {}
    if a.format in ("vllm", "strata"):
        opts = {"num_layers": a.layers, "num_experts": a.experts, "model": a.model or "unknown"}
    elif a.layers is not None or a.experts is not None or a.model is not None:
        raise ValueError(f"--layers, --experts and --model are read only by the vllm and strata importers, "
                         f"not {a.format}")
    if a.metadata:
        if a.format != "switch":
            raise ValueError(f"--metadata is read only by the switch importer, not {a.format}")
        if not Path(a.metadata).is_file():
            raise ValueError(f"--metadata {a.metadata}: no such file (expected switch's capture-metadata.json)")
        opts = {"metadata": a.metadata}
    trace = import_trace(a.format, a.src, **opts)
    trace.save(a.dest)
    if not a.quiet:
        print(f"wrote {a.dest}: {trace!r}", file=sys.stderr)
    return 0


def _info(a) -> int:
    t = _load(a.path)
    h = t.header()
    h["phases"] = {"prefill": int((np.asarray(t.phase) == 0).sum()), "decode": int((np.asarray(t.phase) == 1).sum())}
    h["sequences"] = len(t.sequences())
    h["masked_entries"] = int((np.asarray(t.expert_ids) < 0).sum() - t.top_k * len(t) * (t.num_experts.count(0)))
    print(json.dumps(h, indent=1))
    return 0


def _table(s: dict) -> str:
    lines = [f"{s['model']}: {s['rows']} rows ({s['phase']}), {s['sequences']} sequences",
             "coverage (share of (layer, expert) pairs): " + ", ".join(f"{k} {v:.3f}" for k, v in s["coverage"].items()),
             f"adjacent-token overlap: {s['adjacent_overlap']:.3f}   cross-layer novelty correlation: "
             f"{s['layer_novelty_correlation']:.3f}",
             "reuse distance (tokens): " + ", ".join(f"{k} {v:.3g}" for k, v in s["reuse_distance"].items())]
    slots = list(s["reference_lru"])
    if slots:
        lines.append(f"{'hit rate':<14}" + "".join(f"{c:>9}" for c in slots))
        rows = {"lru (ref)": s["reference_lru"], **s["hit_rate"]}
        for name, v in rows.items():
            lines.append(f"{name:<14}" + "".join(f"{'n/a' if v[c] is None else format(v[c], '.3f'):>9}" for c in slots))
        for key, title, fmt in (("demand_hit_rate", "demand hits", ".3f"), ("pcie_experts_per_token", "moved/token", ".2f"),
                                ("tokens_per_s", "tokens/s", ".1f")):
            if s.get(key):
                lines.append(f"{title:<14}" + "".join(f"{c:>9}" for c in slots))
                for name, v in s[key].items():
                    lines.append(f"{name:<14}" + "".join(f"{'n/a' if v[c] is None else format(v[c], fmt):>9}" for c in slots))
    return "\n".join(lines)


def _write_out(out: Path, s: dict) -> None:
    """stats.json, hit_rates.csv and hit_rates.png in ``out`` (created; its parent exists), each
    written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = not out.exists()
    out.mkdir(exist_ok=True)
    rows = {"lru-reference": s["reference_lru"], **s["hit_rate"]}

    def csv_text() -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["policy", "slots", "hit_rate"])
        for name, v in rows.items():
            for c, r in v.items():
                w.writerow([name, c, "" if r is None else f"{r:.6f}"])
        return buf.getvalue()

    def plot(f):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, v in rows.items():
            pts = [(int(c), r) for c, r in v.items() if r is not None]
            if pts:
                style = dict(color="black", linestyle="--", label="belady (ceiling)") if name == "belady" else dict(label=name)
                ax.plot(*zip(*pts), marker="o", **style)
        ax.set_xlabel("cache slots per layer")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.set_title(f"{s['model']} ({s['phase']}, {s['rows']} rows)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(f, format="png", dpi=120)
        plt.close(fig)

    written = []
    try:
        for name, text in (("stats.json", json.dumps(s, indent=1) + "\n"), ("hit_rates.csv", csv_text())):
            atomic_write(out / name, text)
            written.append(out / name)
        with atomic_open(out / "hit_rates.png", "wb") as f:
            plot(f)
    except BaseException:  # all three files or none of this run's (a directory made for them removed)
        for p in written:
            p.unlink(missing_ok=True)
        if made and not any(out.iterdir()):
            out.rmdir()
        raise


def _stats(a) -> int:
    from traces.stats import summarize

    if a.out:
        check_output(a.out, "--out", is_dir=True)
        if not a.slots:
            raise ValueError("--out writes hit rates per cache size: give --slots too (e.g. --slots 8,16,32)")
    t = _load(a.path)
    if not len(t.rows(a.phase)):
        raise TraceError(f"{a.path or 'bundled trace'}: no {a.phase} rows")
    policies = [p for p in a.policies.split(",") if p]
    from scheduler import POLICIES

    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; expected some of {', '.join(POLICIES)}")
    s = summarize(t, a.phase, a.slots, policies, a.reset_per_sequence, progress=not a.quiet, timed=_timed(t, a.hardware))
    print(json.dumps(s, indent=1) if a.json else _table(s))
    if a.out:
        _write_out(Path(a.out), s)
    return 0


def _timed(trace: Trace, hardware: str | None):
    """``summarize``'s timed runs: the simulator on ``hardware`` with the trace's geometry."""
    from scheduler.costs import DEFAULT_HARDWARE
    from scheduler.hardware import load_hardware
    from simulate.evaluate import measure, trace_model

    hw = load_hardware(hardware or DEFAULT_HARDWARE)
    model = trace_model(trace)
    return lambda toks, name, slots: measure(toks, model, hw, name, slots)


def _fit(a) -> int:
    from traces.synth import fit, signature, calibration_error, generate

    if a.out:
        check_output(a.out, "--out")
    t = _load(a.path)
    params = fit(t, a.phase, a.slots, a.reset_per_sequence, seed=a.seed, progress=not a.quiet)
    out = {"params": asdict(params), "geometry": {"num_layers": len(t.moe_layers), "num_experts": max(t.num_experts),
                                                  "top_k": t.top_k}}
    part = t.select(a.phase if len(t.rows(a.phase)) else None)
    caps = a.slots or sorted({c for c in (max(1, t.top_k // 2), t.top_k, 2 * t.top_k, 3 * t.top_k) if c < max(t.num_experts)})
    n = len(part.sequences())
    synth = generate(len(t.moe_layers), max(t.num_experts), t.top_k, 4 * len(part), params,
                     np.random.default_rng(a.seed + 1), num_seqs=4 * n)
    out["check"] = calibration_error(signature(part, caps, None, a.reset_per_sequence),
                                     signature(synth, caps, None, a.reset_per_sequence))
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        atomic_write(a.out, text + "\n")
    return 0


def _synth(a) -> int:
    from traces.synth import PRESETS, SynthParams, generate

    check_trace_dest(a.dest, "DEST")
    if a.preset:
        if a.preset not in PRESETS:
            raise ValueError(f"--preset: unknown {a.preset!r}; expected one of {', '.join(PRESETS)}")
        pr = PRESETS[a.preset]
        geo = {"layers": pr.num_layers, "experts": pr.num_experts, "top_k": pr.top_k,
               "tokens": pr.num_seqs * pr.tokens_per_seq, "seqs": pr.num_seqs}
        params = pr.params
    else:
        geo = {"layers": None, "experts": None, "top_k": None, "tokens": None, "seqs": 1}
        params = SynthParams()
    if a.params:
        params, fitted = _read_params(a.params)
        for key, field in (("layers", "num_layers"), ("experts", "num_experts"), ("top_k", "top_k")):
            if geo[key] is None and field in fitted:
                geo[key] = fitted[field]
    for key in geo:
        v = getattr(a, key)
        if v is not None:
            geo[key] = v
    missing = ["--" + k.replace("_", "-") for k, v in geo.items() if v is None]
    if missing:
        raise ValueError(f"synth: give --preset, --params FIT.json (from moelab trace fit) or the geometry; "
                         f"missing {' '.join(missing)}")
    for key, v in geo.items():
        if v < 1:
            raise ValueError(f"--{key.replace('_', '-')} {v}: expected >= 1")
    if geo["experts"] > MAX_EXPERTS:
        raise ValueError(f"--experts {geo['experts']}: expected at most {MAX_EXPERTS} (16-bit expert ids)")
    if geo["top_k"] > geo["experts"]:
        raise ValueError(f"--top-k {geo['top_k']}: expected <= --experts {geo['experts']}")
    if geo["seqs"] > geo["tokens"]:
        raise ValueError(f"--seqs {geo['seqs']}: expected <= --tokens {geo['tokens']}")
    t = generate(geo["layers"], geo["experts"], geo["top_k"], geo["tokens"], params, np.random.default_rng(a.seed),
                 num_seqs=geo["seqs"], model=f"synthetic:{a.preset or 'custom'}",
                 progress=not a.quiet)
    t.meta["seed"] = a.seed
    t.save(a.dest)
    if not a.quiet:
        print(f"wrote {a.dest}: {t!r}", file=sys.stderr)
    return 0


def _read_params(path: str) -> tuple["SynthParams", dict]:
    """The parameters in ``path`` (``moelab trace fit``'s JSON, or bare parameters) and its
    ``geometry`` (empty when absent)."""
    from traces.synth import SynthParams

    try:
        d = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--params {path}: cannot read JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--params {path}: expected a JSON object (moelab trace fit --out)")
    geometry = d.get("geometry", {})
    params = d.get("params", d)
    if not isinstance(params, dict) or not isinstance(geometry, dict):
        raise ValueError(f"--params {path}: fields 'params' and 'geometry' must be JSON objects")
    try:
        params = SynthParams(**params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--params {path}: {e}") from None
    for key, v in geometry.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--params {path}: geometry.{key} {v!r}, expected an integer >= 1")
    return params, geometry


_COMMANDS = {"import": _import, "info": _info, "stats": _stats, "fit": _fit, "synth": _synth}


def main(argv: list[str] | None = None) -> int:
    """Run ``moelab trace`` with ``argv``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return _COMMANDS[a.cmd](a)
    except (TraceError, ValueError) as e:
        print(f"moelab trace {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"moelab trace {a.cmd}: error: {e.filename or _output_of(a)}: {e.strerror or e}", file=sys.stderr)
        return 2


def _output_of(a) -> str:
    """The path the command writes (named by an error that names no file)."""
    return str(getattr(a, "dest", None) or getattr(a, "out", None) or "")
