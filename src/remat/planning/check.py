"""Check a plan on its model in a real training loop: measured peaks, times and gradients against its predictions.

:func:`check_plan` trains two copies of the model for a few steps, from the same weights, batches and seeds,
with an optimizer stepping between them: one copy under the plan, one without checkpointing.  Every step's
peak is measured as :func:`~remat.planning.basics.memory.measure_step` measures it (MemTracker's bytes above
parameters and buffers) on the CPU, and as the allocator's peak above the step's start on an accelerator; its
forward and backward are timed on the device's clock.  A plan holds when every step of the planned copy
peaks within 3% of the predicted peak and its gradients equal the unplanned copy's; its extra time is
compared with the predicted extra and reported (timing is noisy: a warning, never a failure).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api.chunkedloss import chunked_tolerance
from .basics.kvcache import cache_off_in_training
from .basics.memory import measure_step
from .basics.optimizers import OPTIMIZERS, make_optimizer
from .basics.units import format_bytes
from .measure.profile import default_loss
from .measure.timing import Clock, device_of
from .solve.plan import Plan

__all__ = ["OPTIMIZERS", "PEAK_TOLERANCE", "TIME_TOLERANCE", "PlanCheck", "StepCheck", "check_plan"]

PEAK_TOLERANCE = 0.03
"""How far (a fraction of the predicted peak) a step's measured peak may be from it for the plan to hold."""

TIME_TOLERANCE = 0.2
"""How far (a fraction of the predicted extra time) the measured extra time may be before a warning."""

@dataclass(frozen=True)
class StepCheck:
    """One training step of the planned copy and of the unplanned one.

    ``peak`` and ``unplanned_peak``: bytes above parameters and buffers at the step's peak; ``time`` and
    ``unplanned_time``: device seconds of the forward and backward; ``max_grad_diff``: the largest absolute
    difference between the two copies' gradients.  ``grads_equal``: bitwise equal (NaNs in the same places count
    as equal), or, for a plan that computes the output layer and loss in several chunks (``Plan.head_chunks``),
    within :func:`remat.chunked_tolerance`; ``loss`` and ``unplanned_loss``: each copy's loss;
    ``buffers_differ``: the buffers (batch norm's statistics, ...) the two copies' forwards left unequal, by name.
    """

    step: int
    peak: int
    unplanned_peak: int
    time: float
    unplanned_time: float
    grads_equal: bool
    max_grad_diff: float
    loss: float = 0.0
    unplanned_loss: float = 0.0
    buffers_differ: tuple[str, ...] = ()


