"""``checkpoint_sequential``: checkpoint a chain of modules in equal segments; ``checkpoint_runs``: checkpoint
chosen runs of an ``nn.Sequential``'s children in place, each as one region (what a plan's segments install)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .checkpoint import checkpoint
from .modules import checkpoint_wrapper

__all__ = ["SegmentedForward", "checkpoint_runs", "checkpoint_sequential", "checkpointed_runs", "remove_runs"]


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


class SegmentedForward:
    """The forward of an ``nn.Sequential`` whose runs of children are checkpointed, each run as one region.

    Installed as the container's ``forward`` by :func:`checkpoint_runs`: the children stay where they are (so
    ``state_dict`` keys, indexing and a child called alone are as before) and only the container's own call
    changes.  ``runs`` are ``(start, stop)`` positions of its children, disjoint and in order.
    """

    def __init__(self, container: torch.nn.Sequential, runs: Sequence[tuple[int, int]], name: str) -> None:
        self.container, self.runs, self.name = container, [tuple(r) for r in runs], name
        self._regions: dict[tuple[int, int], tuple[tuple[int, ...], Callable]] = {}

    def _region(self, children: list[torch.nn.Module], start: int, stop: int) -> Callable:
        """The run's checkpointed callable, rebuilt when one of its children was replaced."""
        members = tuple(id(m) for m in children[start:stop])
        cached = self._regions.get((start, stop))
        if cached is None or cached[0] != members:
            # An unregistered Sequential of the same children: calling it runs them under one region, and the
            # wrapper restores buffers its forward wrote (batch norm's statistics) before a recomputation.
            run = torch.nn.Sequential(*children[start:stop])
            run._remat_path = f"{self.name}[{start}:{stop}]" if self.name else f"[{start}:{stop}]"
            cached = (members, checkpoint_wrapper(run))
            self._regions[(start, stop)] = cached
        return cached[1]

    def __call__(self, input: Any) -> Any:
        children = list(self.container._modules.values())
        position, value = 0, input
        for start, stop in [*self.runs, (len(children), len(children))]:
            for child in children[position:start]:
                value = child(value)
            if stop > start:
                value = self._region(children, start, stop)(value)
            position = stop
        return value


def checkpoint_runs(container: torch.nn.Sequential, runs: Sequence[tuple[int, int]], name: str = ""
                    ) -> torch.nn.Sequential:
    """Checkpoint each run ``(start, stop)`` of ``container``'s children as one region, in place.

    Runs are disjoint, in order, each of at least one child; calling it again replaces the runs, and ``[]``
    restores the container's own forward (as :func:`remove_runs`).  The container must chain its children
    with ``nn.Sequential``'s own forward.  Its children, their names and ``state_dict`` keys are unchanged.
    ``name`` names the container in error messages.  Returns ``container``.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        >>> checkpoint_runs(model, [(0, 3), (3, 5)])           # two regions; the last layer runs plainly
        >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    """
    if not isinstance(container, torch.nn.Sequential) or type(container).forward is not torch.nn.Sequential.forward:
        raise TypeError(f"remat.checkpoint_runs: {type(container).__name__} is not an nn.Sequential that chains "
                        "its children with nn.Sequential's own forward.")
    runs = [(int(a), int(b)) for a, b in runs]
    ends = [0] + [x for run in runs for x in run]
    if any(b <= a for a, b in runs) or ends != sorted(ends) or (runs and runs[-1][1] > len(container)):
        raise ValueError(f"remat.checkpoint_runs: runs must be disjoint, in order, non-empty and within the "
                         f"{len(container)} children; got {runs}.")
    remove_runs(container)
    if runs:
        container.forward = SegmentedForward(container, runs, name)
    return container


def checkpointed_runs(container: torch.nn.Module) -> list[tuple[int, int]]:
    """The runs :func:`checkpoint_runs` installed on ``container`` (``[]`` if none).

    Example:
        >>> checkpointed_runs(checkpoint_runs(model, [(0, 3)]))
        [(0, 3)]
    """
    forward = container.__dict__.get("forward")
    return list(forward.runs) if isinstance(forward, SegmentedForward) else []


def remove_runs(container: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`checkpoint_runs`: the container's own forward again. Returns ``container``.

    Example:
        >>> remove_runs(model)
    """
    if isinstance(container.__dict__.get("forward"), SegmentedForward):
        del container.__dict__["forward"]
    return container
