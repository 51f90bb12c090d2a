"""The output layer and loss as a plan option: computed over token chunks (:func:`remat.chunk_lm_head`).

When every layer is checkpointed, what is left of a causal LM's step peak is mostly its output layer and loss:
the logits, log-softmax's float32 output and their gradient.  No block option touches them.  For a Hugging
Face causal LM profiled with ``labels`` (its own loss), :func:`measure_head` measures the step's memory
timeline once more with the loss chunked: the blocks run as before, only the stretches around the head change,
so the chain's cost model holds with that timeline in place of the first.  The option's extra time is what the
chunked head adds to the unchunked one on the profiled shapes, each timed forward and backward in interleaved
rounds: backward computes every chunk's logits once more, but no step holds the whole logits, their float32
copy or their gradient, whose writes the unchunked head pays for (on the CPU, about half of its forward).

:func:`plan_with_head` solves the budget on both timelines and keeps the cheaper plan that fits; a budget only
the chunked head reaches is planned with it instead of refused.  The plan records the chunk count
(``Plan.head_chunks``) and installs it when applied.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ...api.chunkedhead import chunk_lm_head, lm_head_chunks, lm_head_refusal, unchunk_lm_head
from ...api.chunkedloss import chunked_lm_loss, shift_labels
from ..basics.memory import budget_on_device
from ..basics.units import Budget, parse_budget
from ..choices.options import DEFAULT_ALLOW
from ..measure.profile import StepProfile, _assemble
from ..measure.timecache import agrees, spread_of, stale_slack, timings_cache, unsteady_limit
from ..measure.timeline import _trace
from ..measure.timing import Clock
from .alternatives import distinct_plans, plan_for, plans_near, quiet_first
from .plan import Plan
from .solver import InfeasibleBudget, plan_from_profile

__all__ = ["NOT_ON_META", "HeadOption", "alternatives_with_head", "head_applies", "head_chunk_count", "measure_head",
           "plan_with_head", "price_with_head"]

NOT_ON_META = ("on the meta device, the output layer and loss in chunks (remat.chunk_lm_head) were not considered: "
               "their time cannot be measured without data; profile on real tensors (a smaller batch will do) to "
               "plan with them")
"""A meta profile's note where the chunked head would apply, added to its refusals too."""


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


def head_applies(model: nn.Module, example_inputs: tuple, example_kwargs: dict, custom_loss: bool) -> bool:
    """Whether a profile of ``model(*example_inputs, **example_kwargs)`` has the chunked-head option: a Hugging
    Face causal LM in training mode, called with ``labels`` and profiled with its own loss (``custom_loss``
    False), not already chunked, whose loss on that call :func:`remat.chunk_lm_head` shows to be the chunked one
    (on the meta device, its structure only).

    Example:
        >>> head_applies(model, (), {"input_ids": ids, "labels": ids}, custom_loss=False)
        True
    """
    return (not custom_loss and example_kwargs.get("labels") is not None and model.training
            and lm_head_chunks(model) is None and not lm_head_refusal(model, *example_inputs, **example_kwargs))


def measure_head(model: nn.Module, example_inputs: tuple, example_kwargs: dict, blocks: list[tuple[str, nn.Module]],
                 custom_loss: bool, prof: StepProfile, repeats: int) -> HeadOption | None:
    """The chunked-head option of a profiled step, or None where it does not apply (:func:`head_applies`).

    Example:
        >>> option = measure_head(model, (), {"input_ids": ids, "labels": ids}, blocks, False, prof, 5)
    """
    if not head_applies(model, example_inputs, example_kwargs, custom_loss):
        return None
    labels = example_kwargs["labels"]
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
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return HeadOption(chunks, chunked, _head_time(head, labels, chunks, softcap, repeats))