@dataclass
class PlanCheck:
    """What :func:`check_plan` measured, per step, against what the plan predicted.

    ``predicted_peak`` is the plan's predicted peak above parameters and buffers
    (``plan.predicted_peak - plan.param_bytes``), ``profiled_peak`` the unplanned peak the plan was made from,
    on the same scale.  ``holds`` is the verdict; ``verdict()`` says it in one line.

    Example:
        >>> result = remat.check_plan(model, plan, tokens, loss_fn=loss_fn)
        >>> result.holds, result.verdict()
    """

    rows: list[StepCheck]
    predicted_peak: int
    predicted_extra_time: float
    profiled_peak: int
    optimizer: str
    device: str
    peak_tolerance: float = PEAK_TOLERANCE
    time_tolerance: float = TIME_TOLERANCE
    notes: list[str] = field(default_factory=list)
    head_chunks: int = 0  # the plan's; > 1: gradients compared within the chunked loss's tolerance

    def peak_error(self, row: StepCheck) -> float:
        """The step's measured peak relative to the predicted one, as a signed fraction (-0.1: 10% below)."""
        return (row.peak - self.predicted_peak) / max(self.predicted_peak, 1)

    def predicted_time(self, row: StepCheck) -> float:
        """What the plan predicts this step takes: the unplanned copy's time plus the predicted extra."""
        return row.unplanned_time + self.predicted_extra_time

    @property
    def peaks_hold(self) -> bool:
        return all(abs(self.peak_error(row)) <= self.peak_tolerance for row in self.rows)

    @property
    def grads_equal(self) -> bool:
        return all(row.grads_equal for row in self.rows)

    @property
    def losses_equal(self) -> bool:
        """Every step's loss is the same with and without the plan (NaN on both sides counts as the same; with the
        output layer and loss in several chunks, within :func:`remat.chunked_tolerance` of float32)."""
        return all(self._same_loss(row) for row in self.rows)

    def _same_loss(self, row: StepCheck) -> bool:
        if _same_value(row.loss, row.unplanned_loss):
            return True
        # the loss is float32 (transformers upcasts the logits for it)
        close = abs(row.loss - row.unplanned_loss) <= chunked_tolerance(torch.float32) * abs(row.unplanned_loss)
        return self.head_chunks > 1 and close

    @property
    def buffers_equal(self) -> bool:
        """After every step the planned copy's buffers equal the unplanned copy's, bitwise."""
        return not any(row.buffers_differ for row in self.rows)

    @property
    def holds(self) -> bool:
        """Every step peaked within ``peak_tolerance`` of the prediction, with losses, gradients and buffers
        bitwise equal."""
        return (bool(self.rows) and self.peaks_hold and self.grads_equal and self.losses_equal
                and self.buffers_equal)

    @property
    def extra_time(self) -> float:
        """The measured extra seconds per step: the median over the steps after the first (a warm-up)."""
        timed = self.rows[1:] or self.rows
        return statistics.median(row.time - row.unplanned_time for row in timed)

    @property
    def extra_time_error(self) -> float | None:
        """The measured extra time relative to the predicted extra, as a signed fraction (None if none was
        predicted)."""
        if self.predicted_extra_time <= 0:
            return None
        return (self.extra_time - self.predicted_extra_time) / self.predicted_extra_time

    @property
    def time_warning(self) -> bool:
        """Whether the extra time missed its prediction by more than ``time_tolerance``."""
        error = self.extra_time_error
        return error is not None and abs(error) > self.time_tolerance

    def verdict(self) -> str:
        """One line: whether the plan holds, and why not if it does not; the extra time against its prediction.

        Example:
            >>> print(remat.check_plan(model, plan, tokens).verdict())
        """
        predicted = format_bytes(self.predicted_peak)
        allowed = f"{self.peak_tolerance:.0%}"
        if self.holds:
            worst = max(self.rows, key=lambda row: abs(self.peak_error(row)))
            head = (f"the plan holds: {len(self.rows)} {self.optimizer} steps peaked within {allowed} of the "
                    f"predicted {predicted} above parameters (largest error {self.peak_error(worst):+.1%}), "
                    + ("gradients bitwise equal to the unplanned model's" if self.head_chunks < 2 else
                       f"gradients within the chunked loss's tolerance of the unplanned model's (the output layer "
                       f"and loss in {self.head_chunks} chunks add in another order)"))
        else:
            reasons = []
            missed = [row for row in self.rows if abs(self.peak_error(row)) > self.peak_tolerance]
            if missed:
                first = missed[0]
                steps = _steps(missed)
                reasons.append(f"{steps} peaked off the predicted {predicted} above parameters by more than "
                               f"{allowed} (step {first.step}: {format_bytes(first.peak)}, "
                               f"{self.peak_error(first):+.1%})")
            reasons.extend(self._loss_and_grad_reasons())
            head = "the plan does not hold: " + "; ".join(reasons or ["no step was run"])
        diverged = [row for row in self.rows if not math.isfinite(row.unplanned_loss)]
        if diverged:  # the training itself diverges: what the check compared is NaN / inf with or without the plan
            first = diverged[0]
            head += (f"; without the plan too the loss is {first.unplanned_loss} from step {first.step}: the training "
                     "diverges (learning rate, inputs, loss), which no plan causes or fixes")
        return f"{head}; {self._time_clause()}" if self.rows else head

    def _loss_and_grad_reasons(self) -> list[str]:
        """Why the planned copy did not train as the unplanned one: its loss first (NaN, or another value),
        then its gradients."""
        reasons = []
        lost = [row for row in self.rows if not math.isfinite(row.loss) and math.isfinite(row.unplanned_loss)]
        if lost:
            first = lost[0]
            reasons.append(f"under the plan the loss is {first.loss} at {_steps(lost)} where without it it is "
                           f"{first.unplanned_loss:.6g}")
        apart = [row for row in self.rows if row not in lost and not self._same_loss(row)]
        if apart:
            first = apart[0]
            reasons.append(f"the loss differs from the unplanned model's at {_steps(apart)} (step {first.step}: "
                           f"{first.loss:.9g} vs {first.unplanned_loss:.9g})")
        differing = [row for row in self.rows if not row.grads_equal]
        if differing:
            worst = max(row.max_grad_diff for row in differing)
            reasons.append(f"gradients differ from the unplanned model's at {_steps(differing)} "
                           f"(max |Δ| {worst:.3g})")
        moved = [row for row in self.rows if row.buffers_differ]
        if moved:
            names = moved[0].buffers_differ
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            reasons.append(f"buffers differ from the unplanned model's at {_steps(moved)} ({shown})")
        return reasons

    def _time_clause(self) -> str:
        measured, predicted = self.extra_time * 1e3, self.predicted_extra_time * 1e3
        clause = f"extra time {measured:,.1f} ms per step vs {predicted:,.1f} ms predicted"
        error = self.extra_time_error
        if error is None:
            return clause
        clause += f" ({error:+.0%}"
        if self.time_warning:
            clause += f", outside {self.time_tolerance:.0%}: a warning, timing is noisy"
        return clause + ")"

    def __str__(self) -> str:
        header = (f"{'step':>4}  {'peak predicted':>14} {'measured':>12} {'unplanned':>12}  "
                  f"{'ms predicted':>12} {'measured':>10} {'unplanned':>10}  grads")
        lines = [header, "-" * len(header)]
        for row in self.rows:
            lines.append(
                f"{row.step:>4}  {format_bytes(self.predicted_peak):>14} {format_bytes(row.peak):>12} "
                f"{format_bytes(row.unplanned_peak):>12}  {self.predicted_time(row) * 1e3:>12.1f} "
                f"{row.time * 1e3:>10.1f} {row.unplanned_time * 1e3:>10.1f}  {grads_cell(row)}")
        lines.extend(f"note: {note}" for note in self.notes)
        lines.append(self.verdict())
        return "\n".join(lines)


