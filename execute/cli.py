"""``moelab model`` (synth, info), ``moelab replay`` and ``moelab run``: the executor's commands.

Errors in the input (a bad GGUF file, a trace of another geometry, a policy that needs a GPU on a
machine without one) print one line naming what was wrong and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scheduler import MISS_FRAC_256
from scheduler.args import ArgumentParser
from scheduler.files import OutputPathError, check_output

from .experts import ExecutorError

__all__ = ["model_main", "replay_main", "run_main", "run_figures"]


class _Fail(Exception):
    """A user error: message printed, exit 2."""


def _parser_model() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moelab model", description="Synthesise or describe GGUF MoE models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    from .archs import ARCHS

    s = sub.add_parser("synth", help="write a GGUF MoE model with random weights")
    s.add_argument("out", help="output .gguf path (written atomically)")
    s.add_argument("--arch", default="qwen3moe", choices=tuple(ARCHS), help="architecture (default qwen3moe)")
    s.add_argument("--preset", default="tiny", help="geometry preset the options below override: tiny, qwen3-30b-a3b")
    for flag, field, help_ in (("--layers", "num_layers", "blocks"), ("--experts", "num_experts", "experts per block"),
                               ("--top-k", "top_k", "experts per token"), ("--hidden", "hidden", "embedding width"),
                               ("--ffn", "ffn", "expert hidden width"), ("--heads", "num_heads", "attention heads"),
                               ("--kv-heads", "num_kv_heads", "KV heads"), ("--head-dim", "head_dim", "head width"),
                               ("--vocab", "vocab", "vocabulary size (>= 260)"),
                               ("--context", "context_length", "context length (metadata)")):
        s.add_argument(flag, dest=field, type=int, default=None, help=help_)
    s.add_argument("--quant", required=True, help="expert quant type: F32 F16 BF16 Q8_0 Q4_0 Q4_K Q6_K MXFP4")
    s.add_argument("--dense-quant", default=None, help="type of dense matrices: F16 (default), F32, BF16, Q8_0")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    i = sub.add_parser("info", help="geometry, quant types and expert sizes (metadata and tensor table only)")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    return p


def _synth(args) -> int:
    from .synth import config_from_preset, synth_model

    try:
        cfg = config_from_preset(args.preset, arch=args.arch, quant=args.quant, dense_quant=args.dense_quant,
                                 seed=args.seed, **{k: getattr(args, k) for k in (
                                     "num_layers", "num_experts", "top_k", "hidden", "ffn", "num_heads",
                                     "num_kv_heads", "head_dim", "vocab", "context_length")})
    except (ValueError, TypeError) as exc:
        raise _Fail(f"moelab model synth: {exc}") from None
    try:
        out = check_output(args.out, "OUT")
    except OutputPathError as exc:
        raise _Fail(f"moelab model synth: {exc}") from None
    synth_model(out, cfg, progress=not args.quiet)
    print(f"wrote {out}: {cfg.arch} {cfg.num_layers} layers x {cfg.num_experts} experts top-{cfg.top_k}, "
          f"hidden {cfg.hidden}, ffn {cfg.ffn}, {cfg.quant} experts "
          f"({cfg.expert_bytes * cfg.num_experts * cfg.num_layers / 2**20:.1f} MiB), seed {cfg.seed}")
    return 0


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _info(args) -> int:
    from .gguf_io import llamacpp_problems, read_model_info

    info = read_model_info(args.file)
    d = info.to_dict()
    d["llamacpp_problems"] = llamacpp_problems(args.file)
    for problem in d["llamacpp_problems"]:
        print(f"moelab: warning: llama.cpp would refuse this file: {problem}", file=sys.stderr)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    eb = sorted(set(b for b in info.expert_bytes if b))
    print(f"{info.path}: {info.arch}")
    print(f"  layers {info.num_layers}, experts {sorted(set(info.num_experts))} per layer, top-{info.top_k}"
          f"{' (renormalised)' if info.norm_topk else ''}")
    print(f"  hidden {info.hidden}, expert ffn {info.ffn}, heads {info.num_heads} (kv {info.num_kv_heads}, "
          f"dim {info.head_dim}), vocab {info.vocab}, context {info.context_length}")
    print(f"  rope theta {info.rope_theta:g}, rms eps {info.rms_eps:g}, qk-norm {info.qk_norm}, "
          f"tied output {info.tied_output}, shared expert ffn {info.shared_ffn}")
    print(f"  routing {info.gating}, weights scale {info.expert_weights_scale:g}, groups {info.expert_groups_used}/"
          f"{info.expert_groups}; attention {info.spec.attn}, rope {info.spec.rope} ({info.rope_scaling}), "
          f"sliding window {info.sliding_window}; leading dense blocks {info.leading_dense}")
    print(f"  expert quant types: {', '.join(d['expert_qtypes'])}; all tensors: "
          + ", ".join(f"{k} x{v}" for k, v in sorted(d["tensor_qtypes"].items())))
    print(f"  bytes per expert: {', '.join(_fmt_bytes(b) for b in eb)} ({eb[0] if len(eb) == 1 else eb} B)")
    print(f"  total expert bytes: {_fmt_bytes(info.total_expert_bytes)} ({info.total_expert_bytes} B)")
    return 0


def _guard(fn, args) -> int:
    from .gguf_io import GGUFError

    try:
        return fn(args)
    except _Fail as exc:
        print(exc, file=sys.stderr)
        return 2
    except (GGUFError, ExecutorError) as exc:
        print(f"moelab: {exc}", file=sys.stderr)
        return 2


def model_main(argv: list[str]) -> int:
    """``moelab model synth|info``."""
    args = _parser_model().parse_args(argv)
    return _guard(_synth if args.cmd == "synth" else _info, args)


# replay ---------------------------------------------------------------------------------------------
def _parser_replay() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moelab replay", description=(
        "Run a routing trace through the model's real forward pass, experts placed by a policy."))
    p.add_argument("model", help="GGUF model")
    p.add_argument("--trace", default=None, help="trace directory (default: the bundled granite trace)")
    p.add_argument("--policy", required=True, help="cpu, gpu, lru, freq-lru, static, hybrid, hybrid-cost, belady")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or JSON file (moelab simulate's format) for --policy hybrid-cost's cost model")
    p.add_argument("--cache-mib", type=float, default=None, help="GPU expert cache budget, MiB")
    p.add_argument("--pageable", action="store_true",
                   help="do not page-lock the weights (as when the host cannot pin the model): uploads are "
                        "copies from pageable memory, staged by the CUDA driver, the host thread waiting for each; "
                        "hybrid-cost's cost model then takes the hardware's pageable link rate")
    p.add_argument("--cache-slots", type=int, default=None, help="GPU expert cache slots per layer (instead of MiB)")
    p.add_argument("--threads", type=int, default=None, help="CPU expert threads (default: all cores)")
    p.add_argument("--tokens", type=int, default=None, help="replay at most N trace rows")
    p.add_argument("--phase", choices=("prefill", "decode"), default=None, help="only rows of this phase")
    p.add_argument("--map", action="store_true", help="fold the trace's layers/experts onto the model's geometry")
    p.add_argument("--profile", default=None, help="STRP profile (static, hybrid pre-population)")
    p.add_argument("--lag-tokens", type=int, default=1, help="background copies complete this many tokens later")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input token ids")
    p.add_argument("--timeout-s", type=float, default=60.0, help="an expert step that takes longer is an error")
    p.add_argument("--backend", choices=("engine", "numpy"), default="engine",
                   help="experts on the expert engine (GPU kernels + Numba CPU pool), or numpy reference (cpu only)")
    p.add_argument("--cpu-dense", action="store_true",
                   help="with --policy cpu, run the dense path on the CPU too (default: on the GPU when one is present)")
    p.add_argument("--audit", default=None, help="write the per-token audit JSONL (with routes) here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    return p


def _check_common(args, prog: str) -> None:
    """The arguments ``run`` and ``replay`` share, checked before the model is loaded."""
    from scheduler import POLICIES

    if args.policy not in POLICIES:
        raise _Fail(f"{prog}: --policy {args.policy!r}: expected one of {', '.join(POLICIES)}")
    if args.cpu_dense and args.policy != "cpu":
        raise _Fail(f"{prog}: --cpu-dense: only with --policy cpu (policy {args.policy!r} runs experts on the GPU)")
    if args.threads is not None:
        import numba

        if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
            raise _Fail(f"{prog}: --threads {args.threads}: expected 1..{numba.config.NUMBA_NUM_THREADS} "
                        f"(this machine's cores)")
    for flag, value, ok, want in (("--cache-mib", args.cache_mib, lambda v: v >= 0, ">= 0"),
                                  ("--cache-slots", args.cache_slots, lambda v: v >= 0, ">= 0"),
                                  ("--timeout-s", args.timeout_s, lambda v: v > 0, "> 0 seconds"),
                                  ("--lag-tokens", args.lag_tokens, lambda v: v >= 0, ">= 0")):
        if value is not None and not ok(value):
            raise _Fail(f"{prog}: {flag} {value}: expected {want}")
    try:
        if args.audit:
            check_output(args.audit, "--audit")
        if getattr(args, "record_trace", None):
            from traces.format import check_trace_dest

            check_trace_dest(args.record_trace, "--record-trace")
    except (OutputPathError, ValueError) as exc:
        raise _Fail(f"{prog}: {exc}") from None
    if getattr(args, "profile", None):
        from scheduler.profile import read_strp

        try:
            read_strp(args.profile)
        except (ValueError, OSError) as exc:
            raise _Fail(f"{prog}: --profile: {exc}") from None


def _capacity(args, geometry, prog: str = "moelab replay"):
    from scheduler import Capacity
    from scheduler.core import CapacityError

    if args.cache_slots is not None and args.cache_mib is not None:
        raise _Fail(f"{prog}: give --cache-mib or --cache-slots, not both")
    try:
        if args.cache_slots is not None:
            return Capacity.per_layer(geometry, args.cache_slots)
        if args.cache_mib is None:
            if args.policy == "cpu":
                return Capacity.per_layer(geometry, 0)
            if args.policy == "gpu":  # every expert resident
                return Capacity.per_layer(geometry, list(geometry.num_experts))
            raise _Fail(f"{prog}: policy {args.policy!r} needs --cache-mib or --cache-slots")
        return Capacity.from_mib(geometry, args.cache_mib)
    except (ValueError, CapacityError) as exc:
        raise _Fail(f"{prog}: {exc}") from None


def _load_trace(args, info):
    import traces

    from .model import check_trace, fold_trace

    try:
        trace = traces.load(args.trace, check=True)
    except (traces.TraceError, OSError) as exc:
        raise _Fail(f"moelab replay: --trace: {exc}") from None
    if args.map:
        return fold_trace(trace, info)
    check_trace(trace, info)
    return trace


def _cost_options(args, prog: str) -> dict:
    """``cost_model=`` for ``hybrid-cost``, from ``--hardware`` and the model file's geometry."""
    if args.policy != "hybrid-cost":
        if args.hardware:
            raise _Fail(f"{prog}: --hardware is used only by --policy hybrid-cost")
        return {}
    from scheduler.costs import Costs, ExecConfig
    from scheduler.hardware import hardware_presets, load_hardware
    from .model_spec import model_spec

    if not args.hardware:
        raise _Fail(f"{prog}: policy 'hybrid-cost' needs --hardware NAME|FILE for its cost model (a preset: "
                    f"{', '.join(hardware_presets())}; or a hardware JSON, e.g. from moelab calibrate)")
    try:
        cfg = ExecConfig(pinned=not args.pageable)  # the link rate the uploads will see
        return {"cost_model": Costs(model_spec(args.model), load_hardware(args.hardware), cfg).cost_model()}
    except ValueError as exc:
        raise _Fail(f"{prog}: --hardware {args.hardware}: {exc}") from None


