"""Argument types for the ``remat`` command: each refuses a bad value at parse time, in one line, with the range.

No torch here: ``remat --help`` and mistakes in the arguments answer at once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ..planning.basics.optimizers import OPTIMIZERS

__all__ = ["add_optimizer_argument", "at_least", "fraction_below_one", "writable_file"]


def at_least(smallest: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``smallest`` up; ``why`` (e.g. "the planner needs two blocks") is told
    with a refusal.

    Example:
        >>> at_least(1)("3")
        3
    """
    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < smallest:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be at least {smallest}{reason}, got {value}")
        return value

    read.__name__ = "integer"  # what argparse names in its own messages
    return read


def fraction_below_one(text: str) -> float:
    """An argparse type: a probability in [0, 1), as dropout takes.

    Example:
        >>> fraction_below_one("0.1")
        0.1
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) such as 0.1, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1) such as 0.1, got {text}")
    return value


def writable_file(text: str) -> str:
    """An argparse type: a file path whose folder exists, so that a long run does not fail at its last step.
    The empty string (no file) passes.

    Example:
        >>> writable_file("plan.json")
        'plan.json'
    """
    if not text:
        return text
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name, e.g. {os.path.join(text, 'out')}")
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {folder} is not writable; write elsewhere")
    return text


def add_optimizer_argument(parser: argparse.ArgumentParser) -> None:
    """``--optimizer``, one of :data:`~remat.planning.basics.optimizers.OPTIMIZERS`: shared by every command and
    benchmark that trains."""
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="the optimizer stepping between steps: adamw (the default; lr 1e-3, foreach), sgd "
                             "(lr 1e-2, momentum 0.9) or adamw-fused")
