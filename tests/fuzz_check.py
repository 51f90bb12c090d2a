"""The plan fuzz's checker: every plan of a random model keeps its promise in a short training loop.

For one :class:`~fuzz_models.FuzzCase`, :func:`check_case` profiles the model, takes the planner's plan at every
feasible budget of a grid and a few random assignments of options (each block's keep / checkpoint /
save_matmuls / selective policy keeping a random set of its op outputs, or a segment over a run of blocks), and
runs every distinct plan through :func:`remat.check_plan`: a few SGD steps of a planned and an unplanned copy,
each step's peak measured with MemTracker.  A plan holds when every step peaks within 3% of the prediction and
the gradients are bitwise equal; an exception where plain autograd runs is an error.

Example:
    >>> result = check_case(make_case(7))
    >>> [plan.label for plan in result.plans if not plan.holds]
    []
"""

from __future__ import annotations

import random
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from fuzz_models import FuzzCase

import remat
from remat.planning.choices.chain import chain_options
from remat.planning.choices.options import DEFAULT_ALLOW, BlockOption, selective_option
from remat.planning.measure.profile import StepProfile
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import InfeasibleBudget, plan_of

__all__ = ["BUDGETS", "ROW_BYTES", "CaseResult", "PlanResult", "assignment_plan", "check_case", "meta_difference",
           "random_assignment"]

BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""The grid of budgets, as fractions of the unplanned peak above parameters."""

ROW_BYTES = ("act_bytes", "own_bytes", "held_bytes", "recompute_bytes", "input_bytes", "output_bytes", "matmul_bytes",
             "forward_start", "forward_peak", "save_peak", "unsaved_held_bytes")
"""The bytes of a profile's row that a meta profile must match to the byte."""


@dataclass
class PlanResult:
    """One plan of a case: its label (``"50%"``, ``"random 2"``), what it decides, and what the check saw.

    ``error`` is the exception's last line when the planned step raised; ``peaks`` the measured peak per step.
    """

    label: str
    decisions: str
    predicted: int
    peaks: list[int] = field(default_factory=list)
    grads_equal: bool = True
    error: str = ""

    @property
    def worst(self) -> float:
        """The measured peak's largest signed error against the prediction over the steps."""
        return max(((peak - self.predicted) / max(self.predicted, 1) for peak in self.peaks), key=abs, default=0.0)

    @property
    def peaks_hold(self) -> bool:
        return bool(self.peaks) and abs(self.worst) <= remat.planning.check.PEAK_TOLERANCE

    @property
    def holds(self) -> bool:
        return not self.error and self.peaks_hold and self.grads_equal

    def __str__(self) -> str:
        verdict = (f"error: {self.error}" if self.error else
                   f"predicted {self.predicted:,} measured {self.peaks} ({self.worst:+.1%})"
                   f"{'' if self.grads_equal else ', gradients differ'}")
        return f"{self.label}: {self.decisions}: {verdict}"


@dataclass
class CaseResult:
    """One case: its profile and plans, or ``error`` when the model could not be profiled (the exception's last
    line)."""

    case: FuzzCase
    plans: list[PlanResult] = field(default_factory=list)
    error: str = ""
    profile: StepProfile | None = None

    def misses(self) -> list[PlanResult]:
        return [plan for plan in self.plans if not plan.holds]


def check_case(case: FuzzCase, budgets: Sequence[float] = BUDGETS, assignments: int = 2, steps: int = 3,
               allow: Sequence[str] = DEFAULT_ALLOW) -> CaseResult:
    """Profile ``case``'s model, plan it at every feasible budget of ``budgets`` and take ``assignments`` random
    assignments of the options in ``allow`` (and ``keep``) besides; check every distinct plan over ``steps``
    training steps.

    Example:
        >>> check_case(make_case(3), budgets=(0.5,), assignments=0).plans[0].holds
        True
    """
    result = CaseResult(case)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unsteady timings on a busy machine: the plans are checked anyway
            prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    except Exception as error:  # noqa: BLE001 - a model plain autograd trains must profile: any failure counts
        result.error = _last_line(error)
        return result
    result.profile = prof
    seen: set[str] = set()
    rng = random.Random(case.seed)
    candidates: list[tuple[str, Plan]] = []
    for budget in budgets:
        try:
            candidates.append((f"{budget:.0%}", prof.plan(budget)))
        except InfeasibleBudget:
            continue
    options = [[o for o in choices if o.name in ("keep", "segment", *allow) and o.name != "selective"]
               for choices in chain_options(prof)]
    if "selective" in allow:
        _add_selective(prof, options, rng)
    for k in range(assignments):
        candidates.append((f"random {k}", assignment_plan(prof, random_assignment(options, rng))))
    for label, plan in candidates:
        key = _describe(plan)
        if key in seen:
            continue
        seen.add(key)
        result.plans.append(_check(case, label, key, plan, steps))
    return result