def _profile(args, geometry, prog: str):
    """The ``--profile`` STRP file checked against the model's geometry, or None."""
    if not args.profile:
        return None
    from scheduler.profile import read_strp

    try:
        profile = read_strp(args.profile)
        profile.check_geometry(geometry)
    except (ValueError, OSError) as exc:
        raise _Fail(f"{prog}: --profile: {exc}") from None
    return profile


def _policy(args, trace, geometry, capacity):
    from scheduler import make_policy
    from scheduler.core import CapacityError

    profile = _profile(args, geometry, "moelab replay")
    future = None
    if args.policy == "belady":
        future = [s for tok in trace.tokens(args.phase, 0, args.tokens) for s in tok.steps]
    options = _cost_options(args, "moelab replay")
    try:
        return make_policy(args.policy, geometry, capacity, profile=profile, future=future, **options)
    except (ValueError, CapacityError) as exc:
        raise _Fail(f"moelab replay: {exc}") from None


def _use_gpu(args) -> bool:
    """Whether the dense path and the expert engine use the GPU: always for policies with GPU
    experts; for ``cpu`` (every expert on the CPU pool, as llama.cpp's ``--cpu-moe``) when a CUDA
    device is present, unless ``--backend numpy`` or ``--cpu-dense`` asks for a host-only run."""
    if args.policy != "cpu":
        return True
    if args.backend == "numpy" or getattr(args, "cpu_dense", False):
        return False
    try:
        from .gpu_experts import gpu_available
    except ImportError:  # no cupy
        return False
    return gpu_available()


