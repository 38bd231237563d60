"""``moelab simulate`` and ``moelab sweep``."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import ExitStack
from pathlib import Path

from scheduler import MISS_FRAC_256, POLICIES
from scheduler.args import ArgumentParser, int_at_least
from scheduler.files import check_output

from scheduler.hardware import HardwareError, hardware_presets, load_hardware
from scheduler.models import MODEL_PRESETS
from simulate.run import SimConfig, SimError, run

__all__ = ["simulate_main", "sweep_main"]

DEFAULTS = SimConfig()
DEFAULT_SWEEP_MIB = [768.0, 1024.0, 1536.0, 2048.0]  # every default policy runs at each (lru needs top-k slots)


def _cache_mib(text: str):
    if text == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB or 'auto', got {text!r}") from None
    if not 0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of MiB >= 0 or 'auto', got {text}")
    return v



def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction 0..1, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction 0..1, got {v}")
    return v


def _common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=None,
                    help="trace directory/file (default: the bundled granite-3.0-1b-a400m trace), or 'synth' "
                         "for a synthetic trace of the model's geometry")
    ap.add_argument("--phase", choices=("decode", "prefill", "all"), default="decode",
                    help="which trace rows to replay (default decode)")
    ap.add_argument("--tokens", type=int_at_least(1), default=None, help="replay at most N rows")
    ap.add_argument("--quant", default=None, help="expert quant type, overriding the model preset's (e.g. Q4_K)")
    ap.add_argument("--synth-tokens", type=int_at_least(1), default=DEFAULTS.synth_tokens,
                    help="rows of a synthetic trace")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="seed of a synthetic trace")
    ap.add_argument("--no-adaptive", action="store_true", help="hybrid without background fills and swaps")
    ap.add_argument("--pageable", action="store_true", help="uploads from pageable (not pinned) host memory")
    ap.add_argument("--lag-tokens", type=int_at_least(0), default=1,
                    help="tokens a background copy may overlap (default 1)")


def simulate_main(argv: list[str]) -> int:
    """Simulate one configuration and print its summary (or JSON)."""
    ap = ArgumentParser(
        prog="moelab simulate",
        description="Simulate decode of a routing trace under a cache policy on a hardware preset. With no "
                    "arguments: the bundled granite-3.0-1b-a400m trace, its model in f16 (2.25 GiB of experts) "
                    "with a 512 MiB expert cache (7 of 32 experts per layer) on the RTX 4060 Laptop preset, hybrid.")
    _common(ap)
    ap.add_argument("--model", default=DEFAULTS.model,
                    help=f"model preset ({', '.join(MODEL_PRESETS)}) or a .gguf file")
    ap.add_argument("--hardware", default=DEFAULTS.hardware,
                    help=f"hardware preset ({', '.join(hardware_presets())}) or a JSON file")
    ap.add_argument("--policy", default=DEFAULTS.policy,
                    help=f"one of {', '.join(POLICIES)} (default {DEFAULTS.policy}); static ranks by an oracle "
                         f"profile of the replayed rows, hybrid-cost splits from the simulator's costs")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--cache-slots", type=int_at_least(0), default=None, help="expert cache slots per MoE layer")
    size.add_argument("--cache-mib", type=_cache_mib, default=None,
                      help=f"expert cache budget in MiB, or 'auto' (default {DEFAULTS.cache_mib:g})")
    ap.add_argument("--miss-fraction", type=_fraction, default=None,
                    help=f"hybrid: a fixed share of a layer's distinct misses sent over PCIe (the seed's: "
                         f"{MISS_FRAC_256}/256 = {MISS_FRAC_256 / 256:.2f}); default: the share the hardware's "
                         f"cost model gives each step")
    ap.add_argument("--timeline", default=None, help="write a Chrome-trace JSON (Perfetto) of the run here")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--explain", action="store_true", help="after the summary, say what each figure means")
    ap.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    args = ap.parse_args(argv)
    try:
        if args.timeline:
            check_output(args.timeline, "--timeline")
        cfg = SimConfig(
            model=args.model, hardware=args.hardware, policy=args.policy, cache_slots=args.cache_slots,
            cache_mib=DEFAULTS.cache_mib if args.cache_mib is None else args.cache_mib,
            miss_fraction=args.miss_fraction, adaptive=not args.no_adaptive, tokens=args.tokens, trace=args.trace,
            phase=args.phase, expert_quant=args.quant, synth_tokens=args.synth_tokens, seed=args.seed,
            lag_tokens=args.lag_tokens, pinned=not args.pageable)
        from simulate.run import build_capacity, load_tokens

        model = _model_of(cfg)
        hw = load_hardware(cfg.hardware)
        build_capacity(cfg, model, hw)  # a cache the GPU cannot hold is refused before the trace is read
        tokens = load_tokens(cfg, model, progress=not args.quiet)  # opened and checked before the bar starts
        with _bar("simulate", len(tokens), "token", args.quiet) as bar:
            result, info = run(cfg, record=bool(args.timeline), hardware=hw, model=model,
                               tokens=_Counted(tokens, bar))
        s = result.summary()
        if args.timeline:
            from simulate.timeline import write_chrome_trace

            n = write_chrome_trace(result.events, args.timeline,
                                   title=f"{cfg.model} / {cfg.hardware} / {cfg.policy}")
            if not args.quiet:
                print(f"timeline: {n} spans -> {args.timeline}", file=sys.stderr)
    except (SimError, HardwareError, ValueError) as e:
        print(f"moelab simulate: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"moelab simulate: {e.filename or args.timeline or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": cfg.as_row(), **info, **s}, sort_keys=True))
        return 0
    print(f"{cfg.model} ({info['model_expert_mib'] / 1024:.2f} GiB of experts) on {cfg.hardware}, policy {cfg.policy}, "
          f"cache {info['cache_mib']:.0f} MiB = {info['slots_per_layer']}/{info['num_experts']} experts per layer")
    print(f"  trace: {_trace_name(cfg)}, {cfg.phase} rows")
    print(f"  {s['tokens']} tokens: {s['tokens_per_s']:.1f} tokens/s simulated, analytic bound "
          f"{s['bound_tokens_per_s']:.1f} tokens/s; p50 {s['p50_token_s'] * 1e3:.2f} ms, p99 {s['p99_token_s'] * 1e3:.2f} ms")
    print(f"  hit rate {s['hit_rate']:.1%}; uploads {s['uploads']}, streams {s['streams']}, CPU experts "
          f"{s['cpu_experts']}, fills {s['fills']}, swaps {s['swaps']}; {s['upload_bytes'] / 2**20:.0f} MiB over PCIe")
    print(f"  busy: GPU {s['gpu_busy']:.0%}, PCIe {s['pcie_busy']:.0%}, CPU {s['cpu_busy']:.0%}")
    print(GLOSSARY if args.explain else "  (--explain says what each figure means)")
    return 0


GLOSSARY = """\
  analytic bound: tokens/s if each layer took only its busiest resource's work (GPU, PCIe copies or
    CPU pool, perfectly overlapped, no latency between them); the simulation is at most the bound
  hit rate: share of routed experts already in the GPU cache
  uploads: misses copied over PCIe into a cache slot (then run on the GPU, and kept)
  streams: misses copied into a scratch buffer, run on the GPU, and dropped
  CPU experts: misses computed from host RAM by the CPU pool, in parallel with the GPU
  fills, swaps: background copies between tokens: a fill loads an expert into a free slot, a swap
    replaces a resident one
  busy: share of the simulated time each resource was working"""


def _bar(desc: str, total: int, unit: str, quiet: bool):
    """The commands' progress bar on stderr (disabled by ``--quiet``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=quiet, file=sys.stderr, dynamic_ncols=True)


