"""remat's front of plans beside the rules' points, on the solver's cost model: ``remat.profile(...).front()``.

Every rule of :mod:`remat.planning.choices.baselines` (every-k spread for each ``n``, offloaded inputs) is one point:
its predicted peak and extra time.  remat's front is the plan for each of those peaks as the budget, and for
each budget asked besides, with the points another plan beats on both removed.  Where the profile has the
chunked output layer and loss (:mod:`remat.planning.solve.head`), its plans are on the front too, planned as
``Profile.plan`` plans, at the peaks of the rules applied with it as well.  No plan is worse than a rule
on both axes (:func:`~remat.planning.solve.solver.plan_from_profile` takes a rule where it would be).

Example:
    >>> print(remat.profile(model, tokens).front())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..basics.units import format_bytes
from ..choices.baselines import rules
from ..choices.chain import chain_options
from ..choices.options import DEFAULT_ALLOW
from ..measure.profile import StepProfile
from .head import HeadOption, plan_with_head
from .solver import InfeasibleBudget, plan_from_profile, predict

__all__ = ["Front", "TradePoint", "front"]


@dataclass(frozen=True)
class TradePoint:
    """One point: who it is (``remat`` or a rule's name), the whole-step peak in bytes and the extra seconds;
    ``collectives``: how many its recomputations send again per step (a tensor-parallel block's all-reduce), a cost
    that one rank's prices do not show (every rank waits there on the others).

    Example:
        >>> TradePoint("every-k 12 of 12", 3_683_697_664, 0.0257).label
        'every-k 12 of 12'
    """

    label: str
    peak: int
    extra_time: float
    decisions: tuple[str, ...] = ()
    head_chunks: int = 0
    collectives: int = 0


@dataclass
class Front:
    """remat's plans and the rules' points of one profile, each sorted by peak.

    Example:
        >>> f = prof.front(); f.plans[0].peak <= min(r.peak for r in f.rules)
        True
    """

    plans: list[TradePoint]
    rules: list[TradePoint]
    baseline_peak: int
    fixed_bytes: int
    step_time: float

    def dominated(self) -> list[tuple[TradePoint, TradePoint]]:
        """(plan, rule) pairs where the rule is at most the plan on both axes and below it on one, sending no more
        collectives again: none.

        Example:
            >>> prof.front().dominated()
            []
        """
        return [(p, r) for p in self.plans for r in self.rules if _beats(r, p)]

    def __str__(self) -> str:
        above = self.baseline_peak - self.fixed_bytes
        resent = any(p.collectives for p in (*self.plans, *self.rules))
        header = (f"{'':<7} {'':<20} {'peak above params':>18} {'of plain':>9} {'extra':>10} {'step':>7}"
                  + (f" {'sent again':>10}" if resent else ""))
        lines = [header, "-" * len(header)]
        for kind, points in (("remat", self.plans), ("rule", self.rules)):
            for point in points:
                share = (point.peak - self.fixed_bytes) / above if above > 0 else 0.0
                step = f"x{1 + point.extra_time / self.step_time:.3f}" if self.step_time > 0 else ""
                name = point.label if kind == "rule" else "plan" + (
                    f", head in {point.head_chunks}" if point.head_chunks else "")
                lines.append(f"{kind:<7} {name:<20} {format_bytes(point.peak - self.fixed_bytes):>18} "
                             f"{share:>9.3f} {point.extra_time * 1e3:>8.2f}ms {step:>7}"
                             + (f" {point.collectives:>10}" if resent else ""))
        return "\n".join(lines)


def front(prof: StepProfile, budgets: Sequence[object] = (), allow: Sequence[str] = DEFAULT_ALLOW,
          head: HeadOption | None = None) -> Front:
    """remat's plans at each rule's peak (and at ``budgets``) beside the rules' points, on one cost model; with
    ``head``, the chunked output layer and loss, remat's plans are made with or without it (the cheaper), at the
    peaks the rules reach with it too.

    Example:
        >>> print(front(prof, budgets=("50%", "30%")))
    """
    options = chain_options(prof, allow)
    points = []
    for rule in rules(options):
        peak, extra = predict(prof, rule.chosen)
        points.append(TradePoint(rule.name, peak, extra, tuple(o.name for o in rule.chosen),
                                 collectives=sum(o.resends for o in rule.chosen)))
    peaks = {p.peak for p in points}
    if head is not None:
        peaks |= {predict(head.profile, rule.chosen)[0] for rule in rules(chain_options(head.profile, allow))}
    plans = {}
    for budget in [*budgets, *sorted(peaks)]:
        try:
            plan = (plan_from_profile(prof, budget, options=options) if head is None
                    else plan_with_head(prof, head, budget, allow))
        except InfeasibleBudget:  # a budget asked below what any plan reaches
            continue
        point = TradePoint("remat", plan.predicted_peak, plan.predicted_extra_time, tuple(plan.decisions.values()),
                           plan.head_chunks, plan.collectives_rerun)
        plans[(point.peak, point.extra_time)] = point
    kept = [p for p in plans.values() if not any(_beats(q, p) for q in plans.values())]
    return Front(sorted(kept, key=lambda p: p.peak), sorted(points, key=lambda p: p.peak), prof.peak_bytes,
                 prof.param_bytes + prof.buffer_bytes, prof.step_time)


def _beats(q: TradePoint, p: TradePoint) -> bool:
    """``q`` at most ``p`` on both axes and below it on one, sending no more collectives again (a plan that keeps
    what crossed the wire is not weighed against a cheaper one that sends it again: the solver takes the first)."""
    return (q.peak <= p.peak and q.extra_time <= p.extra_time and (q.peak, q.extra_time) != (p.peak, p.extra_time)
            and q.collectives <= p.collectives)