def _backend(args, weights, use_gpu: bool, capacity, prog: str = "moelab replay"):
    import os

    from . import model as M

    if args.pageable and args.policy == "cpu":
        raise _Fail(f"{prog}: --pageable changes how experts are uploaded to the GPU; policy 'cpu' uploads none")
    if args.backend == "numpy":
        if use_gpu:
            raise _Fail(f"{prog}: --backend numpy runs only policy 'cpu'")
        return M.NumpyExperts(weights)
    return M.EngineExperts(weights, capacity, args.threads or os.cpu_count() or 1, use_gpu, args.timeout_s,
                           pinned=not args.pageable and args.policy != "cpu")


def _replay(args) -> int:
    from scheduler.audit import Audit

    from . import model as M
    from .gguf_io import load_model

    _check_common(args, "moelab replay")
    if args.tokens is not None and args.tokens < 1:
        raise _Fail(f"moelab replay: --tokens {args.tokens}: expected >= 1")
    weights = load_model(args.model)
    info = weights.info
    trace = _load_trace(args, info)
    from scheduler import Geometry

    geometry = Geometry(info.num_experts, trace.top_k, info.expert_bytes)
    capacity = _capacity(args, geometry)
    policy = _policy(args, trace, geometry, capacity)
    use_gpu = _use_gpu(args)
    backend = _backend(args, weights, use_gpu, capacity)
    model = M.MoeModel(weights, use_gpu=use_gpu)
    audit = Audit(geometry, keep_log=True, record_routes=args.audit is not None)
    n = len(trace.rows(args.phase)) if args.tokens is None else min(args.tokens, len(trace.rows(args.phase)))
    from tqdm import tqdm

    bar = tqdm(total=n, unit="token", desc="replay", disable=args.quiet, file=sys.stderr, dynamic_ncols=True)
    try:
        res = M.run(model, backend, policy, M.trace_inputs(trace, info, args.phase, 0, args.tokens, args.seed),
                    args.lag_tokens, audit, progress=lambda i: bar.update(i - bar.n))
    finally:
        bar.close()
        backend.close()
    summary = audit.summary()
    out = {"model": str(args.model), "trace": trace.model, "policy": args.policy,
           "cache_slots": max((s for _, s in capacity.pools), default=0), "cache_mib": capacity.slot_bytes(geometry) / 2**20,
           "digest": audit.digest(), **summary, **res.summary()}
    if args.audit:
        audit.write_jsonl(args.audit, run={k: out[k] for k in ("model", "trace", "policy", "cache_mib", "digest")})
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.policy}: {res.tokens} tokens in {res.wall_s:.2f} s = {res.tokens_per_s:.1f} tokens/s; "
          f"hit rate {summary['hit_rate']:.3f}; uploaded {summary['upload_mib']:.1f} MiB; "
          f"cache {out['cache_mib']:.1f} MiB")
    print(f"  per token: dense {out['dense_ms_per_token']:.2f} ms, experts {out['experts_ms_per_token']:.2f} ms, "
          f"other {out['other_ms_per_token']:.2f} ms")
    print("  layer  dense_ms  experts_ms")
    for row in out["per_layer_ms_per_token"]:
        print(f"  {row['layer']:5d}  {row['dense']:8.3f}  {row['experts']:10.3f}")
    print(f"  decision digest {out['digest'][:16]}")
    return 0


