"""Plans made on purpose: the runners-up near a budget, and the price of an assignment you choose.

The solver returns one plan, the cheapest its prices find; on a machine whose timings move, a close runner-up
may be the one another run picks.  :func:`plans_near` lists the cheapest distinct plans that fit a budget, so a
user (or a test) can check more than the one plan the timings happened to pick: the solver's own, then for
each block it did not keep, the cheapest plan that fits without that block's option there (one exclusion at a
time, then of the runners-up found, until ``count`` are found).  Alike blocks taking the same choices in
another order, at the same predicted peak and time, are one plan (:func:`distinct_plans`).
:func:`plan_for` prices and returns the plan of an assignment given by name (``{"blocks.0": "checkpoint", ...}``,
runs of blocks as ``segments``).

Example:
    >>> prof = remat.profile(model, x, loss_fn=loss_fn)
    >>> for plan in prof.alternatives("50%", count=3):
    ...     print(plan.predicted_extra_time, remat.check_plan(model, plan, x, loss_fn=loss_fn).holds)
    >>> every_other = prof.price({"blocks.0": "checkpoint", "blocks.2": "checkpoint"})
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from ..basics.units import Budget
from ..choices.chain import chain_options
from ..choices.options import DEFAULT_ALLOW, BlockOption
from ..choices.partitioned import PARTITIONED
from ..measure.profile import StepProfile
from .plan import Plan
from .solver import cheapest, plan_from_profile, plan_of

__all__ = ["distinct_plans", "plan_for", "plans_near", "quiet_first"]

_Placed = list[tuple[int, BlockOption]]
_SEARCHED = 16  # placements searched per plan asked for at most: alike blocks' orders must not run on


def plans_near(prof: StepProfile, budget: Budget | int | float | str, count: int = 5,
               allow: Sequence[str] = DEFAULT_ALLOW) -> list[Plan]:
    """Up to ``count`` distinct plans that fit ``budget``, cheapest predicted first (those that send collectives
    again after those that send none); the first is ``prof.plan(budget)``.  Raises
    :class:`~remat.planning.solve.solver.InfeasibleBudget` where none fits.

    Example:
        >>> [p.predicted_extra_time for p in plans_near(prof, "50%", count=3)]   # ascending
    """
    if count < 1:
        raise ValueError(f"remat.plans_near: count must be at least 1, got {count}.")
    first = plan_from_profile(prof, budget, allow)  # raises where nothing fits, with the solver's reasons
    options = chain_options(prof, allow)
    best = cheapest(prof, first.budget, options)
    assert best is not None  # plan_from_profile found it
    found: dict[tuple, _Placed] = {_key(best): best}
    kinds = {_kind(best)}  # the same choices placed otherwise among alike blocks: one plan to a user
    frontier = [best]
    while frontier and len(kinds) < count and len(found) < _SEARCHED * count:
        runners_up = []
        for placed in frontier:
            for p, option in placed:
                if option.name == "keep":
                    continue
                # without this option on this block, then on every block: alike blocks would otherwise take it
                # in turn, the same choices placed otherwise, and the search never leave them
                for blocks in ([p], range(len(options))):
                    without = [list(choices) for choices in options]
                    for q in blocks:
                        without[q] = [o for o in without[q] if _option_kind(o) != _option_kind(option)]
                    other = cheapest(prof, first.budget, without)
                    if other is not None and _key(other) not in found:
                        found[_key(other)] = other
                        if _kind(other) not in kinds:  # a new choice of options: its own runners-up to look at
                            kinds.add(_kind(other))
                            runners_up.append(other)
        frontier = sorted(runners_up, key=_extra_time)
    others = [plan_of(prof, placed, first.budget) for placed in found.values()]
    # the solver's first may be a rule that equals one found here
    return distinct_plans([first, *sorted(others, key=lambda p: (*quiet_first(p), p.predicted_peak))])[:count]


def quiet_first(plan: Plan) -> tuple[bool, float]:
    """How plans are ordered, as the solver picks them: those whose recomputations send no collective again first
    (a collective sent again waits on every rank, which no one rank's price shows), then by predicted extra time.

    Example:
        >>> min(plans, key=quiet_first)
    """
    return plan.collectives_rerun > 0, plan.predicted_extra_time


def distinct_plans(plans: Iterable[Plan]) -> list[Plan]:
    """``plans`` in their order, each once: a plan that makes the same choices as an earlier one (the same option
    and policy, as many times; the same chunked head and segment lengths) at the same predicted peak and time is
    left out, whichever of alike blocks takes which choice.

    Example:
        >>> len(distinct_plans([plan, plan]))
        1
    """
    seen, kept = set(), []
    for plan in plans:
        choices = sorted((decision, json.dumps(plan.policies.get(name), sort_keys=True, default=str))
                         for name, decision in plan.decisions.items())
        key = (plan.head_chunks, plan.predicted_peak, round(plan.predicted_extra_time, 12), tuple(choices),
               tuple(sorted(len(run) for run in plan.segments)))
        if key not in seen:
            seen.add(key)
            kept.append(plan)
    return kept


def plan_for(prof: StepProfile, decisions: Mapping[str, str], segments: Sequence[Sequence[str]] = (),
             allow: Sequence[str] = ("checkpoint", "save_matmuls", "selective", "offload", PARTITIONED)) -> Plan:
    """The plan that takes ``decisions`` (block name to option name; blocks not named are kept) and checkpoints
    each run of ``segments`` as one region, priced by the cost model.  A name several options share
    (``selective``) means its first, the cheapest of the block's front points.

    Example:
        >>> plan = plan_for(prof, {"blocks.0": "checkpoint", "blocks.2": "save_matmuls"})
        >>> plan.predicted_peak, plan.predicted_extra_time
    """
    index = {row.name: i for i, row in enumerate(prof.rows)}
    unknown = [name for name in [*decisions, *(n for run in segments for n in run)] if name not in index]
    if unknown:
        raise ValueError(f"remat.plan_for: the profile has no block {unknown[0]!r}; its blocks are "
                         f"{', '.join(list(index)[:4])}{' ...' if len(index) > 4 else ''}.")
    options = chain_options(prof, allow)
    placed: _Placed = []
    for run in segments:
        first, span = index[run[0]], len(run)
        if [index[name] for name in run] != list(range(first, first + span)):
            raise ValueError(f"remat.plan_for: segment {list(run)} is not a run of consecutive blocks in profile "
                             "order.")
        match = next((o for o in options[first] if o.name == "segment" and o.span == span), None)
        if match is None:
            raise ValueError(f"remat.plan_for: {run[0]}..{run[-1]} cannot run as one region (not consecutive "
                             "children of one nn.Sequential, or the first writes in place to its input).")
        placed.append((first, match))
    in_segments = {name for run in segments for name in run}
    for name, wanted in decisions.items():
        if name in in_segments:
            raise ValueError(f"remat.plan_for: `{name}` is both in a segment and given {wanted!r}; give it one.")
        match = next((o for o in options[index[name]] if o.name == wanted and o.span == 1), None)
        if match is None:
            offered = sorted({o.name for o in options[index[name]] if o.span == 1})
            why = (" (the profile found no input of its own of 1 MiB or more that every tensor-parallel rank holds "
                   "in full)" if wanted == PARTITIONED and name not in prof.partitioned else "")
            raise ValueError(f"remat.plan_for: `{name}` has no option {wanted!r} here{why}; it has "
                             f"{', '.join(offered)}.")
        placed.append((index[name], match))
    plan = plan_of(prof, placed, prof.peak_bytes)
    plan.budget = plan.predicted_peak  # made for no budget: it promises its own peak
    return plan


def _key(placed: _Placed) -> tuple:
    return tuple((p, o.name, o.span, o.kept, o.extra_time) for p, o in placed)


def _extra_time(placed: _Placed) -> float:
    return sum(o.extra_time for _, o in placed)


def _option_kind(option: BlockOption) -> tuple:
    return option.name, option.span, option.kept, option.extra_time


def _kind(placed: _Placed) -> tuple:
    return tuple(sorted(_option_kind(o) for _, o in placed))
