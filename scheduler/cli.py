"""The ``moelab`` command: dispatches each subcommand to the package that owns it.

Subcommand modules are imported only when their command runs, so ``moelab trace ...`` never loads
simpy, cupy or numba. Each handler is ``main(argv: list[str]) -> int`` for its command. Ctrl-C ends
any command with one line and status 130 (a handler that keeps partial work says what it kept).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["main", "COMMANDS", "ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error every moelab command gives: ``prog: error: message``,
    exit status 2 (the usage is one ``--help`` away, not printed above the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")

# command -> (module, function, one-line help)
COMMANDS = {
    "trace": ("traces.cli", "main", "import, inspect, fit and synthesise routing traces"),
    "profile": ("scheduler.profile_cli", "main", "build, read and check STRP expert profiles"),
    "simulate": ("simulate.cli", "simulate_main", "simulate decode of a trace under a policy and hardware"),
    "sweep": ("simulate.cli", "sweep_main", "simulate many configurations, resumable, to CSV and plots"),
    "model": ("execute.cli", "model_main", "synthesise or describe GGUF models"),
    "replay": ("execute.cli", "replay_main", "run a trace through real GPU/CPU expert kernels"),
    "run": ("execute.cli", "run_main", "decode text with a GGUF model under a policy"),
    "kld": ("execute.kld", "main", "KL divergence of a policy's next-token distributions to the numpy reference"),
    "calibrate": ("execute.calibrate", "main", "measure this machine and write a hardware file for moelab simulate"),
}


def _usage() -> str:
    lines = ["usage: moelab COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "moelab COMMAND --help shows a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moelab: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        handler = getattr(importlib.import_module(module), func)
        return int(handler(rest) or 0)
    except KeyboardInterrupt:
        # Results are written atomically: an interrupted command leaves its old output or none.
        print(f"\nmoelab {name}: interrupted; no partial output file was written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (moelab ... | head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
