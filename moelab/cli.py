"""The ``moelab`` command: dispatches each subcommand to the module that owns it.

Subcommand modules are imported only when their command runs, so ``moelab trace ...`` never loads
simpy, cupy or numba. Each handler is ``main(argv: list[str]) -> int`` for its command. Ctrl-C ends
any command with one line and status 130 (a handler that keeps partial work says what it kept).
"""
from __future__ import annotations

import os
import sys
from typing import Callable

__all__ = ["main", "COMMANDS"]


# Each handler imports its command's module only when that command runs.
def _trace(argv):
    from .trace_cli import main as handler
    return handler(argv)


def _profile(argv):
    from .profile_cli import main as handler
    return handler(argv)


def _simulate(argv):
    from .simulate_cli import simulate_main as handler
    return handler(argv)


def _sweep(argv):
    from .simulate_cli import sweep_main as handler
    return handler(argv)


def _model(argv):
    from execute.cli_model import model_main as handler
    return handler(argv)


def _replay(argv):
    from execute.cli_replay import replay_main as handler
    return handler(argv)


def _run(argv):
    from execute.cli_run import run_main as handler
    return handler(argv)


def _kld(argv):
    from execute.kld import main as handler
    return handler(argv)


def _calibrate(argv):
    from execute.calibrate import main as handler
    return handler(argv)


# command -> (handler, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "trace": (_trace, "import, inspect, fit and synthesise routing traces"),
    "profile": (_profile, "build, read and check STRP expert profiles"),
    "simulate": (_simulate, "simulate decode of a trace under a policy and hardware"),
    "sweep": (_sweep, "simulate many configurations, resumable, to CSV and plots"),
    "model": (_model, "synthesise or describe GGUF models"),
    "replay": (_replay, "run a trace through real GPU/CPU expert kernels"),
    "run": (_run, "decode text with a GGUF model under a policy"),
    "kld": (_kld, "KL divergence of a policy's next-token distributions to the numpy reference"),
    "calibrate": (_calibrate, "measure this machine and write a hardware file for moelab simulate"),
}


def _usage() -> str:
    lines = ["usage: moelab COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "moelab COMMAND --help shows a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name, rest = (argv[0], argv[1:]) if argv else ("", [])
    if name not in COMMANDS and name not in ("", "-h", "--help"):
        print(f"moelab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        if name in ("", "-h", "--help"):
            print(_usage())
            return 0 if argv else 2
        return int(COMMANDS[name][0](rest) or 0)
    except KeyboardInterrupt:
        # Results are written atomically: an interrupted command leaves its old output or none.
        print(f"\nmoelab {name}: interrupted; no partial output file was written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (moelab ... | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
