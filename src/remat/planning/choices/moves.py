"""A plan whose blocks move bytes to host memory, improved a block or two at a time on its own timeline.

The chain's dynamic program adds prices block by block; a plan whose copies run under a schedule is priced and sized on
its timeline (:func:`~remat.planning.choices.options.copy_schedule`), where a copy hides behind the forwards after it
and the bytes its copies hold differ from stretch to stretch.  Such a plan often leaves room under its budget, or time
on the link, that the sums could not see.  :func:`cheaper_choices` moves blocks to other options of theirs while the
timeline prices the plan lower: one block at a time where one move fits the budget, else a pair (a move that saves
time but needs room, and one that makes the room), each pair estimated from the two moves alone and the best few
priced whole.

Example:
    >>> placed = cheaper_choices(prof, placed, chain_options(prof), lambda chosen: predict(prof, chosen)[0], budget)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..measure.profile import StepProfile
from .options import BlockOption, step_extra_time

__all__ = ["cheaper_choices"]

_ROUNDS = 8  # moves per block at most: each lowers the plan's (time, peak), so few are ever needed
_PAIRS = 8  # pairs priced whole per round, the best estimated first


def cheaper_choices(prof: StepProfile, placed: list[tuple[int, BlockOption]] | None, options: list[list[BlockOption]],
                    peak: Callable[[Sequence[BlockOption]], int], budget: int) -> list[tuple[int, BlockOption]] | None:
    """``placed``, with blocks moved to others of their ``options`` while the timeline prices the plan lower, or as low
    at a lower ``peak`` (room a later move may spend), and it stays within ``budget``: the best single move first,
    else the best pair (see the module docstring).  Only for plans whose copies run under a schedule (kept blocks
    moving tensors); others come back as they are.

    Example:
        >>> cheaper_choices(prof, placed, chain_options(prof), lambda chosen: predict(prof, chosen)[0], budget)
    """
    if placed is None or not any(o.copies or o.moved for _, o in placed):
        return placed
    chosen = [o for _, o in placed]
    starts = [p for p, _ in placed]
    current = (step_extra_time(prof, chosen), peak(chosen))
    for _ in range(_ROUNDS * len(chosen)):
        moves = []  # (time, peak, block, option) of each single move
        for k, p in enumerate(starts):
            if chosen[k].span > 1:
                continue
            for option in options[p]:
                if option.span == 1 and option is not chosen[k]:
                    trial = [*chosen[:k], option, *chosen[k + 1:]]
                    moves.append((step_extra_time(prof, trial), peak(trial), k, option))
        fits = [m for m in moves if m[1] <= budget and (m[0], m[1]) < current]
        best = min(fits, key=lambda m: (m[0], m[1]), default=None)
        found = ((best[0], best[1]), _moved(chosen, best)) if best is not None else None
        if found is None:
            found = _best_pair(prof, chosen, moves, current, peak, budget)
        if found is None:
            break
        current, chosen = found
    return list(zip(starts, chosen))


def _moved(chosen: list[BlockOption], *moves: tuple[float, int, int, BlockOption]) -> list[BlockOption]:
    trial = list(chosen)
    for _, _, k, option in moves:
        trial[k] = option
    return trial


def _best_pair(prof: StepProfile, chosen: list[BlockOption], moves: list[tuple[float, int, int, BlockOption]],
               current: tuple[float, int], peak: Callable[[Sequence[BlockOption]], int], budget: int
               ) -> tuple[tuple[float, int], list[BlockOption]] | None:
    """The cheapest pair of single moves that fits, of the ``_PAIRS`` whose sums of changes promise the most."""
    time, high = current
    saving = [m for m in moves if m[0] < time]
    room = [m for m in moves if m[1] < high]
    estimates = sorted(((a[0] + b[0] - time, a, b) for a in saving for b in room
                        if a[2] != b[2] and a[1] + b[1] - high <= budget and a[0] + b[0] - time < time),
                       key=lambda e: e[0])
    best = None
    for _, a, b in estimates[:_PAIRS]:
        trial = _moved(chosen, a, b)
        priced = (step_extra_time(prof, trial), peak(trial))
        if priced[1] <= budget and priced < (best[0] if best else current):
            best = (priced, trial)
    return best
