"""``moelab model synth`` (write a GGUF MoE model with random weights) and ``moelab model info``
(geometry, quant types and expert sizes read from a GGUF file's header)."""
from __future__ import annotations

import argparse
import json
import sys

from scheduler.args import ArgumentParser, int_at_least
from scheduler.files import OutputPathError, check_output

from .cli_options import Fail, guard

__all__ = ["model_main"]


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
    s.add_argument("--seed", type=int_at_least(0), default=0)
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
        raise Fail(f"moelab model synth: {exc}") from None
    try:
        out = check_output(args.out, "OUT")
    except OutputPathError as exc:
        raise Fail(f"moelab model synth: {exc}") from None
    try:
        synth_model(out, cfg, progress=not args.quiet)  # a temporary file, renamed into place at the end
    except OSError as exc:  # a full disk: the write's error names no file
        raise Fail(f"moelab model synth: {out}: {exc.strerror or exc}") from None
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
    for name, path in d["qtype_paths"].items():
        print(f"  {name}: {path}")
    print(f"  bytes per expert: {', '.join(_fmt_bytes(b) for b in eb)} ({eb[0] if len(eb) == 1 else eb} B)")
    print(f"  total expert bytes: {_fmt_bytes(info.total_expert_bytes)} ({info.total_expert_bytes} B)")
    return 0


def model_main(argv: list[str]) -> int:
    """``moelab model synth|info``."""
    args = _parser_model().parse_args(argv)
    return guard(_synth if args.cmd == "synth" else _info, args)

