"""What a fused rerun costs: a block's keep-nothing refill compiled and timed while profiling.

Inside :func:`remat.policies.fused_reruns` a region refilled from its program runs its rerun as one compiled
graph (:mod:`remat.policies.fused`): the matmuls, attention and random ops stay kernels of their own (a
compiler calls the library's), while the elementwise work between them (norms, rotary embeddings,
activations, casts) becomes a few kernels that read their inputs once.  What those cost cannot be read off
the op-by-op kernel times the profile measures, so a profile taken inside ``fused_reruns`` compiles each
distinct block's keep-nothing refill and times it on the device (:func:`time_fused_refill`).

The price of a fused rerun is then additive over ops, as the fronts need: an *extern* op (matmul-like,
attention, random) costs its measured kernel time, and every other op its kernel time times one factor per
block (:func:`remat.planning.prices.fused_shares`), the one that makes the keep-nothing refill cost what was
measured:

    factor = (fused refill time - extern kernels) / other kernels

so keeping a matmul spares its kernel, and keeping an elementwise output spares its share of the fused
kernels.  The factor is at most 1: a refill slower than its ops run one by one (a call's fixed cost above
tiny ops) counts the excess as a fixed cost of every fused refill of the block, which keeping spares none
of.  The host pays one compiled call per refill (``host_time``) instead of a Python trip per op.

Example:
    >>> with remat.policies.fused_reruns():
    ...     prof = remat.profile(model, tokens)   # blocks with programs: their fused refill timed
    >>> plan = prof.plan(0.5)                     # priced as fused reruns run
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..policies.fused import fuses, run_fused
from ..policies.program import _Program, _Schedule
from .timing import Clock, device_of

__all__ = ["FusedRefill", "time_fused_refill"]


@dataclass(frozen=True)
class FusedRefill:
    """A block's keep-nothing refill, compiled by ``backend`` and timed: device and host seconds per call."""

    backend: str
    device_time: float
    host_time: float


def time_fused_refill(program: _Program, refill: _Schedule, inputs: Sequence[torch.Tensor], backend: str,
                      repeats: int) -> FusedRefill | None:
    """Compile ``refill`` (a block's keep-nothing refill) with ``backend`` and time it on its device's clock:
    medians over ``repeats`` calls after two warm-ups (the first compiles).  None where it runs op by op
    (two random ops, nothing to compute, a compiler that failed).

    Random ops draw from the generators as they are: call it with the RNG forked.

    Example:
        >>> found = time_fused_refill(program, refill, inputs, "inductor", repeats=5)
    """
    if not fuses(program, refill, inputs, backend):
        return None
    clock = Clock(device_of([*inputs, *(ref() for ref in program.state if ref() is not None)]))

    def call() -> None:
        run_fused(program, refill, len(program.packs), inputs, _nothing_served, backend)

    with torch.no_grad():
        for _ in range(2):
            clock.time(call)
        if not fuses(program, refill, inputs, backend):  # the compiler failed: its reruns run op by op
            return None
        times = [clock.time(call)[1:] for _ in range(repeats)]
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
    return FusedRefill(name, statistics.median(t[0] for t in times), statistics.median(t[1] for t in times))


def _nothing_served(step: object) -> None:
    raise AssertionError("a keep-nothing refill serves no kept output")
