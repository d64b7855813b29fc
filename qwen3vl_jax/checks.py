"""Argument checks shared by the command line and the API behind it, so both refuse the same input
with the same words: each names the argument and what would be accepted.

`name` is the argument as the caller knows it (`--learning-rate` on the command line,
`learning_rate` in `OptimConfig`); the rest of the message is the same.
"""

from __future__ import annotations

import math
import numbers
import os

__all__ = ["ArgumentError", "positive_int", "non_negative_int", "positive_number", "non_negative_number",
           "fraction", "existing_file", "output_directory"]


class ArgumentError(ValueError):
    """An argument outside what is accepted; the message names it."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value) -> int:
    if not _is_int(value) or value < 1:
        raise ArgumentError(f"{name} must be a positive integer (1, 2, ...), got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    if not _is_int(value) or value < 0:
        raise ArgumentError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def positive_number(name: str, value) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def non_negative_number(name: str, value) -> float:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def fraction(name: str, value) -> float:
    """A number in [0, 1)."""
    if not _is_number(value) or not math.isfinite(value) or not 0 <= value < 1:
        raise ArgumentError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def existing_file(name: str, path) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ArgumentError(f"{name} names a directory ({path}); it must be a file")
    if not os.path.isfile(path):
        raise ArgumentError(f"{name}: no such file: {path}")
    return path


def output_directory(name: str, path) -> str:
    """A directory to write into: absent (it is created) or a directory, never a file."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ArgumentError(f"{name} names a file ({path}); it must be a directory (absent or existing)")
    return path
