"""Value types of the command line's numeric arguments: a bad value is argparse's usage
error naming the argument, not a traceback or a silent fallback."""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (a timeout, a bandwidth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def count(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse
