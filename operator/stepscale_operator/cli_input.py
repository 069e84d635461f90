"""Checking what a user types on the ``stepscale`` command line.

:class:`InputError` is a mistake in what the user gave (a missing file, a
malformed trace, a value out of range): :func:`stepscale_operator.cli.main` prints
its message as one line, exit status 2, no traceback. The argument types below
turn a bad value into argparse's usage error, naming the value and what is
expected; :class:`OneLineParser` prints that as one line too.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn


class InputError(ValueError):
    """A bad input the user can fix; its message names the input and what is expected."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (and exit status 2)."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def report(command: str, error: Exception) -> int:
    """Print ``error`` as the one-line message of ``command``; returns exit status 2."""
    print(f"{command}: error: {error}", file=sys.stderr)
    return 2


def _number(text: str, kind: type[float] | type[int], expected: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    value = _number(text, float, "a number > 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return float(value)


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    value = _number(text, float, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return float(value)


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _number(text, int, "a whole number >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(value)


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    value = _number(text, int, "a whole number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(value)


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value = _number(text, int, "a TCP port (1-65535)")
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {text!r}")
    return int(value)
