"""The planning front door: profile a model, plan for a budget.

:func:`profile` measures one training step (memory timeline, per-block prices, op graphs) and returns a
:class:`Profile`, whose :meth:`Profile.plan` solves for any budget without measuring again; :func:`plan`
does both in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from ..api.modules import ActivationWrapper
from .options import DEFAULT_ALLOW
from .plan import Plan
from .profile import StepProfile, default_loss, measure, resolve_blocks
from .solver import plan_from_profile

__all__ = ["Profile", "plan", "profile"]


class Profile(StepProfile):
    """The result of :func:`profile`: what one step keeps per block, and the prices of each option.

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)
        >>> print(prof); plan = prof.plan("50%")
    """

    def plan(self, budget: int | float | str, allow: Sequence[str] | None = None) -> Plan:
        """The cheapest plan for ``budget`` from this profile: no new measurement, milliseconds.

        ``allow``: the options a block may take besides ``keep`` (default: all of them, see :func:`remat.plan`).

        Example:
            >>> prof = remat.profile(model, input_ids=ids, labels=ids)
            >>> plans = {b: prof.plan(b) for b in (0.3, 0.5, 0.7)}
        """
        return plan_from_profile(self, budget) if allow is None else plan_from_profile(self, budget, allow)


def profile(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    modules: Sequence[str] | None = None,
    device: str | None = None,
    throughput: float = 100e12,
    repeats: int = 5,
    ops: bool = True,
    **example_kwargs: Any,
) -> Profile:
    """Profile training steps of ``model(*example_inputs, **example_kwargs)`` (no checkpointing).

    ``loss_fn(output)`` turns the output into a scalar (default: the output's ``.loss``, as Hugging Face
    models return when given ``labels=``, or the sum of its floating tensors).  Gradients are left as they
    were before the call.  Times are on the device's clock, medians over ``repeats`` rounds, and every
    option is priced from each block's op graph (:func:`remat.profile_ops`); ``ops=True`` keeps the graphs
    in ``.ops``, from which plans draw their op-level ``selective`` options.

    ``device="meta"`` profiles without allocating: build the model and the inputs on the meta device
    (``with torch.device("meta"): model = ...``); bytes are exact, times are FLOPs
    (``torch.utils.flop_counter``) divided by ``throughput`` (FLOP/s of the target accelerator).

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)       # a Hugging Face model
        >>> prof = remat.profile(gpt, tokens, loss_fn=lambda logits: ...)
        >>> print(prof); plan = prof.plan(0.5)
    """
    if device not in (None, "meta"):
        raise ValueError(f"remat.profile: device must be None (the model's own) or 'meta', got {device!r}.")
    if repeats < 1:
        raise ValueError(f"remat.profile: repeats must be at least 1, got {repeats}.")
    blocks = resolve_blocks(model, modules)
    measured = measure(model, example_inputs, example_kwargs, blocks, loss_fn or default_loss, device, throughput,
                       repeats)
    result = Profile(**{f.name: getattr(measured, f.name) for f in fields(measured)})
    if not ops:  # the op graphs priced the options; kept only when plans may draw selective options from them
        result.ops = None
    return result


def plan(
    model: nn.Module,
    *example_inputs: Any,
    budget: int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    allow: Sequence[str] = DEFAULT_ALLOW,
    modules: Sequence[str] | None = None,
    **example_kwargs: Any,
) -> Plan:
    """Profile ``model(*example_inputs, **example_kwargs)`` and return the cheapest :class:`Plan` that fits.

    ``budget``: bytes, a size string (``"8GiB"``, ``"512MB"``) for the whole peak, or a fraction (``0.5``)
    of the unplanned step's peak above the parameters.  ``allow`` lists the options a block may take
    besides ``keep``: ``checkpoint``, ``save_matmuls``, ``selective`` (op-level: keep chosen op outputs of
    the block, recompute the rest; needs one more forward to record the op graphs) and ``offload`` (only
    considered on an accelerator).  For several budgets, profile once and call ``prof.plan(budget)`` for each.

    Example:
        >>> p = remat.plan(model, input_ids=ids, labels=ids, budget=0.5)   # Hugging Face: .loss is the loss
        >>> print(p)
        >>> p.apply(model)
    """
    if any(isinstance(m, ActivationWrapper) for m in model.modules()):
        raise ValueError("remat.plan: the model already has checkpoint/offload wrappers; remove them first "
                         "(plan.remove(model)) so the profile sees the step without checkpointing.")
    prof = profile(model, *example_inputs, loss_fn=loss_fn, modules=modules, ops="selective" in allow,
                       **example_kwargs)
    return plan_from_profile(prof, budget, allow)
