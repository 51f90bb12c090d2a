"""Bytes as people write them: parse sizes like ``8GiB`` and print sizes readably."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"8GiB"``, ``"512MB"`` or ``"1.5 GiB"`` into bytes.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    import re

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
