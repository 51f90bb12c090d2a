"""The output layer and loss as a plan option: computed over token chunks (:func:`remat.chunk_lm_head`).

When every layer is checkpointed, what is left of a causal LM's step peak is mostly its output layer and loss:
the logits, log-softmax's float32 output and their gradient.  No block option touches them.  For a Hugging
Face causal LM profiled with ``labels`` (its own loss), :func:`measure_head` measures the step's memory
timeline once more with the loss chunked: the blocks run as before, only the stretches around the head change,
so the chain's cost model holds with that timeline in place of the first.  The option's extra time is the
chunked head's forward, timed on the profiled shapes: backward computes every chunk's logits and loss once more.

:func:`plan_with_head` solves the budget on both timelines and keeps the cheaper plan that fits; a budget only
the chunked head reaches is planned with it instead of refused.  The plan records the chunk count
(``Plan.head_chunks``) and installs it when applied.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ...api.chunkedhead import chunk_lm_head, lm_head_chunks, lm_head_refusal, unchunk_lm_head
from ...api.chunkedloss import chunked_lm_loss
from ..basics.units import Budget, parse_budget
from ..choices.options import DEFAULT_ALLOW
from ..measure.profile import StepProfile, _assemble
from ..measure.timeline import _trace
from ..measure.timing import Clock
from .alternatives import plans_near
from .plan import Plan
from .solver import InfeasibleBudget, plan_from_profile

__all__ = ["HeadOption", "alternatives_with_head", "head_chunk_count", "measure_head", "plan_with_head"]


@dataclass
class HeadOption:
    """The chunked output layer and loss of a profiled step: ``chunks``, the step's timeline measured with it
    (``profile``: the same blocks, prices and options), and ``extra_time``, the seconds it adds to a step."""

    chunks: int
    profile: StepProfile
    extra_time: float


def head_chunk_count(tokens: int, features: int) -> int:
    """The chunks a plan uses: each chunk's logits about the size of the output layer's weight gradient.

    The chunked head's peak is three chunks' logits (float32) plus that gradient and a chunk's part of it, so
    smaller chunks spare little more and cost more kernel launches.

    Example:
        >>> head_chunk_count(tokens=2048, features=256)
        12
    """
    return max(1, min(tokens, -(-3 * tokens // (2 * features))))


def measure_head(model: nn.Module, example_inputs: tuple, example_kwargs: dict, blocks: list[tuple[str, nn.Module]],
                 custom_loss: bool, prof: StepProfile, repeats: int) -> HeadOption | None:
    """The chunked-head option of a profiled step, or None where it does not apply.

    It applies to a Hugging Face causal LM in training mode, profiled with ``labels`` and its own loss (no
    ``loss_fn``), not already chunked, whose loss on the profiled call :func:`remat.chunk_lm_head` shows to be
    the chunked one.

    Example:
        >>> option = measure_head(model, (), {"input_ids": ids, "labels": ids}, blocks, False, prof, 5)
    """
    labels = example_kwargs.get("labels")
    if (custom_loss or labels is None or not model.training or lm_head_chunks(model) is not None
            or lm_head_refusal(model, *example_inputs, **example_kwargs)):
        return None
    head = model.get_output_embeddings()
    chunks = head_chunk_count(labels.numel(), head.in_features)
    inputs = [t for t in (*example_inputs, *example_kwargs.values()) if isinstance(t, torch.Tensor)]
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    chunk_lm_head(model, chunks)
    try:
        for p in params:
            p.grad = None
        # in the loop the profile measured: with the output held, the chunked head's holds no logits (None)
        traced = _trace(model, lambda: model(*example_inputs, **example_kwargs), lambda output: output.loss, inputs,
                        blocks, hold_output=prof.hold_output)
    finally:
        unchunk_lm_head(model)
        for p, g in zip(params, saved_grads):
            p.grad = g
    rows = prof.rows
    chunked = _assemble(model, blocks, *traced, [r.forward_time for r in rows], [r.matmul_time for r in rows],
                        [r.checkpoint_time for r in rows], [r.save_matmuls_time for r in rows], prof.step_time,
                        prof.device)
    for row, measured in zip(chunked.rows, rows):
        row.region_time, row.tail_time = measured.region_time, measured.tail_time
    chunked = replace(chunked, ops=prof.ops, links=list(prof.links), notes=list(prof.notes),
                      estimated_time=prof.estimated_time, hold_output=prof.hold_output)
    return HeadOption(chunks, chunked, _head_time(head, labels, chunks, repeats))


def _head_time(head: nn.Linear, labels: torch.Tensor, chunks: int, repeats: int) -> float:
    """Device seconds of the chunked head's forward on the profiled shapes: what its backward adds."""
    gen = torch.Generator(device=head.weight.device).manual_seed(0)
    hidden = torch.randn(labels.numel(), head.in_features, generator=gen, device=head.weight.device,
                         dtype=head.weight.dtype)
    targets = labels.reshape(-1)
    clock = Clock(str(head.weight.device))

    def forward() -> torch.Tensor:
        return chunked_lm_loss(hidden, head.weight, targets, head.bias, chunks=chunks, shift=False)

    with torch.no_grad():
        forward()  # warm-up
        return statistics.median(clock.time(forward)[1] for _ in range(max(1, repeats)))


