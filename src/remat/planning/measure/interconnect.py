"""The interconnect between ranks: what a collective costs where none is timed (the meta device).

A collective (a tensor-parallel layer's all-reduce, sequence parallel's all-gathers and reduce-scatters) costs what
crossing the interconnect between the ranks costs: ``latency + bus bytes / bandwidth``, with nccl-tests' conventions
for the bytes each rank moves over its link (``busbw``), ``n`` the size of the collective's group and ``size`` the
whole tensor's bytes:

* all-reduce: ``2 (n - 1) / n x size``;
* all-gather (``size``: the gathered output) and reduce-scatter (``size``: the input, before scattering):
  ``(n - 1) / n x size``;
* all-to-all: ``(n - 1) / n x size``; broadcast: ``size``.

A collective's wait costs nothing more (the collective carries the time), and a group of one rank sends nothing.
Not the host link of :mod:`remat.planning.measure.copies` (device to host memory, one process's copies).

Example:
    >>> Interconnect(bandwidth=100e9, latency=10e-6).seconds("all_reduce", 1 << 20, 2)   # 10 us + 1 MiB / 100 GB/s
    2.0485...e-05
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...policies.rules import is_collective
from ..basics.ranks import local

__all__ = ["DEFAULT_BANDWIDTH", "DEFAULT_LATENCY", "CollectiveClock", "Interconnect", "bus_factor"]

# An NVLink-connected node of current data-centre GPUs, as nccl-tests measures its all-reduce bus bandwidth
# (A100 about 230 GB/s, H100 about 360 to 480 GB/s) and its small-message latency (about 10 us).
DEFAULT_BANDWIDTH = 200e9
DEFAULT_LATENCY = 10e-6


def bus_factor(kind: str, ranks: int) -> float:
    """The share of a collective's whole tensor that each rank moves over its link (nccl-tests' bus bandwidth
    factor) for ``kind`` (an operator name: ``"all_reduce"``, ``"all_gather_into_tensor"``, ...) in a group of
    ``ranks``; 0 for one rank, or for a wait.

    Example:
        >>> bus_factor("all_reduce", 8), bus_factor("reduce_scatter_tensor", 8)
        (1.75, 0.875)
    """
    if ranks <= 1 or kind.startswith("wait"):
        return 0.0
    if kind.startswith("all_reduce"):
        return 2 * (ranks - 1) / ranks
    if kind.startswith("broadcast"):
        return 1.0
    return (ranks - 1) / ranks  # all-gather, reduce-scatter, all-to-all


@dataclass(frozen=True)
class Interconnect:
    """The link between ranks: ``bandwidth`` bytes per second each rank's link carries (nccl-tests' bus
    bandwidth), and ``latency`` seconds every collective costs whatever its size.

    Example:
        >>> Interconnect(200e9, 10e-6).seconds("all_gather_into_tensor", 8 << 20, 4)   # the gathered 8 MiB
        4.1457...e-05
    """

    bandwidth: float = DEFAULT_BANDWIDTH
    latency: float = DEFAULT_LATENCY

    def __post_init__(self) -> None:
        if not _positive(self.bandwidth):
            raise ValueError(f"remat.profile: interconnect_bandwidth must be the bytes per second each rank's link "
                             f"carries, more than 0, got {self.bandwidth!r}; e.g. 200e9 for NVLink, 25e9 for a "
                             "200 Gb/s network.")
        if not _positive(self.latency) and self.latency != 0:
            raise ValueError(f"remat.profile: interconnect_latency must be the seconds a collective costs whatever "
                             f"its size, 0 or more, got {self.latency!r}; e.g. 10e-6.")

    def seconds(self, kind: str, size: int, ranks: int) -> float:
        """What one collective of ``kind`` on a tensor of ``size`` bytes (the whole tensor: an all-gather's
        output, a reduce-scatter's input) costs in a group of ``ranks``; nothing for a wait or a group of one.

        Example:
            >>> Interconnect(100e9, 0.0).seconds("all_reduce", 100_000, 4)
            1.5e-06
        """
        factor = bus_factor(kind, ranks)
        return 0.0 if factor == 0 else self.latency + factor * size / self.bandwidth

    def op_seconds(self, func: Any, args: tuple, kwargs: dict) -> float:
        """What the collective operator ``func`` called on ``args`` / ``kwargs`` costs (see :meth:`seconds`).

        Example:
            >>> link.op_seconds(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group.group_name), {})
        """
        kind = func._overloadpacket.__name__
        ranks = _group_size(func, args, kwargs)
        size = sum(_nbytes(t) for t in _tensors(args[:1] if args else ()))  # its first argument: the input(s)
        if kind.startswith("all_gather"):
            size *= ranks  # the whole tensor is the gathered output
        return self.seconds(kind, size, ranks)


class CollectiveClock(TorchDispatchMode):
    """Sums what the collectives run under it cost over ``interconnect`` (``seconds``), and counts them
    (``count``; their waits left out).

    Example:
        >>> with CollectiveClock(Interconnect()) as clock:
        ...     loss_fn(model(tokens)).backward()
        >>> clock.seconds
    """

    def __init__(self, interconnect: Interconnect) -> None:
        super().__init__()
        self.interconnect = interconnect
        self.seconds = 0.0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_collective(func):
            self.seconds += self.interconnect.op_seconds(func, args, kwargs)
            self.count += func._overloadpacket.__name__ != "wait_tensor"
        return func(*args, **kwargs)


def _group_size(func: Any, args: tuple, kwargs: dict) -> int:
    """The number of ranks in the group a collective call runs on: its ``group_size`` argument where it has one,
    else its group's (named by ``group_name``); 1 where it names none."""
    named = dict(kwargs)
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            named[argument.name] = args[position]
    if isinstance(named.get("group_size"), int):
        return named["group_size"]
    group = named.get("group_name")
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return group.size() if hasattr(group, "size") else 1


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    # A DTensor as the part this rank holds, as the op graph counts it.
    return [local(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
