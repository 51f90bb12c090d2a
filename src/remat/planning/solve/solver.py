"""The cheapest checkpointing plan that fits a memory budget.

Cost model (from a :class:`~remat.planning.measure.profile.StepProfile` of one step without checkpointing). Each block
has a list of :class:`BlockOption`; each option keeps some of the block's own bytes from its forward to its backward,
costs extra time, and (if it recomputes) keeps the block's inputs and raises the block's backward by its recomputation's
transient bytes:

=================  ===========================================  ===========================================
option             kept own bytes                               extra time
=================  ===========================================  ===========================================
``keep``           the block's own saved bytes                  0
``checkpoint``     its own inputs                               measured: recompute + wrapper overhead
``save_matmuls``   its own inputs + matmul outputs              measured: recompute without matmuls +
                                                                the policy's dispatch overhead
``selective``      its own inputs + chosen op outputs           predicted from the block's op-level front,
                                                                on the scale of its measured checkpoint
``offload``        its own inputs, + up to the copy engine's    copy time (accelerators only)
                   window (brought back early in backward)
``segment``        the first block's inputs, for a run of       each block's checkpoint price, less the
                   consecutive blocks run as one region         region machinery they share, plus the ops
                   (:mod:`remat.planning.choices.chain`)                after each inner block's last saved tensor
=================  ===========================================  ===========================================

``checkpoint_offload`` (accelerators only) keeps nothing of its own: its inputs go to host memory; its time is
checkpoint's plus the copy back's beyond the next block's backward.  ``keep_offload`` keeps all but its largest saved
tensors, which go to host memory.  A plan with either runs its copies under a schedule, is priced on the copy engine's
timeline (:mod:`remat.planning.measure.copyline`) and sized stretch by stretch (:mod:`remat.planning.solve.copyplan`);
for the dynamic program, ``checkpoint_offload`` counts two blocks' inputs in flight once for the step.

Every segment of the measured timeline (a block's forward or backward, the stretches between) had peak ``P``; with a
plan it becomes ``P`` minus the own bytes freed by the blocks before it, plus or minus each *shared* storage whose
life the plan changes (a mask every layer takes is held once, until the backward of the earliest recomputing layer
that takes it; what an ``nn.Sequential`` passed from child to child, once the child after has run, only while a
block that saves it keeps it).  A recomputing block's forward holds less than ``P`` (``BlockOption.spared``: autograd
saves nothing there) and its backward must also fit its recomputation: the live bytes at its start, without the
block's freed bytes, plus the transient.  The plan's peak is the largest segment.  Every constraint is on a prefix
of the chain, so a dynamic program over the blocks keeping the Pareto front of (own bytes freed so far, time spent
so far) for each set of shared storages still held finds the exact optimum of this model.

A ``segment`` option of block ``i`` with ``span`` ``s`` decides blocks ``i..i+s-1`` at once: the DP moves from block
``i`` to block ``i+s``, checking on the way every stretch the run decides — the forward stretches inside it (the run
holds only its inputs there, each block's forward as checkpointed), each inner block's backward (its recomputed
tensors alive as without a plan) and the run's recomputation on top of the live bytes when the last block's
backward starts.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..basics.memory import budget_on_device
from ..basics.units import Budget, parse_budget
from ..choices.baselines import rules
from ..choices.chain import chain_options
from ..choices.moves import cheaper_choices
from ..choices.options import DEFAULT_ALLOW, BlockOption, copy_schedule, offloads_note, step_extra_time
from ..choices.placement import cheaper_placement
from ..measure.profile import StepProfile
from .accounting import Accounting
from .copyplan import offload_first, scheduled_peak
from .floor import floor
from .plan import Plan
from .refusal import InfeasibleBudget

__all__ = ["InfeasibleBudget", "cheapest", "plan_from_profile", "plan_of", "predict", "predict_peak"]


def _resolve_options(prof: StepProfile, allow: Sequence[str], options: list[list[BlockOption]] | None
                     ) -> list[list[BlockOption]]:
    if options is None:
        return chain_options(prof, allow)
    if len(options) != len(prof.rows) or any(not o or o[0].name != "keep" for o in options):
        raise ValueError("remat.plan: options must hold one list per profiled block, each starting with 'keep'.")
    return options


def predict_peak(prof: StepProfile, decisions: Sequence[str], allow: Sequence[str] = DEFAULT_ALLOW,
                 options: list[list[BlockOption]] | None = None) -> int:
    """The cost model's whole-step peak for one decision (an option name) per block, in profile order.

    A name several options share (``selective``) means the first of them; :meth:`Plan.predicted_peak` of a
    plan is computed from the options it chose.  Segments (runs of blocks, :mod:`remat.planning.choices.chain`) are
    not named here: :func:`predict` takes the options themselves.

    Example:
        >>> predict_peak(prof, ["keep"] * len(prof.rows)) == prof.peak_bytes
        True
    """
    options = _resolve_options(prof, allow, options)
    chosen = []
    for row, choices, name in zip(prof.rows, options, decisions):
        match = [o for o in choices if o.name == name and o.span == 1]
        if not match:
            raise ValueError(f"remat.plan: {name!r} is not an option of `{row.name}`; it has "
                             f"{sorted({o.name for o in choices if o.span == 1})}.")
        chosen.append(match[0])
    return _peak(prof, chosen)


def predict(prof: StepProfile, chosen: Sequence[BlockOption]) -> tuple[int, float]:
    """The cost model's whole-step peak and extra seconds of ``chosen``: one option per run of blocks, in
    profile order, whose spans cover every block once (a block left alone takes ``keep``).

    Example:
        >>> from remat.planning.choices.chain import chain_options, sequential_choice
        >>> peak, extra = predict(prof, sequential_choice(prof, chain_options(prof), segments=4))
    """
    if sum(o.span for o in chosen) != len(prof.rows):
        raise ValueError(f"remat.plan: the options cover {sum(o.span for o in chosen)} blocks; the profile has "
                         f"{len(prof.rows)}.")
    return _peak(prof, chosen), step_extra_time(prof, chosen)


def _peak(prof: StepProfile, chosen: Sequence[BlockOption], accounting: Accounting | None = None) -> int:
    """The chain's peak, and the bytes the offload hooks' copies may hold on the device at once: one window for the
    whole step, or, where blocks move bytes under a schedule, what it holds at each stretch."""
    schedule = copy_schedule(prof, chosen)
    if schedule is not None:
        return scheduled_peak(prof, chosen, accounting or Accounting(prof), schedule)
    return _chain_peak(prof, chosen, accounting) + max((o.in_flight for o in chosen), default=0)


def _chain_peak(prof: StepProfile, chosen: Sequence[BlockOption], accounting: Accounting | None = None) -> int:
    """The peak of one option per run of blocks (``chosen`` in order, spans covering the chain)."""
    accounting = accounting or Accounting(prof)
    peak, freed, mask, p = 0, 0, 0, 0
    steps = iter(chosen)
    while True:
        for check in accounting.checks[p]:
            peak = max(peak, accounting.value(check, freed, mask))
        if p == accounting.n:
            return peak
        option = next(steps)
        peak = max(peak, accounting.option_peak(p, option, mask) - freed)
        freed += accounting.freed_by(p, option)
        mask |= accounting.holds(p, option)
        p += option.span


def _solve(prof: StepProfile, budget: int, options: list[list[BlockOption]], with_cost: bool = True,
           accounting: Accounting | None = None) -> list[tuple[int, int]] | None:
    """Exact DP over the chain; (block, option index) for the first block of every run of blocks the chosen
    options decide (one block each, or a segment's span), or None if nothing fits.

    States arrive at block p from the options of earlier blocks whose runs end before it.  For each mask of
    shared storages still held, the states no other state beats on both time and own bytes freed are kept;
    ties are broken by the order the options are listed, so equal costs give equal plans.
    """
    accounting = accounting or Accounting(prof)
    n = accounting.n
    cap = _caps(prof, budget, options, accounting)
    # arrivals[p]: mask -> [(time, -freed, trail)] of the states whose decisions end before block p
    arrivals: list[dict[int, list[tuple[float, int, Any]]]] = [{} for _ in range(n + 1)]
    arrivals[0][0] = [(0.0, 0, None)]
    for p in range(n + 1):
        fronts = {mask: _pareto(bucket) for mask, bucket in _merge_masks(arrivals[p]).items()}
        arrivals[p] = {}
        # every check is linear in the bytes freed so far: each needs a least amount, per mask
        checks = accounting.checks[p]
        survivors: dict[int, list[tuple[float, int, Any]]] = {}
        for mask, front in fronts.items():
            need = max((accounting.value(c, 0, mask) - budget for c in checks), default=-(2**62))
            kept = [s for s in front if -s[1] >= need]
            if kept:
                survivors[mask] = kept
        if p == n:
            fronts = survivors
            break
        for mask, front in survivors.items():
            for index, option in enumerate(options[p]):
                end = p + option.span
                new_mask = (mask | accounting.holds(p, option)) & accounting.keep_bits[end - 1]
                need = accounting.option_peak(p, option, mask) - budget
                cost = option.extra_time if with_cost else 0.0
                delta, limit = accounting.freed_by(p, option), cap[end]
                # the front frees more the later a state comes: the states that pass are a tail of it, and of
                # those that free the cap or more, only the first (cheapest) is not beaten by another
                first = bisect.bisect_left(front, need, key=_freed)
                stop = bisect.bisect_left(front, limit - delta, lo=first, key=_freed) + 1
                arrivals[end].setdefault(new_mask, []).extend(
                    (time_spent + cost, -min(delta - neg_freed, limit), (p, index, trail))
                    for time_spent, neg_freed, trail in front[first:stop]
                )
    finals = [state for front in fronts.values() for state in front]
    if not finals:
        return None
    trail = min(finals, key=lambda s: (s[0], s[1]))[2]
    decisions = []
    while trail is not None:
        decisions.append(trail[:2])
        trail = trail[2]
    return decisions[::-1]


def _pareto(bucket: list[tuple[float, int, Any]]) -> list[tuple[float, int, Any]]:
    """The states no other beats on both time and bytes freed, by time (and bytes freed, increasing)."""
    bucket.sort(key=_time_then_freed)  # stable: ties keep the order states and options are listed
    front, best = [], None
    for time_spent, neg_freed, trail in bucket:
        if best is None or neg_freed < best:
            front.append((time_spent, neg_freed, trail))
            best = neg_freed
    return front


_MAX_MASKS = 8


def _merge_masks(groups: dict[int, list]) -> dict[int, list]:
    """At most ``_MAX_MASKS`` groups: neighbours merge under the union of their masks.

    A set bit only adds bytes, so a merged group is judged on the safe side: with many shared storages
    open at once the plan stays within budget but may be a little dearer than the optimum.
    """
    while len(groups) > _MAX_MASKS:
        masks = sorted(groups)
        merged: dict[int, list] = {}
        for a, b in zip(masks[::2], masks[1::2] + [None]):
            union = a if b is None else a | b
            merged.setdefault(union, []).extend(groups[a] + (groups[b] if b is not None else []))
        groups = merged
    return groups


def _freed(state: tuple[float, int, Any]) -> int:
    return -state[1]


_time_then_freed = operator.itemgetter(0, 1)


def _caps(prof: StepProfile, budget: int, options: list[list[BlockOption]], accounting: Accounting) -> list[int]:
    """cap[p]: freeing more than this before block p helps no later check, whatever the plan does next.

    States above the cap are equivalent, so the DP clamps them to it: the front stays small and the
    optimum exact.
    """
    def bound(check: tuple[int, int, list[tuple[int, int]]]) -> int:
        base, const, varying = check
        return base + const + sum(nbytes for _, nbytes in varying) - budget

    n = accounting.n
    every = (1 << len(accounting.shared)) - 1  # every shared storage held: the most any check can read
    cap = [0] * (n + 1)
    cap[n] = max((bound(c) for c in accounting.checks[n]), default=0)
    for p in range(n - 1, -1, -1):
        own = prof.rows[p].own_bytes
        need = max([bound(c) for c in accounting.checks[p]] + [bound(accounting.backward[p]),
                                                                bound(accounting.forward[p])])
        # what the stretches a recomputing option decides (a segment's inner ones too) need freed before block p
        need = max([need] + [accounting.option_peak(p, o, every) - budget for o in options[p] if o.recomputes])
        give_back = max(0, max(o.kept - own for o in options[p]))
        cap[p] = max(need, cap[p + 1] + give_back, 0)
    return cap


def _smallest_peak(prof: StepProfile, options: list[list[BlockOption]]) -> int:
    """The lowest peak any plan reaches (a bisection on the budget; feasibility ignores time)."""
    low, high = 0, prof.peak_bytes
    accounting = Accounting(prof)
    while low < high:
        middle = (low + high) // 2
        if cheapest(prof, middle, options, with_cost=False, accounting=accounting) is not None:
            high = middle
        else:
            low = middle + 1
    return low


def _resolve_budget(prof: StepProfile, budget: Budget | int | float | str) -> tuple[int, object, Budget]:
    """The whole-step budget in bytes, how to name what was asked in a refusal (a fraction as a float), and the
    budget read (a ``"free"`` one as the bytes the device has)."""
    fixed = prof.param_bytes + prof.buffer_bytes
    parsed = budget_on_device(parse_budget(budget), prof.device, fixed)
    requested = parsed.fraction if parsed.fraction is not None else parsed.text or None
    return parsed.bytes_for(fixed, prof.peak_above_params), requested, parsed


def plan_from_profile(
    prof: StepProfile,
    budget: Budget | int | float | str,
    allow: Sequence[str] = DEFAULT_ALLOW,
    options: list[list[BlockOption]] | None = None,
) -> Plan:
    """Solve the plan for an existing profile (see :func:`plan`); ``prof.plan(budget)`` is the same call.

    ``options`` replaces the built-in options (:func:`~remat.planning.choices.chain.chain_options`) with your own, one
    list per block starting with ``keep`` (an option with ``span`` > 1 decides that many blocks from its own).

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)
        >>> for budget in (0.3, 0.5, 0.7):
        ...     print(plan_from_profile(prof, budget))
    """
    budget_bytes, requested, parsed = _resolve_budget(prof, budget)
    built = options is None  # the built-in options: those the advice on blocks writing in place may rebuild
    options = _resolve_options(prof, allow, options)
    # A collective sent again in backward waits there on every rank's recomputation, which no price of one rank
    # sees: a plan keeps what crossed the wire wherever that fits, and sends it again only where it does not.
    quiet = [[o for o in choices if not o.resends] for choices in options]
    resending = sum(map(len, quiet)) < sum(map(len, options))
    placed = _search(prof, budget_bytes, quiet) if resending else None
    if placed is None:
        placed = _search(prof, budget_bytes, options)
    if placed is None:
        smallest = _smallest_peak(prof, options)
        writers = [row for row in prof.rows if row.writes_input]
        raise InfeasibleBudget(budget_bytes, smallest, prof.param_bytes + prof.buffer_bytes,
                               prof.peak_above_params, requested, nothing_frees=smallest >= prof.peak_bytes,
                               writing=[row.name for row in writers],
                               in_place=[name for row in writers for name in row.in_place_layers],
                               unwritten=_unwritten_peak(prof, allow) if writers and built else None,
                               unavailable="" if tuple(allow) == DEFAULT_ALLOW else offloads_note(prof, allow),
                               chained=bool(prof.links) and all(prof.links) and "checkpoint" in allow,
                               **_where_it_peaks(prof, options, smallest))
    plan = plan_of(prof, placed, budget_bytes)
    if plan.collectives_rerun and resending:
        plan.meta["collectives"] = "no plan that keeps every collective's output fits the budget"
    if parsed.text.lower().startswith("free"):  # the device's free memory when planning: the plan states it
        plan.meta["budget"] = parsed.text
    return plan


def _search(prof: StepProfile, budget: int, options: list[list[BlockOption]]) -> list[tuple[int, BlockOption]] | None:
    """The cheapest placement of ``options`` within ``budget`` bytes, no worse than the rules people checkpoint by;
    None where none fits."""
    # the dynamic program weighs a kept block's moved tensors only where its own forward hides their copies: its
    # sums cannot see the others hidden behind the forwards after it (the offload-first plans and the moves after
    # the search weigh every level on the timeline)
    hidden = [[o for o in choices if not (o.copies and o.copy_time > 0)] for choices in options]
    placed = cheapest(prof, budget, hidden)
    if placed is None and sum(map(len, hidden)) < sum(map(len, options)):
        placed = cheapest(prof, budget, options)  # the levels left out may be the only ones that fit
    return _no_worse_than_rules(prof, budget, options, placed)


def _where_it_peaks(prof: StepProfile, options: list[list[BlockOption]], smallest: int) -> dict[str, Any]:
    """Where the plan that reaches ``smallest`` peaks, in words, and what that peak is made of
    (:func:`~remat.planning.solve.floor.floor`); nothing where that plan is not found again."""
    placed = cheapest(prof, smallest, options, with_cost=False)
    return {} if placed is None else floor(prof, placed, smallest)


def _unwritten_peak(prof: StepProfile, allow: Sequence[str]) -> int:
    """The lowest peak any plan would reach were no block to write in place to its inputs (so regions may start
    at them): what the refusal's advice to stop them gives, stated only where lower than the peak reached."""
    unwritten = replace(prof, rows=[replace(row, writes_input=False) for row in prof.rows])
    return _smallest_peak(unwritten, chain_options(unwritten, allow))