class _Counted:
    """Re-iterable ``tokens`` that advance ``bar`` as they are consumed; each pass restarts it (the
    static and belady policies read the tokens once before the simulation does)."""

    def __init__(self, tokens, bar):
        self.tokens, self.bar = tokens, bar

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self):
        self.bar.reset()
        for t in self.tokens:
            yield t
            self.bar.update()


def _trace_name(cfg: SimConfig) -> str:
    if cfg.trace == "synth":
        return f"synthetic ({cfg.synth_tokens} rows, seed {cfg.seed})"
    return cfg.trace or "bundled granite-3.0-1b-a400m recording"


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or not all(0 <= v < math.inf for v in out):
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated finite numbers >= 0, got {text!r}")
    return out


def _names(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated names, got {text!r}")
    return out


def sweep_main(argv: list[str]) -> int:
    """Run the product of the given axes into a resumable CSV, then plot it.

    Exit 0 when every row of the CSV ran, 1 when any failed (their errors printed), 2 for bad
    arguments (checked before any config runs), 130 on Ctrl-C (the rows finished are kept)."""
    from simulate.sweep import Sweep, config_key, expand, locked, plot_results

    ap = ArgumentParser(
        prog="moelab sweep",
        description="Simulate cache sizes x policies x miss fractions x hardware x models; one CSV row per "
                    "config, resumable (finished configs are skipped), plots of tokens/s and hit rate.")
    _common(ap)
    ap.add_argument("--models", type=_names, default=[DEFAULTS.model], help="comma-separated model presets")
    ap.add_argument("--hardware", type=_names, default=[DEFAULTS.hardware], help="comma-separated hardware presets")
    ap.add_argument("--policies", type=_names, default=["lru", "hybrid", "static", "cpu"],
                    help="comma-separated policies")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--cache-mib", type=_floats, default=None,
                      help=f"comma-separated cache budgets in MiB (default {','.join(f'{v:g}' for v in DEFAULT_SWEEP_MIB)})")
    size.add_argument("--cache-slots", type=_floats, default=None, help="comma-separated slots per layer")
    ap.add_argument("--miss-fractions", type=_floats, default=[MISS_FRAC_256 / 256],
                    help="hybrid miss fractions, comma-separated")
    ap.add_argument("--out", default="sweep", help="output directory (results.csv and PNG plots; its parent must exist)")
    ap.add_argument("--jobs", type=int_at_least(1), default=os.cpu_count() or 1, help="local worker processes")
    ap.add_argument("--dask", default=None, metavar="ADDRESS", help="run on a Dask distributed scheduler instead")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    args = ap.parse_args(argv)
    unit = "slots" if args.cache_slots is not None else "mib"
    caches = args.cache_slots if unit == "slots" else (args.cache_mib or DEFAULT_SWEEP_MIB)
    common = dict(adaptive=not args.no_adaptive, tokens=args.tokens, trace=args.trace, phase=args.phase,
                  expert_quant=args.quant, synth_tokens=args.synth_tokens, seed=args.seed, lag_tokens=args.lag_tokens,
                  pinned=not args.pageable)
    out = Path(args.out)
    made, sweep = not out.exists(), None
    with ExitStack() as stack:  # plots are written under the lock too
        try:
            check_output(out, "--out", is_dir=True)
            configs = expand(args.models, args.hardware, args.policies, caches, args.miss_fractions, unit, **common)
            _check_axes(configs)
            out.mkdir(exist_ok=True)
            stack.callback(_remove_if_empty, out, made)
            stack.enter_context(locked(out))
            sweep = Sweep(out / "results.csv")
            before = len(sweep.done())
            ran = sweep.run(configs, jobs=args.jobs, dask_address=args.dask, progress=not args.quiet)
        except (SimError, HardwareError, ValueError) as e:
            print(f"moelab sweep: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            raise
        except OSError as e:
            print(f"moelab sweep: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if sweep is None:
                raise
            print(f"\nmoelab sweep: interrupted; {len(sweep.rows)} rows kept in {sweep.path} "
                  f"({len(sweep.rows) - before} new); run the same command to resume", file=sys.stderr)
            return 130
        keys = {config_key(c) for c in configs}
        errors = [r for r in sweep.rows if r.get("error") and r["key"] in keys]
        if errors or not args.quiet:
            print(f"{len(configs)} configs: {ran} run, {len(configs) - ran} already in {sweep.path} "
                  f"({before} rows before); {len(errors)} failed", file=sys.stderr)
        for r in errors[:5]:
            print(f"  config {r['key']} ({r['model']}, {r['hardware']}, {r['policy']}): {r['error']}", file=sys.stderr)
        if not args.no_plots:
            for p in plot_results(sweep.rows, out, unit):
                if not args.quiet:
                    print(f"plot: {p}", file=sys.stderr)
        return 1 if errors else 0


def _remove_if_empty(out: Path, made: bool) -> None:
    """The sweep's directory, removed when this command made it and wrote nothing but its lock."""
    from simulate.sweep import LOCK_NAME

    if made and out.is_dir() and {p.name for p in out.iterdir()} <= {LOCK_NAME}:
        (out / LOCK_NAME).unlink(missing_ok=True)
        out.rmdir()


def _model_of(cfg: SimConfig):
    """The config's model: a preset, or a ``.gguf`` file's geometry read by the executor's parser."""
    if not str(cfg.model).endswith(".gguf"):
        from simulate.run import _model

        return _model(cfg)
    from execute.model_spec import resolve_model

    m = resolve_model(cfg.model)
    return m.with_quant(cfg.expert_quant) if cfg.expert_quant else m


def _check_axes(configs) -> None:
    """Each model, hardware and the trace of ``configs`` opened once, and each model's geometry
    checked against the trace, before any config runs (raises SimError, HardwareError, ValueError)."""
    from scheduler.hardware import load_hardware
    from simulate.run import _model, load_tokens

    seen_hw, seen_model = set(), set()
    for cfg in configs:
        if cfg.hardware not in seen_hw:
            load_hardware(cfg.hardware)
            seen_hw.add(cfg.hardware)
        key = (cfg.model, cfg.expert_quant)
        if key not in seen_model:
            load_tokens(cfg, _model(cfg))
            seen_model.add(key)
