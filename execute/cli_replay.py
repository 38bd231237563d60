"""``moelab replay``: a routing trace through the model's real forward pass, experts placed by a
policy; prints speed, hit rate, bytes uploaded and per-layer times."""
from __future__ import annotations

import argparse
import json
import sys

from scheduler.args import ArgumentParser, int_at_least

from .cli_options import Fail, build_capacity, check_common, cost_options, guard, make_backend, read_profile, wants_gpu

__all__ = ["replay_main"]


def _parser_replay() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moelab replay", description=(
        "Run a routing trace through the model's real forward pass, experts placed by a policy."))
    p.add_argument("model", help="GGUF model")
    p.add_argument("--trace", default=None, help="trace directory (default: the bundled granite trace)")
    p.add_argument("--policy", required=True, help="cpu, gpu, lru, freq-lru, static, hybrid, hybrid-cost, belady")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or JSON file (moelab simulate's format): the cost model of --policy "
                        "hybrid-cost, and of hybrid's PCIe share (without it, hybrid's share is fixed at 44/256)")
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
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random input token ids")
    p.add_argument("--timeout-s", type=float, default=60.0, help="an expert step that takes longer is an error")
    p.add_argument("--backend", choices=("engine", "numpy"), default="engine",
                   help="experts on the expert engine (GPU kernels + Numba CPU pool), or numpy reference (cpu only)")
    p.add_argument("--cpu-dense", action="store_true",
                   help="with --policy cpu, run the dense path on the CPU too (default: on the GPU when one is present)")
    p.add_argument("--audit", default=None, help="write the per-token audit JSONL (with routes) here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="run a model whose weights hold NaN or Inf (checked at load otherwise)")
    p.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    return p


def _load_trace(args, info):
    import traces

    from .model import check_trace, fold_trace

    try:
        trace = traces.load(args.trace, check=True)
    except (traces.TraceError, OSError) as exc:
        raise Fail(f"moelab replay: --trace: {exc}") from None
    if args.map:
        return fold_trace(trace, info)
    check_trace(trace, info)
    return trace


def _policy(args, trace, geometry, capacity):
    from scheduler import make_policy
    from scheduler.core import CapacityError

    profile = read_profile(args, geometry, "moelab replay")
    future = None
    if args.policy == "belady":
        future = [s for tok in trace.tokens(args.phase, 0, args.tokens) for s in tok.steps]
    options = cost_options(args, "moelab replay")
    try:
        return make_policy(args.policy, geometry, capacity, profile=profile, future=future, **options)
    except (ValueError, CapacityError) as exc:
        raise Fail(f"moelab replay: {exc}") from None


def _replay(args) -> int:
    from scheduler.audit import Audit

    from . import model as M
    from .weights_check import load_checked

    check_common(args, "moelab replay")
    if args.tokens is not None and args.tokens < 1:
        raise Fail(f"moelab replay: --tokens {args.tokens}: expected >= 1")
    weights = load_checked(args.model, args.allow_non_finite, cpu_only=not wants_gpu(args))
    info = weights.info
    trace = _load_trace(args, info)
    from scheduler import Geometry

    geometry = Geometry(info.num_experts, trace.top_k, info.expert_bytes)
    capacity = build_capacity(args, geometry)
    policy = _policy(args, trace, geometry, capacity)
    use_gpu = wants_gpu(args)
    backend = make_backend(args, weights, use_gpu, capacity)
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
    return guard(_replay, args)