def _add_selective(prof: StepProfile, options: list[list[BlockOption]], rng: random.Random, per_block: int = 2
                   ) -> None:
    """Give every block that may recompute up to ``per_block`` selective options keeping random sets of its op
    outputs: drawn from the op graph's structure, not from the front its timings pick, so a seed checks the same
    plans on any machine; like the planner's, only those that keep less than the block's own bytes.

    The block's output is never among them: a policy that keeps it is predicted to hold it twice where the step
    holds it anyway (as the next block's input), up to 9% above the step (on the safe side; the planner's fronts
    rarely keep an output, whose rerun is at most the block's last op)."""
    for row, choices in zip(prof.rows, options):
        graph = prof.ops.blocks.get(row.name)
        returned = {s.producer for s in graph.storages if s.dies is None} if graph is not None else set()
        keepable = [i for i in graph.keepable if i not in returned] if graph is not None else []
        if not keepable or not any(o.name == "checkpoint" for o in choices):
            continue
        for _ in range(per_block):
            option = selective_option(row, graph, rng.sample(keepable, rng.randint(1, len(keepable))))
            if option.kept < row.own_bytes:
                choices.append(option)


def random_assignment(options: list[list[BlockOption]], rng: random.Random) -> list[BlockOption]:
    """One option per run of blocks, drawn at random (a ``segment`` where one starts, half the time), spans
    covering every block once.

    Example:
        >>> chosen = random_assignment(chain_options(prof), random.Random(0))
    """
    chosen, p = [], 0
    while p < len(options):
        segments = [o for o in options[p] if o.span > 1]
        pool = segments if segments and rng.random() < 0.5 else [o for o in options[p] if o.span == 1]
        option = rng.choice(pool)
        chosen.append(option)
        p += option.span
    return chosen


def assignment_plan(prof: StepProfile, chosen: Sequence[BlockOption]) -> Plan:
    """The plan that takes exactly ``chosen`` (one option per run of blocks, as :func:`random_assignment`), priced
    by the planner's own cost model.

    Example:
        >>> plan = assignment_plan(prof, random_assignment(chain_options(prof), random.Random(0)))
    """
    placed, p = [], 0
    for option in chosen:
        placed.append((p, option))
        p += option.span
    return plan_of(prof, placed, 4 * prof.peak_bytes)


def meta_difference(case: FuzzCase, on_cpu: StepProfile | None = None) -> str:
    """Where ``case``'s profile on the meta device differs from its profile on the CPU (``on_cpu``, or one made
    here), in bytes: "" where every segment's peak and start, every row's bytes and the step's peak and gradients
    are equal.

    Example:
        >>> meta_difference(make_case(7))
        ''
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if on_cpu is None:
            on_cpu = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1, ops=False)
        with torch.device("meta"):
            model = case.build()
        on_meta = remat.profile(model, torch.empty_like(case.inputs, device="meta"), loss_fn=case.loss_fn,
                                device="meta", ops=False)
    for cpu, meta in zip(on_cpu.segments, on_meta.segments, strict=True):
        if (cpu.label, cpu.peak, cpu.start) != (meta.label, meta.peak, meta.start):
            return f"{cpu.label}: peak {meta.peak - cpu.peak:+,} B, start {meta.start - cpu.start:+,} B on meta"
    for cpu_row, meta_row in zip(on_cpu.rows, on_meta.rows, strict=True):
        for name in ROW_BYTES:
            if getattr(cpu_row, name) != getattr(meta_row, name):
                return f"{cpu_row.name} ({cpu_row.cls}) {name}: {getattr(meta_row, name) - getattr(cpu_row, name):+,} B"
    if (on_cpu.peak_bytes, on_cpu.grad_bytes) != (on_meta.peak_bytes, on_meta.grad_bytes):
        return f"step peak {on_meta.peak_bytes - on_cpu.peak_bytes:+,} B, gradients on meta differ"
    return ""


def _check(case: FuzzCase, label: str, decisions: str, plan: Plan, steps: int) -> PlanResult:
    result = PlanResult(label, decisions, plan.predicted_peak - plan.param_bytes)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checked = remat.check_plan(case.build, plan, case.inputs, loss_fn=case.loss_fn, steps=steps,
                                       optimizer="sgd", seed=case.seed)
    except Exception as error:  # noqa: BLE001 - plain autograd trains this model: any failure under a plan counts
        result.error = _last_line(error)
        return result
    result.peaks = [row.peak for row in checked.rows]
    result.grads_equal = checked.grads_equal
    return result


def _describe(plan: Plan) -> str:
    """The plan's decisions in a line: segments as ``[a..b]``, other blocks by their option's initial."""
    in_segments = {name: run for run in plan.segments for name in run}
    parts = []
    for name, decision in plan.decisions.items():
        run = in_segments.get(name)
        if run is not None:
            if name == run[0]:
                parts.append(f"[{run[0]}..{run[-1]}]")
            continue
        policy = plan.policies.get(name)
        tag = {"keep": "k", "checkpoint": "c", "save_matmuls": "m", "offload": "o"}.get(decision, decision[:3])
        if policy is not None:
            tag += str(sum(op["decision"] != "recompute" for op in policy.get("ops", [])))
        parts.append(f"{name}:{tag}")
    return " ".join(parts)


def _last_line(error: BaseException) -> str:
    lines = traceback.format_exception_only(type(error), error)
    return lines[-1].strip() if lines else type(error).__name__