def plan_with_head(prof: StepProfile, head: HeadOption | None, budget: Budget | int | float | str,
                   allow: Sequence[str] | None = None) -> Plan:
    """The cheaper of the plans that fit ``budget`` without and with the chunked head (without on a tie).

    ``budget`` is read against ``prof``, the step without a plan; ``allow`` as in
    :func:`~remat.planning.solve.solver.plan_from_profile`.  Refused
    (:class:`~remat.planning.solve.solver.InfeasibleBudget`) only when neither fits, stating the lowest peak either
    reaches.

    Example:
        >>> plan = plan_with_head(prof, prof.head, "20%")
    """
    def solve(profile: StepProfile, whole: Budget) -> list[Plan]:
        return [plan_from_profile(profile, whole) if allow is None else plan_from_profile(profile, whole, allow)]

    return min(_on_both(prof, head, budget, solve), key=lambda made: made.predicted_extra_time)


def alternatives_with_head(prof: StepProfile, head: HeadOption | None, budget: Budget | int | float | str,
                           count: int, allow: Sequence[str] = DEFAULT_ALLOW) -> list[Plan]:
    """Up to ``count`` distinct plans that fit ``budget``, without and with the chunked head, cheapest predicted
    first (:func:`~remat.planning.solve.alternatives.plans_near` on each timeline).

    Example:
        >>> plans = alternatives_with_head(prof, prof.head, "20%", count=3)
    """
    found = _on_both(prof, head, budget, lambda profile, whole: plans_near(profile, whole, count, allow))
    return sorted(found, key=lambda made: made.predicted_extra_time)[:count]


def _on_both(prof: StepProfile, head: HeadOption | None, budget: Budget | int | float | str,
             solve: Callable[[StepProfile, Budget], list[Plan]]) -> list[Plan]:
    """The plans ``solve`` makes on the step's timeline and on the chunked head's, the budget read against the
    step without a plan; refused only when neither timeline fits it."""
    parsed = parse_budget(budget)
    fixed = prof.param_bytes + prof.buffer_bytes
    budget_bytes = parsed.bytes_for(fixed, prof.peak_above_params)
    found, refusals = [], []
    for profile, option in ((prof, None), *(((head.profile, head),) if head is not None else ())):
        try:
            # the chunked head's timeline is given the bytes the budget comes to on the step without a plan
            made = solve(profile, parsed if option is None else Budget(nbytes=budget_bytes))
        except InfeasibleBudget as refusal:
            refusals.append(refusal)
            continue
        for plan in made:
            if option is not None:
                plan.head_chunks = option.chunks
                plan.predicted_extra_time += option.extra_time
                plan.baseline_peak = prof.peak_bytes
        found.extend(made)
    if found:
        return found
    lowest = min(refusals, key=lambda refusal: refusal.smallest)
    if lowest is refusals[0]:  # the step's own refusal says it all, its reasons included
        raise refusals[0]
    # one smallest peak, the lower: the step's own refusal, which states the higher, is not chained
    requested = parsed.fraction if parsed.fraction is not None else parsed.text or None
    raise InfeasibleBudget(budget_bytes, lowest.smallest, fixed, prof.peak_above_params, requested,
                           **lowest.reasons) from None
