"""Bytes and budgets as people write them: sizes like ``8GiB``, budgets like ``50%``, sizes printed readably."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["FREE_MARGIN", "LARGEST_PERCENT_LIKE", "SMALLEST_BARE_BYTES", "Budget", "format_bytes", "parse_budget",
           "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30}

SMALLEST_BARE_BYTES = 2**20
"""A budget written as a bare integer below this (``--budget 50``) is refused: people write sizes with a unit."""

LARGEST_PERCENT_LIKE = 100
"""An int budget up to this (``prof.plan(50)``) is refused as a likely missing ``%``; larger ints are bytes."""

FREE_MARGIN = 0.1
"""The share of a device's memory a ``"free"`` budget leaves unplanned by default: the allocator's fragmentation
and what the step does beside the model (the optimizer's state is no part of a plan's peak)."""

_FORMS = ("a fraction in (0, 1] of the unplanned peak above parameters (0.5 or 50%), a whole-step size "
          "(8GiB, 512MB) or what the device has free (free, free-4GiB, free-20%)")


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"8GiB"``, ``"512MB"`` or ``"1.5 GiB"`` into bytes.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write it like 8GiB, 512MB or 1048576.")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """A size for people: ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Budget:
    """A memory budget: a ``fraction`` of the unplanned step's peak above parameters, or ``nbytes`` for the
    whole step (parameters included).  Exactly one of the two is set; ``str()`` gives it as people write it.

    Example:
        >>> parse_budget("50%").bytes_for(fixed=100, unplanned_above=1000)
        600
    """

    fraction: float | None = None
    nbytes: int | None = None
    text: str = ""
    # "free": what the profiled device has free when planning, less a margin (bytes, or a share of the device)
    free: bool = False
    margin_bytes: int | None = None
    margin_fraction: float | None = None

    def bytes_for(self, fixed: int, unplanned_above: int) -> int:
        """The whole-step budget in bytes, for a step whose parameters and buffers take ``fixed`` bytes and
        whose peak without a plan is ``unplanned_above`` bytes above them."""
        if self.free:
            raise ValueError("remat.plan: a 'free' budget is read on the device the model was profiled on; "
                             "plan from the profile (prof.plan('free')) in the process that has the device.")
        if self.fraction is None:
            return self.nbytes
        return fixed + int(self.fraction * unplanned_above)

    def __str__(self) -> str:
        if self.text:
            return self.text
        return f"{self.fraction * 100:g}%" if self.fraction is not None else format_bytes(self.nbytes)


def parse_budget(value: Budget | int | float | str) -> Budget:
    """Read a budget the one way Python and the ``remat`` command share.

    * ``"50%"`` or a float / decimal string such as ``0.5`` or ``"0.5"``: a fraction in (0, 1] of the
      unplanned step's peak above parameters;
    * ``"8GiB"``, ``"512MB"``: a whole-step size;
    * ``"free"``, ``"free-4GiB"``, ``"free-20%"``: what the profiled (CUDA) device has free when the plan is
      made, with the model's own parameters and buffers, less a margin (by default :data:`FREE_MARGIN` of the
      device's memory; ``20%``: of the device's memory);
    * an int is bytes (a computed size: ``8 * 2**30``, ``InfeasibleBudget.smallest``), except 1 to 100, which
      is refused as a likely missing ``%`` (``prof.plan(50)``: did you mean 50%?);
    * a string of a bare integer is bytes from 1 MiB up; below that (``"50"``) it is refused too: a size
      typed by hand carries its unit.

    Zero and negative budgets are refused.  Every refusal is a ValueError whose one line gives the valid forms.

    Example:
        >>> parse_budget("50%"), parse_budget(0.5) == parse_budget("50%"), parse_budget("8GiB").nbytes
        (Budget(fraction=0.5, nbytes=None, text='50%'), True, 8589934592)
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, str):
        return _parse_text(value.strip())
    if isinstance(value, float):
        return _fraction(value, f"{value:g}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value > LARGEST_PERCENT_LIKE:
            return Budget(nbytes=value)
        raise ValueError(_not_bytes(str(value), value))
    raise ValueError(f"a budget must be {_FORMS}, or bytes as an int; got {value!r} ({type(value).__name__}).")


def _parse_text(text: str) -> Budget:
    if free := re.fullmatch(r"free\s*(?:-\s*(.+))?", text, re.IGNORECASE):
        return _free(free.group(1), text)
    if percent := re.fullmatch(r"(-?[0-9]*\.?[0-9]+)\s*%", text):
        return _fraction(float(percent.group(1)) / 100, text, percent=True)
    if re.fullmatch(r"-?[0-9]*\.[0-9]+", text):
        return _fraction(float(text), text)
    if re.fullmatch(r"-?[0-9]+", text):
        if int(text) < SMALLEST_BARE_BYTES:
            raise ValueError(_not_bytes(text, int(text)))
        return Budget(nbytes=int(text), text=text)
    if text.startswith("-"):
        raise ValueError(f"budget {text} is negative: write {_FORMS}.")
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a budget: write {_FORMS}.") from None
    if nbytes <= 0:
        raise ValueError(f"budget {text} is no memory at all: write {_FORMS}.")
    return Budget(nbytes=nbytes, text=text)


def _not_bytes(text: str, value: int) -> str:
    """Why a bare integer is refused as a budget, with the forms that work."""
    if value < 0:
        return f"budget {text} is negative: write {_FORMS}."
    if value == 0:
        return f"budget 0 is no memory at all: write {_FORMS}."
    if value <= LARGEST_PERCENT_LIKE:
        return f"budget {text} would be {text} B: did you mean {text}%? Write {_FORMS}."
    return f"budget {text} would be {format_bytes(value)}: write a size with its unit (8GiB, 512MB) or a fraction " \
           "in (0, 1] of the unplanned peak above parameters (0.5 or 50%)."


def _fraction(value: float, shown: str, percent: bool = False) -> Budget:
    if not 0 < value <= 1:
        if percent or value <= 0:
            hint = ""
        elif value <= LARGEST_PERCENT_LIKE:
            hint = f" (did you mean {shown}%? for a size, give bytes as an int or write it like 8GiB)"
        else:
            hint = " (for a size, give bytes as an int or write it like 8GiB)"
        raise ValueError(f"a fraction budget must be in (0, 1] (0.5 or 50% of the unplanned peak above "
                         f"parameters); got {shown}{hint}.")
    return Budget(fraction=value, text=shown if percent else "")


def _free(margin: str | None, text: str) -> Budget:
    """``free`` (a margin of :data:`FREE_MARGIN` of the device), ``free-4GiB`` or ``free-20%``."""
    if margin is None:
        return Budget(free=True, margin_fraction=FREE_MARGIN, text=text)
    if share := re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", margin.strip()):
        fraction = float(share.group(1)) / 100
        if not 0 <= fraction < 1:
            raise ValueError(f"budget {text}: the margin must be under 100% of the device's memory.")
        return Budget(free=True, margin_fraction=fraction, text=text)
    if re.fullmatch(r"[0-9]*\.?[0-9]+", margin.strip()) and float(margin) != 0:  # a size typed carries its unit
        raise ValueError(f"budget {text}: write the margin with its unit ({text.split('-')[0]}-{margin.strip()}GiB) "
                         f"or as a share of the device ({text.split('-')[0]}-{margin.strip()}%).")
    try:
        return Budget(free=True, margin_bytes=parse_bytes(margin), text=text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a budget: write {_FORMS}.") from None
