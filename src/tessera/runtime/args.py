"""Argument types the launcher and the command line share (standard library only, so the
command line's parsers stay light)."""

from __future__ import annotations

import argparse


def _int_at_least(text: str, low: int, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {words}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, or a one-line error naming the value."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0, or a one-line error naming the value."""
    return _int_at_least(text, 0, "an integer >= 0")
