"""``moelab profile``: build an STRP profile from a routing trace, or show one.

    moelab profile build [TRACE] OUT.strp [--phase decode] [--slots N] [--trailer freq|rank|none]
    moelab profile show FILE.strp [--top N] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from scheduler.args import ArgumentParser, int_at_least
from scheduler.files import check_output
from scheduler.profile import Profile, ProfileError, read_strp, write_strp

__all__ = ["main"]



def _parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="moelab profile", description="Build or show STRP expert profiles.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rank experts by routing count in a trace and write STRP v1")
    b.add_argument("paths", nargs="+", metavar="[TRACE] OUT", help="trace (default: the bundled one), output .strp")
    b.add_argument("--phase", choices=["prefill", "decode"], default=None, help="count only these rows")
    b.add_argument("--slots", type=int_at_least(0), default=None, help="slots field of the header (default: all ranked pairs)")
    b.add_argument("--trailer", choices=["freq", "rank", "none"], default="freq")
    s = sub.add_parser("show", help="print a profile's header and hottest experts")
    s.add_argument("path")
    s.add_argument("--top", type=int_at_least(0), default=10, help="hottest pairs to list (default 10)")
    s.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "build":
            return _build(args)
        return _show(args)
    except (ProfileError, ValueError) as exc:
        print(f"moelab profile: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"moelab profile: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2


def _build(args) -> int:
    import traces  # the trace layer sits above the scheduler; load it only for this command

    if len(args.paths) > 2:
        raise ValueError("build takes [TRACE] OUT")
    src, out = (None, args.paths[0]) if len(args.paths) == 1 else args.paths
    check_output(out, "OUT")
    if args.slots is not None and args.slots < 0:
        raise ValueError(f"--slots {args.slots}: expected >= 0")
    trace = traces.load(src, check=True)
    counts = trace.routing_counts(phase=args.phase)
    profile = Profile.from_counts(counts, args.slots)
    write_strp(profile, out, None if args.trailer == "none" else args.trailer)
    print(f"wrote {out}: {profile.num_layers} layers x {profile.num_experts} experts, "
          f"{len(profile.ranked)} ranked pairs, slots {profile.slots}, trailer {args.trailer}")
    return 0


def _show(args) -> int:
    p = read_strp(args.path)
    info = {"path": args.path, "num_layers": p.num_layers, "num_experts": p.num_experts, "slots": p.slots,
            "ranked": len(p.ranked), "has_frequency": p.frequency is not None,
            "top": [list(k) for k in p.ranked[: args.top]]}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"{args.path}: STRP v1, {p.num_layers} layers x {p.num_experts} experts, slots {p.slots}, "
              f"{len(p.ranked)} ranked pairs, frequency table: {'yes' if p.frequency is not None else 'no'}")
        for i, (l, e) in enumerate(p.ranked[: args.top]):
            f = f"  {p.frequency[l, e]:.4f}" if p.frequency is not None else ""
            print(f"  {i:>4}  layer {l:>3}  expert {e:>4}{f}")
    return 0