def plan_of(prof: StepProfile, placed: Sequence[tuple[int, BlockOption]], budget: int) -> Plan:
    """The :class:`Plan` that runs each option of ``placed`` (the block its run starts at, the option) and keeps
    every block no run covers, priced by the cost model; ``budget``: the whole-step bytes it was made for.

    Example:
        >>> options = chain_options(prof)
        >>> plan = plan_of(prof, [(0, options[0][1])], prof.peak_bytes)   # checkpoint the first block only
    """
    covered = {q for p, o in placed for q in range(p, p + o.span)}
    placed = sorted([*placed, *((q, BlockOption("keep", row.own_bytes)) for q, row in enumerate(prof.rows)
                                if q not in covered)], key=lambda item: item[0])
    chosen = [o for _, o in placed]
    decisions, blocks, segments, policies, wrappers = {}, {}, [], {}, {}
    for p, o in placed:
        names = [row.name for row in prof.rows[p:p + o.span]]
        decisions.update((name, o.name) for name in names)
        blocks[names[0]] = _summary(prof.rows[p].own_bytes, o)  # a segment's row: its first block's
        if o.span > 1:
            segments.append(names)
        if o.policy is not None:
            policies[names[0]] = o.policy.to_dict()
        if o.wrap is not None:
            wrappers[names[0]] = o.wrap
    schedule = copy_schedule(prof, chosen)
    names = [row.name for row in prof.rows]
    copies = {} if schedule is None else {
        "device": prof.device, "ahead": schedule.ahead, "last": names[-1],
        "drains": {names[p]: nbytes for p, nbytes in enumerate(schedule.drains) if nbytes is not None},
        # what the peak counts between a block and the next (a module may run there): the host may have let go
        # of fewer copies than the timeline did when the next block starts
        "ends": dict(zip(names[:-1], schedule.line.before[1:], strict=True))}
    result = Plan(
        decisions=decisions,
        predicted_peak=_peak(prof, chosen),
        predicted_extra_time=step_extra_time(prof, chosen),
        budget=budget,
        baseline_peak=prof.peak_bytes,
        param_bytes=prof.param_bytes + prof.buffer_bytes,
        step_time=prof.step_time,
        policies=policies,
        blocks=blocks,
        segments=segments,
        copies=copies,
        hold_output=prof.hold_output,
    )
    result._wrappers = wrappers
    return result


