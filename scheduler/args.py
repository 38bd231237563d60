"""The argument parser every moelab command uses: one-line errors, exit status 2."""
from __future__ import annotations

import argparse

__all__ = ["ArgumentParser", "int_at_least"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error every moelab command gives: ``prog: error: message``,
    exit status 2 (the usage is one ``--help`` away, not printed above the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def int_at_least(low: int):
    """An argparse ``type``: an integer >= ``low`` (the error says which was expected)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v}")
        return v
    return parse