def _head_time(head: nn.Linear, labels: torch.Tensor, chunks: int, softcap: float | None, repeats: int) -> float:
    """Device seconds the chunked head adds to a step: its forward and backward on the profiled shapes less the
    unchunked head's, the median over rounds of each round's difference.  Never below zero: where the chunked head
    is the faster (on the CPU, a large vocabulary's logits cost more to write than to compute again) it is priced
    as free, so that plans do not follow a saving within the timings' noise.

    Kept in the machine's timings file (:mod:`~remat.planning.measure.timecache`) like the blocks' times, so whether
    a plan takes the chunked head does not follow the load from one process to the next; used while the unchunked
    head timed now is within the stale slack of the time kept with it, and written only when its rounds were
    steady."""
    device = head.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(labels.numel(), head.in_features, generator=gen, device=device, dtype=head.weight.dtype,
                         requires_grad=True)
    leaves = [hidden, *(p.detach().requires_grad_() for p in (head.weight, head.bias) if p is not None)]
    weight, bias = leaves[1], (leaves[2] if len(leaves) > 2 else None)
    targets = shift_labels(labels).reshape(-1)
    clock = Clock(str(device))

    def unchunked() -> None:
        logits = F.linear(hidden, weight, bias)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        F.cross_entropy(logits.float(), targets).backward()

    def chunked() -> None:
        chunked_lm_loss(hidden, weight, targets, bias, chunks=chunks, softcap=softcap, shift=False).backward()

    def seconds(step: Callable[[], None]) -> float:
        for leaf in leaves:
            leaf.grad = None
        return clock.time(step)[1]

    key = (f"{labels.numel()}x{head.in_features}->{head.out_features}|{head.weight.dtype}|bias={bias is not None}|"
           f"chunks={chunks}|softcap={softcap}")
    with timings_cache() as cache:
        kept = cache.get("head", key, str(device))
        slack = stale_slack(kept["spread"]) if kept is not None else 0.0
        if kept is not None and slack == float("inf"):  # never stale: nothing to time
            return kept["seconds"]
        seconds(unchunked), seconds(chunked)  # warm-up
        if kept is not None and agrees(kept["plain"], seconds(unchunked), slack):
            return kept["seconds"]
        rounds = [(seconds(unchunked), seconds(chunked)) for _ in range(max(1, repeats))]  # back to back, one load
        plain = [p for p, _ in rounds]
        extra = max(0.0, statistics.median(c - p for p, c in rounds))
        if spread_of(plain) <= unsteady_limit():
            cache.put("head", key, str(device),
                      {"seconds": extra, "plain": statistics.median(plain), "spread": spread_of(plain)})
    return extra


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

    return min(_on_both(prof, head, budget, solve), key=quiet_first)


def alternatives_with_head(prof: StepProfile, head: HeadOption | None, budget: Budget | int | float | str,
                           count: int, allow: Sequence[str] = DEFAULT_ALLOW) -> list[Plan]:
    """Up to ``count`` distinct plans that fit ``budget``, without and with the chunked head, cheapest predicted
    first among those that send no collective again, then the others
    (:func:`~remat.planning.solve.alternatives.plans_near` on each timeline).

    Example:
        >>> plans = alternatives_with_head(prof, prof.head, "20%", count=3)
    """
    found = _on_both(prof, head, budget, lambda profile, whole: plans_near(profile, whole, count, allow))
    return distinct_plans(sorted(found, key=quiet_first))[:count]


def price_with_head(prof: StepProfile, head: HeadOption | None, decisions: Mapping[str, str],
                    segments: Sequence[Sequence[str]] = ()) -> Plan:
    """The plan of ``decisions`` and ``segments`` (as :func:`~remat.planning.solve.alternatives.plan_for`) with the
    output layer and loss in ``head.chunks`` chunks: priced on the chunked head's timeline, its time added.

    Example:
        >>> price_with_head(prof, prof.head, {"model.layers.0": "checkpoint"}).head_chunks
        12
    """
    if head is None:
        raise ValueError("remat.Profile.price: this profile has no chunked head to price (a Hugging Face causal LM "
                         "profiled on real tensors with labels= and its own loss has one); call price without "
                         "head=True.")
    return _chunked(plan_for(head.profile, decisions, segments), prof, head)


def _chunked(plan: Plan, prof: StepProfile, head: HeadOption) -> Plan:
    """``plan``, made on the chunked head's timeline, as a plan of ``prof``'s step with that head."""
    plan.head_chunks = head.chunks
    plan.predicted_extra_time += head.extra_time
    plan.baseline_peak = prof.peak_bytes
    return plan


def _on_both(prof: StepProfile, head: HeadOption | None, budget: Budget | int | float | str,
             solve: Callable[[StepProfile, Budget], list[Plan]]) -> list[Plan]:
    """The plans ``solve`` makes on the step's timeline and on the chunked head's, the budget read against the
    step without a plan; refused only when neither timeline fits it."""
    fixed = prof.param_bytes + prof.buffer_bytes
    parsed = budget_on_device(parse_budget(budget), prof.device, fixed)
    budget_bytes = parsed.bytes_for(fixed, prof.peak_above_params)
    found, refusals = [], []
    for profile, option in ((prof, None), *(((head.profile, head),) if head is not None else ())):
        try:
            # the chunked head's timeline is given the bytes the budget comes to on the step without a plan
            made = solve(profile, parsed if option is None else Budget(nbytes=budget_bytes))
        except InfeasibleBudget as refusal:
            refusals.append(refusal)
            continue
        found.extend(made if option is None else [_chunked(plan, prof, option) for plan in made])
    if found:
        return found
    lowest = min(refusals, key=lambda refusal: refusal.smallest)
    if lowest is refusals[0]:  # the step's own refusal says it all, its reasons included
        raise refusals[0]
    # one smallest peak, the lower: the step's own refusal, which states the higher, is not chained
    requested = parsed.fraction if parsed.fraction is not None else parsed.text or None
    raise InfeasibleBudget(budget_bytes, lowest.smallest, fixed, prof.peak_above_params, requested,
                           **lowest.reasons) from None
