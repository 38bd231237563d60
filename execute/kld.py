"""``moelab kld``: how far a policy's next-token distributions are from the reference's.

Method. A text is tokenized with the file's vocabulary (BOS as the file says, no chat template)
and cut to ``--tokens`` ids. The same ids are run twice, teacher-forced, through the one executor
loop (:func:`execute.model.run`), in batches of ``--batch`` tokens (1, the default: token by token,
the decode path with its background copies lagging ``--lag-tokens`` behind):

- the reference: policy ``cpu`` on the numpy backend (:class:`~execute.model.NumpyExperts`: every
  expert dequantized to float32 and run in numpy; the dense path in numpy), what ``moelab run
  --policy cpu --backend numpy`` computes;
- policy P on the expert engine (:class:`~execute.model.EngineExperts`: the CPU pool's kernels,
  the GPU arena with its asynchronous uploads, fills and swaps), as ``moelab run --policy P``.

Each position's logits (float32, ``(vocab,)``) are kept on the host, ``tokens x vocab x 4`` bytes
per run. At every position ``i``, with p the reference's softmax and q the policy's (float64):
``KL_i = sum_v p_v (log p_v - log q_v)``, the KL divergence of the reference's distribution to
the policy's, as llama.cpp's ``perplexity --kl-divergence`` reports it; top-1 agreement is
``argmax p == argmax q``. Reported: KL mean, median, p99 and max (with its position), the share of
positions with KL > 0.1 and > 4, top-1 agreement, both perplexities of the text (positions 0..N-2
predicting the next id), and the policy run's audit (hit rate, uploads). A position whose policy
logits are not finite counts as KL = inf.

Routing is computed independently in each run, so a near-tie the two numerics break differently
sends a token to other experts; that shows here as it would in a real decode.

Near ties (``execute.kld_ties``, off with ``--no-twin``): the reference runs a third time as a
*rounding twin* (the reference's routes forced: a routing difference is not rounding), every
matrix product's and MoE block's output perturbed by a relative ``--twin-jitter``
(default 2^-22 + sqrt(K) 2^-24 for a product over K: the activation halves and float32 accumulation
in another order); a position whose reference top-1/top-2 margin, or whose routing difference's
root's margin, is below 4 sqrt(2) times the twin's spread there is a near tie, and
top-1 agreement is reported outside them too, with every flipped position's margins and bounds.
A routing difference travels to later positions through the KV cache; the figures follow it back
to its root (``execute.kld_ties``). With the twin (off with ``--no-forced``) the policy runs once
more with the reference's routes forced (the router's own weights of those ids), so that the
tiles' rounding is measured without routing differences (``forced`` in the output).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from scheduler.args import ArgumentParser, int_at_least

from .cli_options import Fail as _Fail, build_capacity as _capacity, check_common as _check_common
from .cli_options import cost_options as _cost_options, guard as _guard, make_backend as _backend
from .cli_options import context_limit as _context_limit, read_profile as _profile, wants_gpu as _use_gpu
from .kld_ties import RouterProbe, TwinModel, kl_divergence, numerics, rounding, ties

__all__ = ["main", "kl_divergence", "kl_figures", "gpu_missing", "forced_routes"]

PROG = "moelab kld"
_ROWS = 64  # positions compared at a time (float64 temporaries of 64 x vocab)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``-log softmax(logits[i])[targets[i]]`` per row, float64."""
    out = np.empty(len(targets))
    for i in range(0, len(targets), _ROWS):
        x = np.asarray(logits[i:i + _ROWS], np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            m = x.max(axis=1, keepdims=True)
            lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
        out[i:i + len(x)] = lse - x[np.arange(len(x)), targets[i:i + _ROWS]]
    return out


def kl_figures(ref_logits: np.ndarray, logits: np.ndarray, ids) -> dict:
    """The comparison of two runs' logits ``(N, vocab)`` over token ids ``ids`` (N of them): KL
    statistics, top-1 agreement and perplexities, as ``moelab kld --json`` prints them."""
    kl = kl_divergence(ref_logits, logits)
    top1 = np.argmax(ref_logits, axis=1) == np.argmax(logits, axis=1)
    targets = np.asarray(ids[1:], np.int64)
    worst = np.argsort(-kl, kind="stable")[:5]
    ppl = {name: float(np.exp(_nll(a[:-1], targets).mean())) if len(targets) else float("nan")
           for name, a in (("reference", ref_logits), ("policy", logits))}
    return {"positions": len(kl), "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()), "kl_max_position": int(worst[0]),
            "share_kl_above_0.1": float(np.mean(kl > 0.1)), "share_kl_above_4": float(np.mean(kl > 4)),
            "top1_agreement": float(top1.mean()), "top1_same": int(top1.sum()),
            "ppl_reference": ppl["reference"], "ppl_policy": ppl["policy"],
            "worst": [[int(i), float(kl[i])] for i in worst]}


def gpu_missing() -> str | None:
    """Why GPU experts cannot run on this machine (no CuPy, no CUDA device), or None."""
    try:
        from .gpu_experts import gpu_available
    except ImportError as exc:
        return f"CuPy cannot be imported ({exc})"
    return None if gpu_available() else "no CUDA device is visible"


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=(
        "Run a text teacher-forced through the numpy reference (policy cpu, numpy backend) and through "
        "a policy on the expert engine; print the per-token KL divergence of the reference's next-token "
        "distribution to the policy's (mean, median, p99, max, share above 0.1 and 4) and top-1 agreement."))
    p.add_argument("model", help="GGUF model")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("-f", "--file", default=None, help="text file (UTF-8)")
    text.add_argument("-p", "--prompt", default=None, help="text")
    p.add_argument("--policy", required=True, help="cpu, gpu, lru, freq-lru, static, hybrid, hybrid-cost")
    p.add_argument("--tokens", type=int, default=256, help="compare at most N positions of the text (default 256)")
    p.add_argument("--ctx", type=int_at_least(1), default=None, metavar="N",
                   help="positions the text may use (default: the file's context length, or 4096 when it states none)")
    p.add_argument("--batch", type=int, default=1,
                   help="tokens run as one batch (default 1: token by token, the decode path; >1: prefill chunks)")
    p.add_argument("--cache-mib", type=float, default=None, help="GPU expert cache budget, MiB")
    p.add_argument("--cache-slots", type=int, default=None, help="GPU expert cache slots per layer (instead of MiB)")
    p.add_argument("--profile", default=None, help="STRP profile (static, hybrid pre-population)")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or JSON file (moelab simulate's format): the cost model of --policy "
                        "hybrid-cost, and of hybrid's PCIe share (without it, hybrid's share is fixed at 44/256)")
    p.add_argument("--pageable", action="store_true", help="do not page-lock the weights (uploads from pageable memory)")
    p.add_argument("--threads", type=int, default=None, help="CPU expert threads (default: all cores)")
    p.add_argument("--lag-tokens", type=int, default=1, help="background copies complete this many tokens later")
    p.add_argument("--timeout-s", type=float, default=60.0, help="an expert step that takes longer is an error")
    p.add_argument("--cpu-dense", action="store_true",
                   help="with --policy cpu, run the policy's dense path on the CPU too (default: on the GPU when one is present)")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="skip the rounding twin (the reference run again with its products' and blocks' outputs "
                        "perturbed at the tiles' precision) and the near-tie figures it gives")
    p.add_argument("--twin-jitter", type=float, default=None, metavar="R",
                   help="the rounding twin's relative perturbation of each product's and block's output (default 2^-22 + "
                        "sqrt(K) 2^-24 for a product over K: the tiles' activation halves and float32 accumulation)")
    p.add_argument("--no-forced", dest="forced", action="store_false",
                   help="skip the policy's second run with the reference's routes forced (the tiles' rounding "
                        "without routing differences; needs the twin)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="compare on a model whose weights hold NaN or Inf (checked at load otherwise)")
    p.add_argument("--quiet", action="store_true", help="nothing on stderr but errors (no progress bar)")
    p.set_defaults(backend="engine", audit=None)
    return p


def _check(args) -> None:
    """Everything that can be checked before the model is loaded."""
    _check_common(args, PROG)
    if args.tokens < 2:
        raise _Fail(f"{PROG}: --tokens {args.tokens}: expected >= 2 (a position and the one it predicts)")
    if args.batch < 1:
        raise _Fail(f"{PROG}: --batch {args.batch}: expected >= 1")
    if args.twin_jitter is not None and not 0 < args.twin_jitter < 1:
        raise _Fail(f"{PROG}: --twin-jitter {args.twin_jitter}: expected a relative size in (0, 1)")
    if args.policy == "belady":
        raise _Fail(f"{PROG}: policy 'belady' needs the future routing, which the run computes as it goes; "
                    "compare it with moelab replay on a recorded trace")
    if args.policy != "cpu":
        why = gpu_missing()
        if why:
            raise _Fail(f"{PROG}: policy {args.policy!r} runs experts on the GPU, and this machine cannot: {why}; "
                        "only --policy cpu runs without a GPU")
    if args.file is not None:
        try:
            args.prompt = Path(args.file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise _Fail(f"{PROG}: -f {args.file}: not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise _Fail(f"{PROG}: -f {args.file}: {exc.strerror or exc}") from None


def _policy(args, geometry, capacity):
    from scheduler import make_policy
    from scheduler.core import CapacityError

    profile = _profile(args, geometry, PROG)
    try:
        return make_policy(args.policy, geometry, capacity, profile=profile, **_cost_options(args, PROG))
    except (ValueError, CapacityError) as exc:
        raise _Fail(f"{PROG}: {exc}") from None


def _inputs(ids: list[int], batch: int, routes: list | None = None):
    """The text as run inputs: one sequence, ``batch`` tokens per input, every row's logits kept;
    ``routes[i]`` (per block a Route or None) forces position i's routing."""
    from .model import ChunkInput, TokenInput

    phase = "decode" if batch == 1 else "prefill"
    for index, i in enumerate(range(0, len(ids), batch)):
        chunk = ids[i:i + batch]
        r = None if routes is None else tuple(routes[i:i + batch])
        if len(chunk) == 1:
            yield TokenInput(index, 0, i, phase, chunk[0], None if r is None else r[0])
        else:
            yield ChunkInput(index, 0, i, phase, tuple(chunk), r, True)


def forced_routes(probe: RouterProbe, num_layers: int, positions: int) -> list[tuple]:
    """The reference's routing as forced routes: per position, per block a Route of the ids the
    probe saw (weights left to the router), None at a block without experts."""
    from .routing import Route

    return [tuple(Route(tuple(int(e) for e in probe.ids[l][i])) if l in probe.ids else None for l in range(num_layers))
            for i in range(positions)]


def _logits(weights, policy, backend, use_gpu: bool, ids: list[int], args, audit, bar=None, routes=None, twin=None):
    """Run ``ids`` under ``policy`` and ``backend`` (``routes``: forced, as :func:`_inputs`); ->
    ``(N, vocab)`` float32 logits, the RunResult and the route log. ``bar`` (a tqdm) advances by
    each batch's tokens. ``twin`` (rng, size or None): the model is the rounding twin's
    (``kld_ties.TwinModel``)."""
    from . import model as M

    model = (M.MoeModel(weights, use_gpu=use_gpu, max_tokens=len(ids)) if twin is None
             else TwinModel(weights, twin[0], twin[1], use_gpu=use_gpu, max_tokens=len(ids)))
    model.route_log = []
    if isinstance(backend, RouterProbe):
        backend.model = model
    out = np.empty((len(ids), weights.info.vocab), np.float32)

    def keep(tokens: int) -> None:  # after each batch: its rows of logits
        rows = model.chunk_logits
        rows = rows.get() if hasattr(rows, "get") else rows
        out[tokens - len(rows):tokens] = rows
        if bar is not None:
            bar.update(len(rows))

    try:
        res = M.run(model, backend, policy, _inputs(ids, args.batch, routes), args.lag_tokens, audit, progress=keep)
    finally:
        backend.close()
    return out, res, model.route_log


def _forced(args, weights, geometry, capacity, use_gpu: bool, ids, probe, ref, twin, bar) -> dict:
    """The policy's run with the reference's routes forced, against the reference (``numerics``);
    an error there is reported in its place (the main figures stand without it)."""
    try:
        backend = _backend(args, weights, use_gpu, capacity, PROG)
        got, res, _ = _logits(weights, _policy(args, geometry, capacity), backend, use_gpu, ids, args, None, bar,
                              forced_routes(probe, weights.info.num_layers, len(ids)))
        return {**numerics(ref, twin, got), "wall_s": res.wall_s}
    except (_Fail, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - a failure of the extra run is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def kld(args) -> dict:
    """The comparison ``moelab kld ARGS`` prints (``--json``)."""
    from scheduler import Capacity, make_policy
    from scheduler.audit import Audit

    from .gguf_io import read_model_info
    from .tokenizer import Tokenizer, TokenizerError
    from .weights_check import load_checked

    _check(args)
    try:
        ids = Tokenizer.from_gguf(args.model).encode(args.prompt)[:args.tokens]
    except TokenizerError as exc:
        raise _Fail(f"{PROG}: {exc}") from None
    if len(ids) < 2:
        raise _Fail(f"{PROG}: the text encodes to {len(ids)} token(s); at least 2 are needed")
    ctx, what = _context_limit(args, read_model_info(args.model))
    if len(ids) > ctx:
        raise _Fail(f"{PROG}: the text is {len(ids)} tokens, more than {what}; give --tokens {ctx} or less")
    weights = load_checked(args.model, args.allow_non_finite)
    info = weights.info
    geometry = info.geometry()
    capacity = _capacity(args, geometry, PROG)
    policy = _policy(args, geometry, capacity)
    use_gpu = _use_gpu(args)
    backend = _backend(args, weights, use_gpu, capacity, PROG)  # before the reference: errors come first
    audit = Audit(geometry, keep_log=True)
    ref_policy = make_policy("cpu", geometry, Capacity.per_layer(geometry, 0))
    from tqdm import tqdm

    # the reference's tokens, its rounding twin's, then the policy's
    forced = args.twin and args.forced and info.expert_groups <= 1
    runs = 2 + args.twin + forced
    with tqdm(total=runs * len(ids), unit="token", desc="kld", disable=getattr(args, "quiet", False),
              file=sys.stderr, dynamic_ncols=True) as bar:
        try:
            probe = RouterProbe(weights, len(ids))
            ref, ref_res, _ = _logits(weights, ref_policy, probe, False, ids, args, None, bar)
            if not np.isfinite(ref).all():
                raise _Fail(f"{PROG}: the reference's logits are not finite (NaN or Inf) at position "
                            f"{int(np.argmin(np.isfinite(ref).all(axis=1)))}; the file's weights hold non-finite values")
            jitter = rounding(info.hidden) if args.twin_jitter is None else args.twin_jitter
            if args.twin:
                twin_probe = RouterProbe(weights, len(ids), np.random.default_rng(0), jitter)
                twin, _, _ = _logits(weights, make_policy("cpu", geometry, Capacity.per_layer(geometry, 0)),
                                     twin_probe, False, ids, args, None, bar,
                                     forced_routes(probe, info.num_layers, len(ids)),
                                     twin=(np.random.default_rng(1), args.twin_jitter))
        except BaseException:
            backend.close()
            raise
        got, res, route_log = _logits(weights, policy, backend, use_gpu, ids, args, audit, bar)
        if forced:  # a fresh policy and backend: the same run with the reference's routes
            forced = _forced(args, weights, geometry, capacity, use_gpu, ids, probe, ref, twin, bar)
    summary = audit.summary()
    near = (ties(ref, twin, got, probe, twin_probe, route_log, info.expert_groups > 1, jitter) if args.twin
            else {"near_ties": None})
    near["forced"] = forced or None
    return {"model": str(args.model), "arch": info.arch, "policy": args.policy, "reference": "cpu, numpy backend",
            "gpu": use_gpu, "batch": args.batch, "lag_tokens": args.lag_tokens, "vocab": info.vocab,
            "cache_mib": capacity.slot_bytes(geometry) / 2**20, **kl_figures(ref, got, ids),
            "hit_rate": summary["hit_rate"], "uploads": summary["uploads"], "upload_mib": summary["upload_mib"],
            "streams": summary["streams"], "cpu": summary["cpu"], "digest": audit.digest(),
            "reference_wall_s": ref_res.wall_s, "policy_wall_s": res.wall_s, "ties": near}


def _print(out: dict) -> None:
    print(f"{out['model']}: {out['arch']}, policy {out['policy']} (cache {out['cache_mib']:.2f} MiB"
          f"{', GPU' if out['gpu'] else ', no GPU'}) vs the numpy reference; {out['positions']} positions, "
          f"batches of {out['batch']}")
    print(f"  KL divergence: mean {out['kl_mean']:.3g}, median {out['kl_median']:.3g}, p99 {out['kl_p99']:.3g}, "
          f"max {out['kl_max']:.3g} (position {out['kl_max_position']})")
    print(f"  positions with KL > 0.1: {100 * out['share_kl_above_0.1']:.2f}%, > 4: {100 * out['share_kl_above_4']:.2f}%")
    print(f"  top-1 agreement: {100 * out['top1_agreement']:.2f}% ({out['top1_same']}/{out['positions']})")
    t = out["ties"]
    if t["near_ties"] is not None:
        print(f"  outside near ties: {100 * t['top1_agreement_outside_ties']:.2f}% ({t['top1_same_outside_ties']}/"
              f"{t['positions_outside_ties']}); near ties {t['near_ties']} (logits {t['logit_ties']}, routing "
              f"{t['route_ties']}); rounding twin's own top-1 agreement {100 * t['twin_top1_agreement']:.2f}%")
        if t.get("routes_analysed"):
            print(f"  routing: {t['positions_routed_differently']} positions routed differently, {len(t['route_roots'])} "
                  f"roots ({t['route_root_ties']} near ties), {t['positions_route_affected']} positions reached; "
                  f"spread ratio {t['spread_ratio_median']:.3g} (median), {t['spread_ratio_median_unaffected']:.3g} "
                  "where no routing difference reaches")
        f = t.get("forced")
        if f and "error" in f:
            print(f"  reference's routes forced: failed ({f['error']})")
        elif f:
            print(f"  reference's routes forced: KL max {f['kl_max']:.3g}, top-1 {100 * f['top1_agreement']:.2f}%, "
                  f"outside near ties {100 * f['top1_agreement_outside_ties']:.2f}% ({f['top1_same_outside_ties']}/"
                  f"{f['positions_outside_ties']}), spread ratio {f['spread_ratio_median']:.3g} (median)")
        for f in t["flips"]:
            r = f["first_route_difference"]
            print(f"    position {f['position']}: margin {f['margin']:.3g} (bound {f['bound']:.3g}), "
                  f"{f['blocks_routed_differently']} blocks routed differently"
                  + (f", first block {r[0]}: margin {r[1]:.3g} (bound {r[2]:.3g})" if r else ""))
    print(f"  perplexity: reference {out['ppl_reference']:.4g}, policy {out['ppl_policy']:.4g}")
    print(f"  {out['policy']}: hit rate {out['hit_rate']:.3f}, {out['uploads']} uploads ({out['upload_mib']:.2f} MiB), "
          f"{out['streams']} streams, {out['cpu']} on CPU; decision digest {out['digest'][:16]}")


def _main(args) -> int:
    out = kld(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out)
    return 0


def main(argv: list[str]) -> int:
    """``moelab kld MODEL.gguf --policy P (-f TEXT_FILE | -p TEXT) [--tokens N] ...``."""
    args = _parser().parse_args(argv)
    return _guard(_main, args)
