"""The argument parser every moelab command uses: one-line errors, exit status 2."""
from __future__ import annotations

import argparse

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error every moelab command gives: ``prog: error: message``,
    exit status 2 (the usage is one ``--help`` away, not printed above the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")