def grads_cell(row: StepCheck) -> str:
    """How a step's gradient comparison reads in a table: ``equal``, or the largest difference."""
    if row.grads_equal and row.max_grad_diff:
        return f"within tolerance (max |Δ| {row.max_grad_diff:.3g})"
    return "equal" if row.grads_equal else f"max |Δ| {row.max_grad_diff:.3g}"


def _same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _steps(rows: list[StepCheck]) -> str:
    numbers = [str(row.step) for row in rows]
    return ("step " if len(numbers) == 1 else "steps ") + ", ".join(numbers)


def check_plan(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    plan: Plan | str | os.PathLike,
    *inputs: Any,
    steps: int = 4,
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    seed: int = 0,
    on_step: Callable[[StepCheck], None] | None = None,
    **input_kwargs: Any,
) -> PlanCheck:
    """Train ``steps`` steps with and without ``plan``, and compare each step with the plan's predictions.

    ``model_or_factory``: the model, or a function returning it; the check trains two copies (the model
    itself is left as it was), from identical weights, on ``model(*inputs, **input_kwargs)`` at every step,
    with the same dropout draws (``torch.manual_seed(seed + step)``), in the loop the plan's peak assumes
    (``plan.hold_output``): ``out = model(...); loss_fn(out).backward()`` with the output alive until backward ends,
    or with it let go of once the loss is computed.  ``plan``: a :class:`Plan` or the path
    of one saved by :meth:`Plan.save`; it is checked against the model first (ValueError if it was made for
    another).  ``optimizer``: a name from :data:`~remat.planning.basics.optimizers.OPTIMIZERS` (``"adamw"``: lr 1e-3,
    foreach; ``"sgd"``: lr 1e-2, momentum 0.9; ``"adamw-fused"``) or a function from the parameters to an
    optimizer.  ``loss_fn(output)`` is the loss, as in :func:`remat.profile` (default: the
    output's ``.loss``, or the sum of its floating tensors).  ``on_step`` is called with each step's row.

    Peaks count what :func:`remat.measure_step` counts (everything the forward and backward allocate above
    parameters and buffers; the optimizer's state is not part of it); on the CPU, where MemTracker slows the
    step it measures, each step runs a second time from the same weights and seed to be timed.

    Example:
        >>> result = remat.check_plan(model, remat.Plan.load("plan.json"), tokens, loss_fn=loss_fn, steps=4)
        >>> print(result)            # per step: peaks and times predicted / measured / unplanned, gradients
        >>> assert result.holds
    """
    if steps < 1:
        raise ValueError(f"remat.check_plan: steps must be at least 1, got {steps}.")
    make_optimizer = _optimizer(optimizer)
    plan = plan if isinstance(plan, Plan) else Plan.load(os.fspath(plan))
    given = isinstance(model_or_factory, nn.Module)
    model = model_or_factory if given else model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"remat.check_plan: the factory returned {type(model).__name__}, not a torch.nn.Module.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # about blocks the plan leaves out: apply says it below
        plan.check(model)  # before copying anything
    # A model the caller gave stays theirs, untrained; one the factory built is the unplanned copy itself.
    # remove: a model already planned is compared with its own weights.
    unplanned = plan.remove(copy.deepcopy(model) if given else model)
    planned = copy.deepcopy(unplanned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the planned copy says it, once, when the plan is applied below
        cache_off_in_training(unplanned)  # as the profile ran it: a KV cache is no part of the prediction
    runs = [_Run(each, make_optimizer, plan.hold_output) for each in (unplanned, plan.apply(planned))]
    loss_of = loss_fn or default_loss
    clock = Clock(device_of(runs[0].params))
    rows = []
    for run in runs:
        run.warm_up(loss_of, inputs, input_kwargs, seed, clock)
    for step in range(1, steps + 1):
        order = runs if step % 2 else runs[::-1]  # neither copy always runs first (caches, clocks warming up)
        measured = {id(run): run.step(loss_of, inputs, input_kwargs, seed + step, clock) for run in order}
        base, under_plan = (measured[id(run)] for run in runs)
        equal, diff = _compare(base.grads, under_plan.grads, plan.head_chunks > 1)
        row = StepCheck(step, under_plan.peak, base.peak, under_plan.seconds, base.seconds, equal, diff,
                        under_plan.loss, base.loss, _buffers_differ(*(run.model for run in runs)))
        rows.append(row)
        for run in runs:
            run.optimizer.step()
        if on_step is not None:
            on_step(row)
    result = PlanCheck(rows, plan.predicted_peak - plan.param_bytes, plan.predicted_extra_time,
                       plan.baseline_peak - plan.param_bytes, optimizer if isinstance(optimizer, str) else "custom",
                       str(clock.device), head_chunks=plan.head_chunks)
    result.notes.extend(_notes(result))
    return result


def _optimizer(optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
               ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    if callable(optimizer):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"remat.check_plan: optimizer must be one of {', '.join(OPTIMIZERS)} or a function of the "
                         f"parameters, got {optimizer!r}.")
    return functools.partial(make_optimizer, optimizer)


def _notes(result: PlanCheck) -> list[str]:
    """What explains a miss before the plan is blamed: an unplanned step unlike the one profiled."""
    unplanned = result.rows[0].unplanned_peak
    if result.profiled_peak > 0 and abs(unplanned - result.profiled_peak) > result.peak_tolerance * unplanned:
        return [f"without the plan the step peaks at {format_bytes(unplanned)} above parameters, and the profile "
                f"the plan was made from saw {format_bytes(result.profiled_peak)}: check with the inputs (shapes, "
                "batch size) and loss the plan was made with"]
    return []


@dataclass
class _Measured:
    peak: int
    seconds: float
    grads: list[torch.Tensor | None]
    loss: float


class _Run:
    """One copy of the model and its optimizer, stepped by the check."""

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 hold_output: bool) -> None:
        self.model = model
        self.hold_output = hold_output
        self.params = list(model.parameters())  # the same order in both copies: wrappers add no parameters
        self.optimizer = make_optimizer(self.params)

    def _pass(self, loss_of: Callable[[Any], torch.Tensor], inputs: tuple, kwargs: dict, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        output = self.model(*inputs, **kwargs)
        loss = loss_of(output)
        if not self.hold_output:  # the loop the plan's peak assumes: the output gone once the loss is computed
            del output
        loss.backward()
        return loss.detach()

    def warm_up(self, loss_of: Callable[[Any], torch.Tensor], inputs: tuple, kwargs: dict, seed: int,
                clock: Clock) -> None:
        """An untimed forward and backward on an accelerator, so that the allocator's and libraries' first-call
        workspaces are not in the first step's peak (the profile warmed up the same way)."""
        if clock.asynchronous:
            self._pass(loss_of, inputs, kwargs, seed)

    def step(self, loss_of: Callable[[Any], torch.Tensor], inputs: tuple, kwargs: dict, seed: int, clock: Clock
             ) -> _Measured:
        """One forward and backward: its peak above parameters, its device seconds, the gradients it left."""
        def run() -> torch.Tensor:
            return self._pass(loss_of, inputs, kwargs, seed)

        for p in self.params:
            p.grad = None  # before measuring: the last step's gradients are no part of this step's peak
        stats = _allocator(clock.device)
        if stats is not None:
            stats.synchronize(clock.device)
            stats.reset_peak_memory_stats(clock.device)
            start = stats.memory_allocated(clock.device)
            loss, seconds, _ = clock.time(run)
            peak = stats.max_memory_allocated(clock.device) - start
            return _Measured(peak, seconds, [p.grad for p in self.params], _scalar(loss))
        peak = measure_step(run, self.model).peak_above_params
        grads = [p.grad for p in self.params]
        buffers = [b.clone() for b in self.model.buffers()]  # a forward in training may update them (batch norm)
        for p in self.params:
            p.grad = None
        loss, seconds, _ = clock.time(run)  # the same pass again, from the same weights and seed, untracked
        with torch.no_grad():
            for buffer, before in zip(self.model.buffers(), buffers):
                buffer.copy_(before)
        for p, grad in zip(self.params, grads):
            p.grad = grad
        return _Measured(peak, seconds, grads, _scalar(loss))


def _scalar(loss: torch.Tensor) -> float:
    """The loss as a number (its sum where the loss function returned more than one)."""
    return float(loss.float().sum())


def _allocator(device: torch.device) -> Any:
    """The device's allocator statistics module (``torch.cuda`` and its like), or None to count with MemTracker."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    needed = ("max_memory_allocated", "memory_allocated", "reset_peak_memory_stats", "synchronize")
    return module if all(hasattr(module, name) for name in needed) else None


def _buffers_differ(expected: nn.Module, got: nn.Module) -> tuple[str, ...]:
    """The names (``expected``'s) of the buffers two copies of a model hold unequal; NaNs in the same places are
    equal.  In order: a plan's wrappers rename buffers (one level more), add none and keep their order."""
    return tuple(name for (name, mine), theirs in zip(expected.named_buffers(), got.buffers(), strict=True)
                 if not _compare([mine], [theirs])[0])


def _compare(expected: list[torch.Tensor | None], got: list[torch.Tensor | None], chunked: bool = False
             ) -> tuple[bool, float]:
    """Whether two gradient lists are bitwise equal (``chunked``: within :func:`remat.chunked_tolerance`), and
    their largest absolute difference."""
    equal, worst = True, 0.0
    for a, b in zip(expected, got):
        if a is None or b is None:
            if (a is None) != (b is None):
                equal, worst = False, float("inf")
            continue
        if a.shape != b.shape:
            return False, float("inf")
        if not torch.equal(a, b):
            both_nan = a.isnan() & b.isnan()
            if bool(((a == b) | both_nan).all()):  # NaN where the other copy has NaN: the same gradient
                continue
            apart = (a.double() - b.double()).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=float("inf"))
            difference = apart.max().item()
            scale = a.double().abs().masked_fill(both_nan, 0.0).max().item()
            equal = equal and chunked and difference <= chunked_tolerance(a.dtype) * scale
            worst = max(worst, difference)
    return equal, worst