def cheapest(prof: StepProfile, budget: int, options: list[list[BlockOption]], with_cost: bool = True,
              accounting: Accounting | None = None) -> list[tuple[int, BlockOption]] | None:
    """The cheapest options that fit ``budget`` (whole-step bytes), each with the block its run starts at, or None.

    The offload hooks' window is one for the whole step (the largest ``in_flight`` among the chosen options),
    which the chain's sums cannot express: for each window an option may bring, the plans whose options bring
    no larger one are solved under the budget less it, and the cheapest of those that fit is the optimum.  A plan
    whose copies run under a schedule is checked against its own peak, stretch by stretch; one that overshoots is
    solved again under a budget lower by the overshoot (a few times at most).

    Example:
        >>> placed = cheapest(prof, prof.peak_bytes // 2, chain_options(prof))
    """
    windows = sorted({o.in_flight for choices in options for o in choices} | {0})
    accounting = accounting or Accounting(prof)
    found = []
    for window in windows:
        candidates = [[o for o in choices if o.in_flight <= window] for choices in options]
        target = budget - window
        for _ in range(_RETRIES):
            indices = _solve(prof, target, candidates, with_cost, accounting)
            if indices is None:
                break
            placed = [(p, candidates[p][i]) for p, i in indices]
            overshoot = _peak(prof, [o for _, o in placed], accounting) - budget
            if overshoot <= 0:
                found.append(placed)
                break
            target -= overshoot  # a scheduled plan's copies held more than its sums: ask the sums for that much less
    return min(found, key=lambda placed: step_extra_time(prof, [o for _, o in placed]), default=None)


