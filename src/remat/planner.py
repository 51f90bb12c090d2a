"""The cheapest checkpointing plan that fits a memory budget.

Cost model (from a :class:`~remat.profile.Profile` of one step without
checkpointing).  For block ``j`` each option keeps ``s_j`` bytes through the
step and costs ``c_j`` seconds:

=================  =================================  ==============================
option             kept (``s_j``)                     extra time (``c_j``)
=================  =================================  ==============================
``keep``           its activations ``A_j``            0
``checkpoint``     its inputs                         its forward time
``save_matmuls``   its inputs + matmul outputs        forward time − matmul time
``offload``        its inputs (activations on host)   copy time (accelerators only)
=================  =================================  ==============================

Every segment of the measured timeline (a block's forward or backward, the
stretches between) had peak ``P``; with a plan it becomes
``P − Σ_{j before it} (A_j − s_j)``, plus the recomputation's temporaries in
the backward of a block that is not kept.  The plan's peak is the largest
segment.  Because every constraint is on a prefix of the chain, a dynamic
program over the blocks that keeps the Pareto front of (memory saved so far,
time spent so far) finds the exact optimum of this model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .memory import format_bytes, parse_bytes
from .modules import ActivationWrapper, checkpoint_wrapper, offload_wrapper
from .policies import save_matmuls
from .profile import Profile
from .profile import profile as run_profile

__all__ = ["InfeasibleBudget", "Plan", "plan", "plan_from_profile", "predict_peak"]

OPTIONS = ("keep", "checkpoint", "save_matmuls", "offload")
_OFFLOAD_BYTES_PER_SECOND = 12e9  # a PCIe 4 x16 link, one direction, in practice


class InfeasibleBudget(ValueError):
    """No plan fits the budget; ``smallest`` is the smallest whole-step peak any plan reaches."""

    def __init__(self, budget: int, smallest: int) -> None:
        self.budget, self.smallest = budget, smallest
        super().__init__(
            f"remat.plan: no plan fits {format_bytes(budget)}; the smallest peak any plan reaches is "
            f"{format_bytes(smallest)} ({smallest} bytes). Raise the budget to at least that, or reduce "
            "the batch / sequence length."
        )


@dataclass
class _Option:
    kept: int
    cost: float
    transient: int


def _options(prof: Profile, allow: Sequence[str]) -> list[dict[str, _Option]]:
    unknown = set(allow) - set(OPTIONS[1:])
    if unknown:
        raise ValueError(f"remat.plan: unknown options {sorted(unknown)}; choose from {list(OPTIONS[1:])}.")
    on_accelerator = not prof.device.startswith(("cpu", "meta"))
    per_block = []
    for row in prof.rows:
        transient = max(row.recompute_extra, 0)
        choices = {"keep": _Option(row.act_bytes, 0.0, 0)}
        if "checkpoint" in allow:
            choices["checkpoint"] = _Option(row.kept_if_checkpointed, row.forward_time, transient)
        if "save_matmuls" in allow and row.matmul_bytes:
            # The matmul outputs autograd does not save are released as soon as the recomputation has
            # used them, like the forward's temporaries that recompute_extra already counts.
            choices["save_matmuls"] = _Option(
                row.kept_if_checkpointed + row.matmul_bytes,
                max(row.forward_time - row.matmul_time, 0.0),
                transient,
            )
        if "offload" in allow and on_accelerator:
            copy_time = 2 * row.act_bytes / _OFFLOAD_BYTES_PER_SECOND
            choices["offload"] = _Option(row.kept_if_checkpointed, copy_time, 0)
        per_block.append(choices)
    return per_block


def _needs(prof: Profile, budget: int) -> tuple[list[int], list[int]]:
    """Per prefix p: savings needed before p for the segments after p, without and with block p recomputing."""
    n = len(prof.rows)
    plain = [-(2**62)] * (n + 1)
    own = [-(2**62)] * (n + 1)
    for seg in prof.segments:
        need = seg.peak - budget
        plain[seg.prefix] = max(plain[seg.prefix], need)
        if seg.block is not None:
            own[seg.block] = max(own[seg.block], need)
    return plain, own


def predict_peak(prof: Profile, decisions: Sequence[str], allow: Sequence[str] = OPTIONS[1:]) -> int:
    """The cost model's whole-step peak for one decision per block (in profile order).

    Example:
        >>> predict_peak(prof, ["keep"] * len(prof.rows)) == prof.peak_bytes
        True
    """
    options = _options(prof, allow)
    saved_before = [0]
    for row, choice, decision in zip(prof.rows, options, decisions):
        saved_before.append(saved_before[-1] + row.act_bytes - choice[decision].kept)
    peak = 0
    for seg in prof.segments:
        value = seg.peak - saved_before[seg.prefix]
        if seg.block is not None and decisions[seg.block] != "keep":
            value += options[seg.block][decisions[seg.block]].transient
        peak = max(peak, value)
    return peak


def _solve(prof: Profile, budget: int, options: list[dict[str, _Option]]) -> list[str] | None:
    """Exact DP: Pareto front of (saved bytes, time) over the chain; None if nothing fits."""
    plain, own = _needs(prof, budget)
    n = len(options)
    deltas = [[prof.rows[p].act_bytes - o.kept for o in choices.values()] for p, choices in enumerate(options)]
    # Savings above cap[p] cannot help any later segment (even if every later block gave memory
    # back), so all such states are equivalent: clamping them to the cap keeps the DP exact.
    worst = max((t.transient for choices in options for t in choices.values()), default=0)
    cap = [0] * (n + 1)
    cap[n] = plain[n]
    for p in range(n - 1, -1, -1):
        give_back = max(0, -min(deltas[p]))
        cap[p] = max(plain[p], own[p] + worst, cap[p + 1] + give_back)
    # states are (time, -saved, tiebreak, trail of decisions): plain tuples sort fastest
    front: list[tuple[float, int, int, Any]] = [(0.0, 0, 0, None)]
    for p, choices in enumerate(options):
        act = prof.rows[p].act_bytes
        need_plain, need_own, limit = plain[p], own[p], cap[p + 1]
        items = [(name, o.cost, act - o.kept, need_own + (o.transient if name != "keep" else 0))
                 for name, o in choices.items()]
        candidates = []
        for time_spent, neg_saved, _, trail in front:
            saved = -neg_saved
            if saved < need_plain:
                continue
            for name, cost, delta, need in items:
                if saved >= need:
                    candidates.append((time_spent + cost, -min(saved + delta, limit), len(candidates), (name, trail)))
        if not candidates:
            return None
        # keep the states that no other state beats on both time and savings
        candidates.sort()
        front = []
        best = float("inf")
        for state in candidates:
            if state[1] < best:
                front.append(state)
                best = state[1]
    feasible = [state for state in front if -state[1] >= plain[n]]
    if not feasible:
        return None
    trail = feasible[0][3]  # the front is sorted by time
    decisions = []
    while trail is not None:
        decisions.append(trail[0])
        trail = trail[1]
    return decisions[::-1]


def _smallest_peak(prof: Profile, options: list[dict[str, _Option]]) -> int:
    """The lowest peak any plan reaches: maximizing savings at every step is optimal for feasibility."""
    low, high = 0, prof.peak_bytes
    while low < high:
        middle = (low + high) // 2
        if _feasible(prof, middle, options):
            high = middle
        else:
            low = middle + 1
    return low


def _feasible(prof: Profile, budget: int, options: list[dict[str, _Option]]) -> bool:
    plain, own = _needs(prof, budget)
    saved = 0
    for p, choices in enumerate(options):
        if saved < plain[p]:
            return False
        act = prof.rows[p].act_bytes
        valid = [
            saved + act - o.kept
            for name, o in choices.items()
            if saved >= own[p] + (o.transient if name != "keep" else 0)
        ]
        if not valid:
            return False
        saved = max(valid)
    return saved >= plain[len(options)]


def _resolve_budget(prof: Profile, budget: int | float | str) -> int:
    if isinstance(budget, str):
        return parse_bytes(budget)
    if isinstance(budget, float) and 0 < budget <= 1:
        return prof.param_bytes + prof.buffer_bytes + int(budget * prof.peak_above_params)
    if isinstance(budget, (int, float)) and budget > 1:
        return int(budget)
    raise ValueError(
        f"remat.plan: budget must be bytes (> 1), a size string like '8GiB', or a fraction in (0, 1] of the "
        f"step's peak above parameters; got {budget!r}."
    )


def plan_from_profile(
    prof: Profile, budget: int | float | str, allow: Sequence[str] = ("checkpoint", "save_matmuls", "offload")
) -> Plan:
    """Solve the plan for an existing profile (see :func:`plan`)."""
    budget_bytes = _resolve_budget(prof, budget)
    options = _options(prof, allow)
    decisions = _solve(prof, budget_bytes, options)
    if decisions is None:
        raise InfeasibleBudget(budget_bytes, _smallest_peak(prof, options))
    extra = sum(options[i][d].cost for i, d in enumerate(decisions))
    return Plan(
        decisions={row.name: d for row, d in zip(prof.rows, decisions)},
        predicted_peak=predict_peak(prof, decisions, allow),
        predicted_extra_time=extra,
        budget=budget_bytes,
        baseline_peak=prof.peak_bytes,
        param_bytes=prof.param_bytes + prof.buffer_bytes,
        step_time=prof.step_time,
    )


def plan(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    allow: Sequence[str] = ("checkpoint", "save_matmuls", "offload"),
    modules: Sequence[str] | None = None,
) -> Plan:
    """Profile ``model`` for one step and return the cheapest :class:`Plan` whose peak fits ``budget``.

    ``budget``: bytes, a size string (``"8GiB"``, ``"512MB"``) for the whole
    peak, or a fraction (``0.5``) of the unplanned step's peak above the
    parameters.  ``offload`` is only considered on an accelerator.

    Example:
        >>> p = remat.plan(model, tokens, budget=0.5, loss_fn=loss_fn)
        >>> print(p)
        >>> p.apply(model)
    """
    if any(isinstance(m, ActivationWrapper) for m in model.modules()):
        raise ValueError("remat.plan: the model already has checkpoint/offload wrappers; remove them first "
                         "(plan.remove(model)) so the profile sees the step without checkpointing.")
    prof = run_profile(model, *example_inputs, loss_fn=loss_fn, modules=modules)
    return plan_from_profile(prof, budget, allow)


@dataclass
class Plan:
    """One decision per candidate module, with the predicted peak and extra time."""

    decisions: dict[str, str]
    predicted_peak: int
    predicted_extra_time: float
    budget: int
    baseline_peak: int
    param_bytes: int
    step_time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the planned modules in place (idempotent; a changed plan re-wraps). Returns ``model``."""
        for name, decision in self.decisions.items():
            parent, child, current = _locate(model, name)
            wrapped = isinstance(current, ActivationWrapper)
            if wrapped and getattr(current, "_remat_decision", None) == decision:
                continue
            inner = current._checkpoint_wrapped_module if wrapped else current
            if decision == "keep":
                setattr(parent, child, inner)
                continue
            inner._remat_path = name
            wrapper = _WRAPPERS[decision](inner)
            wrapper._remat_decision = decision
            setattr(parent, child, wrapper)
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`. Returns ``model``."""
        for name in self.decisions:
            parent, child, current = _locate(model, name)
            if isinstance(current, ActivationWrapper):
                setattr(parent, child, current._checkpoint_wrapped_module)
        return model

    def save(self, path: str) -> None:
        """Write the plan as JSON keyed by module qualified names."""
        with open(path, "w") as f:
            json.dump(self.__dict__, f, indent=2)

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by :meth:`save`."""
        with open(path) as f:
            return cls(**json.load(f))

    def __str__(self) -> str:
        counts = {option: list(self.decisions.values()).count(option) for option in OPTIONS}
        width = max([len(n) for n in self.decisions] + [6])
        lines = [f"{'module':<{width}}  decision", "-" * (width + 14)]
        lines += [f"{name:<{width}}  {decision}" for name, decision in self.decisions.items()]
        summary = ", ".join(f"{count} {option}" for option, count in counts.items() if count)
        above = self.predicted_peak - self.param_bytes
        base_above = self.baseline_peak - self.param_bytes
        lines.append(
            f"{summary}. Predicted peak {format_bytes(self.predicted_peak)} (budget {format_bytes(self.budget)}; "
            f"{format_bytes(above)} above parameters vs {format_bytes(base_above)} without a plan); "
            f"predicted extra time {self.predicted_extra_time * 1e3:.1f} ms per step"
            + (f" (+{self.predicted_extra_time / self.step_time:.0%})" if self.step_time else "")
        )
        return "\n".join(lines)


def _locate(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module]:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, ActivationWrapper):
        parent = parent._checkpoint_wrapped_module
    return parent, child, getattr(parent, child)


_WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint": checkpoint_wrapper,
    "save_matmuls": lambda m: checkpoint_wrapper(m, policy=save_matmuls),
    "offload": offload_wrapper,
}
