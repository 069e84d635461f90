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
from collections.abc import Callable
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


def _number(
    text: str, kind: type[float] | type[int], expected: str, accept: Callable[[float], bool]
) -> float:
    """``text`` as a ``kind`` that ``accept`` takes, else argparse's usage error
    saying what was ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not accept(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    return float(_number(text, float, "a number > 0", lambda v: v > 0))


def non_negative_float(text: str) -> float:
    """A number >= 0."""
    return float(_number(text, float, "a number >= 0", lambda v: v >= 0))


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return int(_number(text, int, "a whole number >= 1", lambda v: v >= 1))


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    return int(_number(text, int, "a TCP port (1-65535)", lambda v: 0 < v < 65536))
