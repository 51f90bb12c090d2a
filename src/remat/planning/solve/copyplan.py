"""Plans whose blocks move bytes to host memory: their peak stretch by stretch, and the plans that offload first.

A plan that moves bytes (``checkpoint_offload``'s inputs, ``keep_offload``'s largest tensors) runs its copies under
a schedule (:func:`~remat.planning.choices.options.copy_schedule`): they are bounded at each block's start (the host
waits for the oldest beyond the bound), kept blocks' copies go out with no window limit and come back a block or two
ahead.  What the copies hold on the device then differs from stretch to stretch,
so :func:`scheduled_peak` adds it where it is held rather than once for the step:

* a forward stretch before block ``p``: the copies in the window when block ``p`` starts (``before[p]``, which the
  drain where block ``p - 1`` ends holds them to); block ``p``'s own forward: those its drain leaves (``after[p]``);
  block ``p``'s own tensors are its forward's anyway;
* the stretches after the last block (the head and the loss): nothing, every copy is complete when the last
  block's forward ends;
* block ``p``'s backward, and the backward stretches after it: the earlier blocks' tensors already back (``back[p]``),
  and a recomputing block's own moved inputs, which its rerun needs.

The chain's dynamic program adds prices block by block and cannot see a timeline, where a copy is hidden by the
forwards that follow it.  :func:`offload_first` adds the plans that use that: the first ``m`` blocks move their ``k``
largest saved tensors (the link has the rest of forward to carry them, backward the longest to bring them back), and
the fewest blocks after them that are checkpointed, inputs offloaded where they may be, for the plan to fit; the blocks
after those kept, or moving what their own forward hides.

Example:
    >>> peak = scheduled_peak(prof, chosen, Accounting(prof), copy_schedule(prof, chosen))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..choices.options import BlockOption, CopySchedule
from ..measure.profile import StepProfile
from .accounting import Accounting

__all__ = ["offload_first", "scheduled_peak"]

_LEADING = 3  # at most this many leading blocks offload in an offload-first plan


def scheduled_peak(prof: StepProfile, chosen: Sequence[BlockOption], accounting: Accounting,
                   schedule: CopySchedule) -> int:
    """The peak of ``chosen`` (one option per run of blocks) with its copies held where ``schedule`` holds them.

    Example:
        >>> scheduled_peak(prof, chosen, Accounting(prof), copy_schedule(prof, chosen))
    """
    line = schedule.line
    n = accounting.n
    peak, freed, mask, p = 0, 0, 0, 0
    steps = iter(chosen)
    while True:
        for check, backward in zip(accounting.checks[p], accounting.in_backward[p]):
            held = line.held if p == n else line.back[p] if backward else line.before[p]
            peak = max(peak, accounting.value(check, freed, mask) + held)
        if p == n:
            return peak
        option = next(steps)
        rerun = option.moved if option.recomputes else 0  # its inputs, back for the rerun
        if option.span == 1:
            forward = accounting.value(accounting.forward[p], option.spared, mask) + line.after[p]
            backward = accounting.own_peak(p, option, accounting.own[p], 0, mask) + line.back[p] + rerun
            peak = max(peak, forward - freed, backward - freed)
        else:  # a segment's stretches mix forward and backward: the most held at any of them
            last = p + option.span
            held = max(max(line.before[p:last]), max(line.back[p:last])) + rerun
            peak = max(peak, accounting.option_peak(p, option, mask) + held - freed)
        freed += accounting.freed_by(p, option)
        mask |= accounting.holds(p, option)
        p += option.span


def offload_first(prof: StepProfile, options: list[list[BlockOption]], budget: int,
                  peak: Callable[[list[BlockOption]], int]) -> list[list[BlockOption]]:
    """The offload-first plans that fit ``budget`` (``peak``: a plan's whole-step peak): for each count ``m`` of
    leading blocks (up to 3) and each level of ``keep_offload`` they all offer, the fewest blocks after them
    checkpointed (with offloaded inputs where offered) that fit; the rest kept, or moving as many of their largest
    tensors as their own forward hides.

    Example:
        >>> plans = offload_first(prof, chain_options(prof), budget, lambda chosen: predict(prof, chosen)[0])
    """
    n = len(options)
    recompute = [_recomputing(choices) for choices in options]
    rests = [[choices[0] for choices in options]]
    hidden = [[o for o in choices if o.name == "keep_offload" and o.copy_time == 0] for choices in options]
    if any(hidden):
        rests.append([levels[-1] if levels else choices[0] for levels, choices in zip(hidden, options, strict=True)])
    found = []
    for m in range(1, min(_LEADING, n - 1) + 1):
        levels = [[o for o in choices if o.name == "keep_offload"] for choices in options[:m]]
        for level in range(min((len(found_levels) for found_levels in levels), default=0)):
            for rest in rests:
                lead = [found_levels[level] for found_levels in levels]

                def plan(count: int, lead: list[BlockOption] = lead, m: int = m, rest: list[BlockOption] = rest
                         ) -> list[BlockOption] | None:
                    after = [recompute[q] if q < m + count else rest[q] for q in range(m, n)]
                    return None if None in after else [*lead, *after]

                high = _fewest(plan, n - m, peak, budget)
                if high is not None:
                    found.append(plan(high))
    return found


def _fewest(plan: Callable[[int], list[BlockOption] | None], most: int, peak: Callable[[list[BlockOption]], int],
            budget: int) -> int | None:
    """The fewest recomputing blocks ``plan(count)`` needs to fit ``budget``, by bisection (its peak falls as more
    blocks recompute); None if even ``most`` do not fit."""
    if plan(most) is None or peak(plan(most)) > budget:
        return None
    low, high = 0, most
    while low < high:
        middle = (low + high) // 2
        if plan(middle) is not None and peak(plan(middle)) <= budget:
            high = middle
        else:
            low = middle + 1
    return high


def _recomputing(choices: list[BlockOption]) -> BlockOption | None:
    """A block's checkpoint with offloaded inputs where it has one, else its checkpoint."""
    named = {o.name: o for o in reversed(choices) if o.span == 1}
    return named.get("checkpoint_offload") or named.get("checkpoint")