_RETRIES = 4  # solves per window when a scheduled plan's own peak overshoots the budget its sums met
_POLISHED = 3  # the cheapest candidates given cheaper options block by block: each may end somewhere else


def _no_worse_than_rules(prof: StepProfile, budget: int, options: list[list[BlockOption]],
                         placed: list[tuple[int, BlockOption]] | None) -> list[tuple[int, BlockOption]] | None:
    """``placed``, or the rule (:mod:`remat.planning.choices.baselines`) or offload-first plan
    (:func:`~remat.planning.solve.copyplan.offload_first`) within ``budget`` that costs less time, or as much time and
    less memory: the search merges states of many shared storages on the safe side and breaks ties of time by bytes
    freed, not by the peak, so a rule could otherwise beat its plan on the same model; and it sees no timeline.  The
    few cheapest are given cheaper options block by block where the timeline has room, and the cheapest of those is
    placed among alike blocks where the copy timeline prices it cheaper (:mod:`remat.planning.choices.placement`)."""
    accounting = Accounting(prof)
    candidates = [] if placed is None else [placed]
    for rule in rules(options):
        if _peak(prof, rule.chosen, accounting) <= budget:
            candidates.append(list(enumerate(rule.chosen)))
    for chosen in offload_first(prof, options, budget, lambda chosen: _peak(prof, chosen, accounting)):
        candidates.append(list(enumerate(chosen)))
    def price(placed: list[tuple[int, BlockOption]]) -> tuple[float, int]:
        chosen = [o for _, o in placed]
        return step_extra_time(prof, chosen), _peak(prof, chosen, accounting)

    def peak(chosen: Sequence[BlockOption]) -> int:
        return _peak(prof, chosen, accounting)

    candidates.sort(key=price)
    polished = [cheaper_choices(prof, c, options, peak, budget) for c in candidates[:_POLISHED]]
    return cheaper_placement(prof, min(polished, key=price, default=None), peak, options)


def _summary(own_bytes: int, option: BlockOption) -> dict[str, Any]:
    """What ``print(plan)`` shows of one block: bytes it keeps of its own, extra time, ops it reruns, bytes it
    offloads and their copy time the compute does not hide."""
    summary: dict[str, Any] = {"kept": option.kept if option.name != "keep" else own_bytes,
                               "extra_time": option.extra_time}
    if option.span > 1:
        summary["span"] = option.span
    if option.resends:
        summary["collectives"] = option.resends
    if option.recomputed_ops is not None:
        summary["recomputed_ops"] = option.recomputed_ops
    if option.policy is not None and option.policy.offloaded_bytes:
        summary["offloaded"] = option.policy.offloaded_bytes
        summary["copy_time"] = option.copy_time
    elif option.moved:
        summary["offloaded"] = option.moved
        summary["copy_time"] = option.copy_time
    return summary