def replay_main(argv: list[str]) -> int:
    """``moelab replay MODEL.gguf --trace PATH --policy P --cache-mib N ...``."""
    args = _parser_replay().parse_args(argv)
    return _guard(_replay, args)


# run ------------------------------------------------------------------------------------------------
def _parser_run() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moelab run", description=(
        "Decode text with a GGUF MoE model, experts placed by a policy; streams the text, then prints "
        "prompt and decode speed, hit rate and bytes uploaded."))
    p.add_argument("model", help="GGUF model")
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("-n", "--tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--policy", default="cpu", help="cpu (default), gpu, lru, freq-lru, static, hybrid, hybrid-cost")
    p.add_argument("--cache-mib", type=float, default=None, help="GPU expert cache budget, MiB")
    p.add_argument("--cache-slots", type=int, default=None, help="GPU expert cache slots per layer (instead of MiB)")
    p.add_argument("--profile", default=None, help="STRP profile (static, hybrid pre-population)")
    p.add_argument("--threads", type=int, default=None, help="CPU expert threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy, the default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the file's chat template")
    p.add_argument("--lag-tokens", type=int, default=1, help="background copies complete this many tokens later")
    p.add_argument("--timeout-s", type=float, default=60.0, help="an expert step that takes longer is an error")
    p.add_argument("--backend", choices=("engine", "numpy"), default="engine",
                   help="experts on the expert engine (GPU kernels and CPU pool), or the numpy reference (cpu only)")
    p.add_argument("--cpu-dense", action="store_true",
                   help="with --policy cpu, run the dense path on the CPU too (default: on the GPU when one is present)")
    p.add_argument("--prefill-chunk", type=int, default=32,
                   help="prompt tokens run as one batch (default 32; 1: token by token)")
    p.add_argument("--speculative", type=int, default=0, metavar="N",
                   help="prompt-lookup speculative decoding with drafts of up to N tokens (1-4; 0: off, the default)")
    p.add_argument("--compare", action="store_true",
                   help="with --speculative: also decode plainly (same policy, fresh state) and print both speeds")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or JSON file (moelab simulate's format) for --policy hybrid-cost's cost model")
    p.add_argument("--pageable", action="store_true",
                   help="do not page-lock the weights (as when the host cannot pin the model): uploads are "
                        "copies from pageable memory, staged by the CUDA driver, the host thread waiting for each; "
                        "hybrid-cost's cost model then takes the hardware's pageable link rate")
    p.add_argument("--miss-fraction", type=float, default=None,
                   help=f"--policy hybrid: share of distinct misses sent over PCIe (default {MISS_FRAC_256}/256)")
    p.add_argument("--audit", default=None, help="write the per-batch audit JSONL (with routes) here")
    p.add_argument("--record-trace", default=None, help="write the routing as a trace directory (traces/ format)")
    p.add_argument("--router-predictor", action="store_true",
                   help="measure each next block's router on the current hidden state as a predictor of its "
                        "experts (recall at k and 2k, in --json as router_predictor; adds a router product "
                        "and a host wait per block)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON after the text")
    p.add_argument("--quiet", action="store_true",
                   help="nothing on stderr but errors (the text still streams to stdout)")
    return p


def _run_policy(args, geometry, capacity):
    from scheduler import make_policy
    from scheduler.core import CapacityError

    if args.policy == "belady":
        raise _Fail("moelab run: policy 'belady' needs the future routing, which a live run does not know; "
                    "record a trace (--record-trace) and use moelab replay or simulate")
    profile = _profile(args, geometry, "moelab run")
    options = _cost_options(args, "moelab run")
    if args.miss_fraction is not None:
        if args.policy != "hybrid" or not 0.0 <= args.miss_fraction <= 1.0:
            raise _Fail(f"moelab run: --miss-fraction {args.miss_fraction}: expected 0..1, with --policy hybrid")
    try:
        return make_policy(args.policy, geometry, capacity, profile=profile, miss_fraction=args.miss_fraction,
                           **options)
    except (ValueError, CapacityError) as exc:
        raise _Fail(f"moelab run: {exc}") from None


def _prompt_ids(args, tok) -> list[int]:
    text = None if args.raw else tok.chat_prompt(args.prompt)
    if text is None and not args.raw and tok.chat_template and not args.quiet:
        print("moelab run: the file's chat template has no shape moelab knows; prompt used as is", file=sys.stderr)
    ids = tok.encode(args.prompt) if text is None else tok.encode(text, special=True)
    if not ids:
        raise _Fail("moelab run: the prompt encodes to no tokens")
    return ids


class _Generation:
    """Inputs of the prompt (prefill, in chunks of ``chunk`` tokens), then of the decode steps,
    chosen from the model's logits when the previous batch ends; streams the text to ``out``.

    Decode: plain (one token per step), or with ``draft_len`` > 0 prompt-lookup drafts verified in
    one batch (``execute.speculative``; a step without a draft runs one token). ``batches`` holds
    each input's (tokens, phase), for the recorded trace."""

    def __init__(self, model, tok, sampler, prompt: list[int], n: int, out, chunk: int = 1, draft_len: int = 0):
        self.model, self.tok, self.sampler, self.prompt, self.n, self.out = model, tok, sampler, prompt, n, out
        self.chunk, self.draft_len = chunk, draft_len
        self.generated: list[int] = []
        self.stream = tok.stream()
        self.stopped = False
        self.batches: list[tuple[int, str]] = []
        self.decode_steps = self.drafted = self.accepted = 0
        self.weights = None

    def _emit(self, t: int) -> bool:
        """Stream ``t``; True when generation is over (an end token, or ``n`` reached)."""
        if not self.generated:
            import time

            self.first_token_at = time.perf_counter()
        self.generated.append(t)
        text = self.stream.add(t)
        if text:
            self.out.write(text)
            self.out.flush()
        if t in self.tok.stop_ids:
            self.stopped = True
        return self.stopped or len(self.generated) >= self.n

    def _input(self, index: int, pos: int, phase: str, ids: list[int], all_logits: bool = False):
        from .model import ChunkInput, TokenInput

        self.batches.append((len(ids), phase))
        if len(ids) == 1:
            return TokenInput(index, 0, pos, phase, int(ids[0]))
        return ChunkInput(index, 0, pos, phase, tuple(int(t) for t in ids), None, all_logits)

    def _logits(self, rows: bool = False):
        import numpy as np

        a = self.model.chunk_logits if rows else self.model.logits
        a = a.get() if hasattr(a, "get") else a
        if not np.isfinite(a).all():
            where = _non_finite_tensor(self.weights) if self.weights is not None else None
            raise _Fail(f"moelab run: the model's output after position {self.model.pos - 1} is not finite "
                        f"(NaN or Inf); " + (f"tensor {where} holds non-finite values" if where else
                                             "no dense tensor holds NaN/Inf, so a routed expert's weights may"))
        return a

    def __iter__(self):
        from .speculative import lookup_draft, verify

        index = 0
        for i in range(0, len(self.prompt), self.chunk):
            yield self._input(index, i, "prefill", self.prompt[i:i + self.chunk])
            index += 1
        if self.n <= 0 or self._emit(self.sampler(self._logits())):
            return
        pos = len(self.prompt)
        while True:
            budget = min(self.draft_len, self.n - len(self.generated) - 1)
            draft = lookup_draft(self.prompt + self.generated, budget) if budget > 0 else []
            yield self._input(index, pos, "decode", [self.generated[-1], *draft], all_logits=bool(draft))
            index += 1
            self.decode_steps += 1
            if draft:
                produced = verify(self.sampler, draft, self._logits(rows=True))
                self.drafted += len(draft)
                self.accepted += len(produced) - 1
            else:
                produced = [self.sampler(self._logits())]
            pos += len(produced)  # a rejected draft's positions are rolled back by the next input
            for t in produced:
                if self._emit(t):
                    return


def _non_finite_tensor(weights) -> str | None:
    """The name of the first dense tensor of ``weights`` (in file order: embedding, blocks, head)
    holding NaN or Inf, or None; read only once the output has been found non-finite."""
    import numpy as np

    named = [("token_embd", weights.token_embd)]
    for l, layer in enumerate(weights.layers):
        for field, v in vars(layer).items():
            for part, arr in (v.items() if isinstance(v, dict) else [("", v)]):
                if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                    named.append((f"blk.{l}.{field}{'.' + part if part else ''}", arr))
    named += [("output_norm", weights.output_norm), ("output", weights.output)]
    return next((name for name, arr in named if not np.isfinite(arr).all()), None)


def _batch_positions(route_log: list, gen: _Generation) -> list:
    """``route_log`` (one entry per position run) split into the generation's batches, for the
    audit: a multi-token batch then imports as one trace row per position."""
    out, i = [], 0
    for n, _ in gen.batches:
        out.append(route_log[i:i + n])
        i += n
    return out


def _record_trace(path: str, model, gen: _Generation, info, name: str) -> None:
    """The routing of every position run (rejected drafts too), one row each, with the batches
    in ``meta["batches"]`` (``execute.model.trace_batches``)."""
    import numpy as np

    from traces import Trace

    rows = model.route_log
    T, L, k = len(rows), info.num_layers, info.top_k
    ids = np.full((T, L, k), -1, np.int32)
    w = np.full((T, L, k), np.nan, np.float32)
    for t, (_, routes) in enumerate(rows):
        for layer, experts, weights in routes:
            ids[t, layer, : len(experts)] = experts
            w[t, layer, : len(weights)] = weights
    phase = np.array([int(ph == "decode") for n, ph in gen.batches for _ in range(n)], np.int8)
    pos = np.array([p for p, _ in rows], np.int32)
    meta = {"source": "moelab run", "prompt_tokens": len(gen.prompt), "prefill_chunk": gen.chunk,
            "speculative": gen.draft_len, "batches": [n for n, _ in gen.batches]}
    Trace(name, info.num_experts, k, ids, np.zeros(T, np.int32), pos, phase, w, meta).save(path)


def _generate(args, weights, tok, prompt: list[int], draft_len: int, stream, record: bool = False):
    """One generation under a fresh policy, backend and model; -> (figures, generation, model, audit)."""
    import time

    from scheduler.audit import Audit

    from . import model as M
    from .sampling import Sampler

    info = weights.info
    geometry = info.geometry()
    capacity = _capacity(args, geometry, "moelab run")
    policy = _run_policy(args, geometry, capacity)
    use_gpu = _use_gpu(args)
    backend = _backend(args, weights, use_gpu, capacity, "moelab run")
    model = M.MoeModel(weights, use_gpu=use_gpu, max_tokens=len(prompt) + args.tokens + draft_len)
    if record:
        model.route_log = []
    if getattr(args, "router_predictor", False):
        model.router_predictor = M.RouterPredictor(info)
    audit = Audit(geometry, profile_residents=policy.cache.slot.keys(), keep_log=True, record_routes=True)
    gen = _Generation(model, tok, Sampler(args.temp, args.seed, args.top_k), prompt, args.tokens, stream,
                      args.prefill_chunk, draft_len)
    gen.weights = weights  # to name a tensor with NaN/Inf when the output is not finite
    marks = {}
    progress = lambda i: marks.setdefault("prefill", time.perf_counter()) if i == len(prompt) else None  # noqa: E731
    try:
        res = M.run(model, backend, policy, gen, args.lag_tokens, audit, progress=progress)
    finally:
        backend.close()
    end = time.perf_counter()
    t0 = end - res.wall_s  # the run's clock starts after the backend's preparation (kernel compile, uploads)
    gen.out.write(gen.stream.flush() + "\n")
    prefill_s = marks.get("prefill", end) - t0
    decode_tokens = max(len(gen.generated) - 1, 0)  # the first generated token comes from the prefill
    out = {"model": str(args.model), "arch": info.arch, "policy": args.policy, "prompt_tokens": len(prompt),
           "prefill_chunk": args.prefill_chunk, "prompt_s": prefill_s,
           "prompt_tokens_per_s": len(prompt) / prefill_s if prefill_s > 0 else 0.0,
           "generated": len(gen.generated), "decode_tokens": decode_tokens, "decode_s": end - t0 - prefill_s,
           "decode_steps": gen.decode_steps, "decode_positions": res.tokens - len(prompt),
           "stopped_at_eos": gen.stopped, "cache_mib": capacity.slot_bytes(geometry) / 2**20,
           "digest": audit.digest(), **audit.summary()}
    out["decode_tokens_per_s"] = decode_tokens / out["decode_s"] if decode_tokens and out["decode_s"] > 0 else 0.0
    # from the command's start (model loading, backend preparation and prefill included)
    started = getattr(args, "started_at", None)
    first = getattr(gen, "first_token_at", None)
    out["first_token_s"] = first - started if started is not None and first is not None else None
    out["speculative"] = draft_len
    if model.router_predictor is not None:
        out["router_predictor"] = model.router_predictor.summary()
    if draft_len:
        out.update(drafted=gen.drafted, accepted=gen.accepted,
                   acceptance_rate=gen.accepted / gen.drafted if gen.drafted else 0.0,
                   tokens_per_step=decode_tokens / gen.decode_steps if gen.decode_steps else 0.0)
    return out, gen, model, audit


def _check_run_args(args) -> None:
    _check_common(args, "moelab run")
    if args.tokens < 0:
        raise _Fail(f"moelab run: -n {args.tokens}, expected >= 0")
    if args.prefill_chunk < 1:
        raise _Fail(f"moelab run: --prefill-chunk {args.prefill_chunk}, expected >= 1")
    from .speculative import MAX_DRAFT

    if not 0 <= args.speculative <= MAX_DRAFT:
        raise _Fail(f"moelab run: --speculative {args.speculative}, expected a draft length 0..{MAX_DRAFT}")
    if args.compare and not args.speculative:
        raise _Fail("moelab run: --compare compares speculative with plain decoding; give --speculative N")


def run_figures(argv: list[str]) -> tuple[dict, list[int]]:
    """``moelab run ARGV``'s figures (as ``--json`` prints them, ``--compare`` aside) and generated
    token ids, without printing the text; for experiments. A user error raises ``ExecutorError``."""
    import io

    from .gguf_io import load_model
    from .tokenizer import Tokenizer

    import time

    args = _parser_run().parse_args(argv)
    args.started_at = time.perf_counter()
    try:
        _check_run_args(args)
        tok = Tokenizer.from_gguf(args.model)
        out, gen, _, _ = _generate(args, load_model(args.model), tok, _prompt_ids(args, tok), args.speculative,
                                   io.StringIO())
    except _Fail as exc:
        raise ExecutorError(str(exc)) from None
    return out, gen.generated


def _run(args) -> int:
    import io

    from .gguf_io import load_model
    from .sampling import Sampler
    from .tokenizer import Tokenizer, TokenizerError

    _check_run_args(args)
    weights = load_model(args.model)
    try:
        tok = Tokenizer.from_gguf(args.model)
        Sampler(args.temp, args.seed, args.top_k)
    except (TokenizerError, ValueError) as exc:
        raise _Fail(f"moelab run: {exc}") from None
    prompt = _prompt_ids(args, tok)
    out, gen, model, audit = _generate(args, weights, tok, prompt, args.speculative, sys.stdout,
                                       record=bool(args.record_trace or args.audit))
    if args.compare:
        plain, pgen, _, _ = _generate(args, weights, tok, prompt, 0, io.StringIO())
        out["plain"] = {k: plain[k] for k in ("prompt_tokens_per_s", "decode_tokens", "decode_s",
                                              "decode_tokens_per_s", "generated", "digest")}
        out["speedup"] = out["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if plain["decode_tokens_per_s"] else 0.0
        out["same_tokens"] = gen.generated == pgen.generated
    if args.audit:
        audit.write_jsonl(args.audit, run={k: out[k] for k in ("model", "policy", "cache_mib", "digest")},
                          positions=_batch_positions(model.route_log, gen))
    if args.record_trace:
        from traces import TraceError

        try:
            _record_trace(args.record_trace, model, gen, weights.info, Path(args.model).name)
        except (TraceError, OSError) as exc:
            raise _Fail(f"moelab run: --record-trace: {exc}") from None
    _print_run(out, args.json)
    return 0


def _print_run(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"prompt: {out['prompt_tokens']} tokens in {out['prompt_s']:.3f} s = {out['prompt_tokens_per_s']:.1f} tokens/s")
    print(f"decode: {out['decode_tokens']} tokens in {out['decode_s']:.3f} s = {out['decode_tokens_per_s']:.1f} tokens/s "
          f"({out['generated']} generated{', stopped at end-of-text' if out['stopped_at_eos'] else ''})")
    print(f"{out['policy']}: hit rate {out['hit_rate']:.3f} ({out['hits']} hits, {out['uploads']} uploads, "
          f"{out['streams']} streams, {out['cpu']} on CPU); uploaded {out['upload_mib']:.2f} MiB; "
          f"cache {out['cache_mib']:.2f} MiB; decision digest {out['digest'][:16]}")
    if out["speculative"]:
        print(f"speculative (draft {out['speculative']}): {out['decode_steps']} decode steps, "
              f"{out['tokens_per_step']:.2f} tokens/step; acceptance {out['acceptance_rate']:.3f} "
              f"({out['accepted']} of {out['drafted']} drafted)")
    rp = out.get("router_predictor")
    if rp is not None:
        parts = [f"{ph} recall@{rp['k']} {rp[ph]['recall_k']:.3f}, @{rp['top_2k']} {rp[ph]['recall_2k']:.3f}"
                 for ph in ("prefill", "decode") if rp[ph]["routed"]]
        print(f"next block's router as predictor: {'; '.join(parts) or 'no prediction made'} "
              f"(a uniform guess: {rp['chance_k']:.3f}, {rp['chance_2k']:.3f})")
    if "plain" in out:
        p = out["plain"]
        print(f"plain decode: {p['decode_tokens']} tokens in {p['decode_s']:.3f} s = {p['decode_tokens_per_s']:.1f} "
              f"tokens/s; speculative / plain = {out['speedup']:.2f}x; same tokens: "
              f"{'yes' if out['same_tokens'] else 'NO'}")


def run_main(argv: list[str]) -> int:
    """``moelab run MODEL.gguf -p TEXT [-n N] [--policy P] ...``."""
    import time

    started = time.perf_counter()
    args = _parser_run().parse_args(argv)
    args.started_at = started
    return _guard(_run, args)
