"""``moelab run``: decode text with a GGUF MoE model under a policy; its arguments and their checks,
the printed report, and ``run_figures`` (the same run's figures, for experiments)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scheduler import MISS_FRAC_256
from scheduler.args import ArgumentParser, int_at_least

from .cli_generate import batch_positions, generate, prompt_ids, record_trace
from .cli_options import Fail, check_common, guard, wants_gpu
from .weights_check import load_checked
from .experts import ExecutorError

__all__ = ["run_main", "run_figures", "parser_run"]


def parser_run() -> argparse.ArgumentParser:
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
    p.add_argument("--seed", type=int_at_least(0), default=0, help="sampling seed")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy, the default)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the file's chat template")
    p.add_argument("--lag-tokens", type=int, default=1, help="background copies complete this many tokens later")
    p.add_argument("--timeout-s", type=float, default=60.0, help="an expert step that takes longer is an error")
    p.add_argument("--backend", choices=("engine", "numpy"), default="engine",
                   help="experts on the expert engine (GPU kernels and CPU pool), or the numpy reference (cpu only)")
    p.add_argument("--cpu-dense", action="store_true",
                   help="with --policy cpu, run the dense path on the CPU too (default: on the GPU when one is present)")
    p.add_argument("--ctx", type=int_at_least(1), default=None, metavar="N",
                   help="positions the prompt and generated tokens may use (default: the file's context length, "
                        "or 4096 when it states none)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens run as one batch (default 512; 1: token by token)")
    p.add_argument("--speculative", type=int, default=0, metavar="N",
                   help="prompt-lookup speculative decoding with drafts of up to N tokens (1-4; 0: off, the default)")
    p.add_argument("--compare", action="store_true",
                   help="with --speculative: also decode plainly (same policy, fresh state) and print both speeds")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or JSON file (moelab simulate's format): the cost model of --policy hybrid-cost, "
                        "and of hybrid's PCIe share (without it, or with --miss-fraction, hybrid's share is fixed)")
    p.add_argument("--pageable", action="store_true",
                   help="do not page-lock the weights (as when the host cannot pin the model): uploads are "
                        "copies from pageable memory, staged by the CUDA driver, the host thread waiting for each; "
                        "hybrid-cost's cost model then takes the hardware's pageable link rate")
    p.add_argument("--miss-fraction", type=float, default=None,
                   help=f"--policy hybrid: share of distinct misses sent over PCIe (default {MISS_FRAC_256}/256)")
    p.add_argument("--graph-cpu", action="store_true", default=None,
                   help="a decode token's misses on the CPU pool inside its CUDA graph, its uploads deferred "
                        "after the token (default: MOELAB_GRAPH_CPU, off: a miss halts the token graph)")
    p.add_argument("--audit", default=None, help="write the per-batch audit JSONL (with routes) here")
    p.add_argument("--record-trace", default=None, help="write the routing as a trace directory (traces/ format)")
    p.add_argument("--router-predictor", action="store_true",
                   help="measure each next block's router on the current hidden state as a predictor of its "
                        "experts (recall at k and 2k, in --json as router_predictor; adds a router product "
                        "and a host wait per block)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON after the text")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="run a model whose weights hold NaN or Inf (checked at load otherwise)")
    p.add_argument("--quiet", action="store_true",
                   help="nothing on stderr but errors (the text still streams to stdout)")
    return p


def check_run_args(args) -> None:
    check_common(args, "moelab run")
    if args.tokens < 0:
        raise Fail(f"moelab run: -n {args.tokens}, expected >= 0")
    if args.prefill_chunk < 1:
        raise Fail(f"moelab run: --prefill-chunk {args.prefill_chunk}, expected >= 1")
    from .speculative import MAX_DRAFT

    if not 0 <= args.speculative <= MAX_DRAFT:
        raise Fail(f"moelab run: --speculative {args.speculative}, expected a draft length 0..{MAX_DRAFT}")
    if args.compare and not args.speculative:
        raise Fail("moelab run: --compare compares speculative with plain decoding; give --speculative N")
    if args.graph_cpu and (args.policy == "cpu" or args.backend == "numpy"):
        raise Fail(f"moelab run: --graph-cpu: the token graph runs on the GPU; not with "
                   f"{'--backend numpy' if args.backend == 'numpy' else '--policy cpu'}")


def run_figures(argv: list[str]) -> tuple[dict, list[int]]:
    """``moelab run ARGV``'s figures (as ``--json`` prints them, ``--compare`` aside) and generated
    token ids, without printing the text; for experiments. A user error raises ``ExecutorError``."""
    import io

    from .gguf_model import load_model
    from .tokenizer import Tokenizer

    import time

    from .first_token import Phases

    args = parser_run().parse_args(argv)
    args.started_at = time.perf_counter()
    args.phases = ph = Phases()
    try:
        check_run_args(args)
        timings: dict = {}
        weights = load_model(args.model, lazy_dense=True, timings=timings)
        for k, v in timings.items():
            ph.add(k, v)
        with ph.phase("tokenizer_s"):
            tok = Tokenizer.from_gguf(args.model)
            prompt = prompt_ids(args, tok)
        out, gen, _, _ = generate(args, weights, tok, prompt, args.speculative, io.StringIO())
    except Fail as exc:
        raise ExecutorError(str(exc)) from None
    return out, gen.generated


def _run(args) -> int:
    import io

    from .sampling import Sampler
    from .tokenizer import Tokenizer, TokenizerError

    from .first_token import Phases

    if args.policy != "cpu" and args.backend == "engine" and gpu_init_env():
        from .first_token import GpuInit

        # the CUDA context made while the arguments are checked (--threads imports numba), the
        # file is opened and the vocabulary read
        args.gpu_init = GpuInit()
    check_run_args(args)
    ph = getattr(args, "phases", None)
    if ph is None:
        args.phases = ph = Phases()
    timings: dict = {}
    # the projections stay stored until read: a GPU run's kernels read them so, never expanded
    weights = load_checked(args.model, args.allow_non_finite, timings, cpu_only=not wants_gpu(args), lazy_dense=True)
    for k, v in timings.items():
        ph.add(k, v)
    with ph.phase("tokenizer_s"):
        try:
            tok = Tokenizer.from_gguf(args.model)
            Sampler(args.temp, args.seed, args.top_k)
        except (TokenizerError, ValueError) as exc:
            raise Fail(f"moelab run: {exc}") from None
        prompt = prompt_ids(args, tok)
    init = getattr(args, "gpu_init", None)
    if init is not None:  # the chunk path's library work on the model's shapes, meanwhile
        init.warm(weights.info, min(len(prompt), args.prefill_chunk), len(prompt) + args.tokens + args.speculative)
    out, gen, model, audit = generate(args, weights, tok, prompt, args.speculative, sys.stdout,
                                       record=bool(args.record_trace or args.audit))
    if args.compare:
        plain, pgen, _, _ = generate(args, weights, tok, prompt, 0, io.StringIO())
        out["plain"] = {k: plain[k] for k in ("prompt_tokens_per_s", "decode_tokens", "decode_s",
                                              "decode_tokens_per_s", "generated", "digest")}
        out["speedup"] = out["decode_tokens_per_s"] / plain["decode_tokens_per_s"] if plain["decode_tokens_per_s"] else 0.0
        out["same_tokens"] = gen.generated == pgen.generated
    if args.audit:
        audit.write_jsonl(args.audit, run={k: out[k] for k in ("model", "policy", "cache_mib", "digest")},
                          positions=batch_positions(model.route_log, gen))
    if args.record_trace:
        from traces import TraceError

        try:
            record_trace(args.record_trace, model, gen, weights.info, Path(args.model).name)
        except (TraceError, OSError) as exc:
            raise Fail(f"moelab run: --record-trace: {exc}") from None
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

    from .first_token import Phases, process_age_s

    started = time.perf_counter()
    age = process_age_s()  # process start -> here: interpreter start-up and imports
    args = parser_run().parse_args(argv)
    args.started_at = started
    args.phases = Phases(age)
    return guard(_run, args)


def gpu_init_env() -> bool:
    """``MOELAB_GPU_INIT``: 1 (the default) starts the CUDA context on a thread at the command's
    start (``execute.first_token.GpuInit``); 0 leaves it to the first CUDA call."""
    from .xp import env_switch

    return env_switch("MOELAB_GPU_INIT")

