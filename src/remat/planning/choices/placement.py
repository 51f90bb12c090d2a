"""Where a plan's options sit among interchangeable blocks: the placement the copy timeline prices cheaper.

The chain's dynamic program adds prices block by block, so two plans that give the same options to blocks alike
in every figure (a transformer's layers) tie on its sums whichever blocks get which.  Their copies do not
tie: a block early in forward has the whole forward to hide its copies out behind, one late in forward has
its copies back needed first in backward.  :func:`cheaper_placement` swaps the options of such blocks while the
step's timeline (:func:`~remat.planning.choices.options.step_extra_time`) prices the plan cheaper and its peak does not
rise, so of the plans of equal memory the solver returns one the timeline prefers.

Example:
    >>> placed = cheaper_placement(prof, placed, lambda chosen: predict(prof, chosen)[0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..measure.profile import StepProfile
from .options import BlockOption, step_extra_time

__all__ = ["cheaper_placement"]

_ROUNDS = 8  # passes over the pairs: each keeps only swaps that lower the price, so few are ever needed


def cheaper_placement(prof: StepProfile, placed: list[tuple[int, BlockOption]] | None,
                      peak: Callable[[Sequence[BlockOption]], int], options: list[list[BlockOption]] | None = None
                      ) -> list[tuple[int, BlockOption]] | None:
    """``placed`` (the block each run of options starts at, the option), with the options of alike single blocks
    swapped where the step's timeline prices the plan lower at no higher ``peak``; None stays None.  With
    ``options`` (each block's), a block only takes an option like one it was offered (the chain's last block is
    offered no copies out: backward starts there).

    Only plans that move bytes to host memory can be priced differently by placement; others come back as
    they are.

    Example:
        >>> cheaper_placement(prof, [(0, keep), (1, offloading)], lambda chosen: predict(prof, chosen)[0])
    """
    if placed is None or not any(o.copies or o.moved for _, o in placed):
        return placed
    chosen = [o for _, o in placed]
    starts = [p for p, _ in placed]
    singles = [k for k, o in enumerate(chosen) if o.span == 1]
    best_time, best_peak = step_extra_time(prof, chosen), peak(chosen)
    for _ in range(_ROUNDS):
        improved = False
        for a in singles:
            for b in singles:
                if b <= a or chosen[a] == chosen[b] or not _alike(prof, starts[a], starts[b]):
                    continue
                if options is not None and (chosen[a] not in options[starts[b]] or chosen[b] not in options[starts[a]]):
                    continue
                trial = list(chosen)
                trial[a], trial[b] = chosen[b], chosen[a]  # alike blocks: the same figures wherever an option runs
                time = step_extra_time(prof, trial)
                if time < best_time and peak(trial) <= best_peak:
                    chosen, best_time, improved = trial, time, True
        if not improved:
            break
    return list(zip(starts, chosen))


def _alike(prof: StepProfile, a: int, b: int) -> bool:
    """Blocks whose rows agree in every figure but their names and positions (repeated layers)."""
    ra, rb = prof.rows[a], prof.rows[b]
    graphs = prof.ops.blocks if prof.ops is not None else {}
    return (ra.cls == rb.cls and ra.own_bytes == rb.own_bytes and ra.held_bytes == rb.held_bytes
            and ra.forward_time == rb.forward_time and ra.recompute_bytes == rb.recompute_bytes
            and ra.checkpoint_time == rb.checkpoint_time and graphs.get(ra.name) is graphs.get(rb.name))
