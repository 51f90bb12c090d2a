"""``checkpoint_sequential``: checkpoint a chain of modules in equal segments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .checkpoint import checkpoint

__all__ = ["checkpoint_sequential"]


class _Segment:
    """Runs ``functions[start:end]`` in order; a named callable so errors can name it."""

    def __init__(self, functions: Sequence[Callable], start: int, end: int, unpack_tuples: bool) -> None:
        self.functions = functions[start:end]
        self.unpack_tuples = unpack_tuples
        self.__qualname__ = f"checkpoint_sequential.segment[{start}:{end}]"
        self.__module__ = __name__

    def __call__(self, *values: Any) -> Any:
        for fn in self.functions:
            if self.unpack_tuples:
                out = fn(*values)
                values = out if isinstance(out, tuple) else (out,)
            else:
                values = (fn(*values),)
        return values if self.unpack_tuples and len(values) != 1 else values[0]


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    *,
    unpack_tuples: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``functions`` in order, checkpointing all segments but the last.

    Drop-in for ``torch.utils.checkpoint.checkpoint_sequential``.  With
    ``unpack_tuples=True`` stages may take several inputs: a tuple ``input``
    and any tuple a stage returns are spread over the next stage's arguments.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> checkpoint_sequential(model, 2, x).sum().backward()
    """
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError(f"remat.checkpoint_sequential: unexpected keyword arguments {sorted(kwargs)}.")
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    if not 1 <= segments <= max(len(functions), 1):
        raise ValueError(
            f"remat.checkpoint_sequential: segments must be between 1 and the number of functions "
            f"({len(functions)}), got {segments}."
        )
    size = len(functions) // segments
    values = input if unpack_tuples and isinstance(input, tuple) else (input,)
    start = 0
    for _ in range(segments - 1):
        segment = _Segment(functions, start, start + size, unpack_tuples)
        out = checkpoint(
            segment, *values, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state
        )
        values = out if unpack_tuples and isinstance(out, tuple) else (out,)
        start += size
    return _Segment(functions, start, len(functions), unpack_tuples)(*values)
