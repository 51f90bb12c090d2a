"""The inputs a plan was made at: their shapes, recorded in the plan and checked on the model's first forward.

A plan's predicted peak and extra time hold for the shapes it was profiled at: activation bytes scale with
batch and sequence length.  :func:`describe_inputs` records the shapes (``plan.meta["inputs"]``);
:func:`watch_first_forward` makes a planned model's first forward compare its inputs with them and warn once
(:class:`InputShapeWarning`) when they differ.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ...api.chunkedhead import lm_head_probing
from .userline import user_stacklevel

__all__ = ["InputShapeWarning", "describe_inputs", "input_mismatch", "unwatch", "watch_first_forward"]

_EXPECTED = "_remat_planned_inputs"
_HOOK = "_remat_inputs_hook"


class InputShapeWarning(UserWarning):
    """A planned model runs on inputs of other shapes than its plan was profiled on: the plan's predicted
    peak and time do not hold there.

    Example:
        >>> warnings.simplefilter("error", remat.InputShapeWarning)   # make it an error in a training script
    """


def describe_inputs(args: tuple, kwargs: dict[str, Any]) -> dict[str, str]:
    """The shape of each tensor among a call's inputs, by where it was passed (``"arg 0"``, ``"input_ids"``,
    ``"batch['x']"``), as ``"8x128"``.  Plain data for :attr:`Plan.meta`.

    Example:
        >>> describe_inputs((torch.zeros(8, 128),), {"mask": torch.ones(8, 128), "scale": 2.0})
        {'arg 0': '8x128', 'mask': '8x128'}
    """
    found: dict[str, str] = {}
    for index, value in enumerate(args):
        _walk(f"arg {index}", value, found)
    for name, value in kwargs.items():
        _walk(name, value, found)
    return found


def _walk(where: str, value: Any, found: dict[str, str], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        found[where] = "x".join(map(str, value.shape)) or "scalar"
    elif depth < 3 and isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _walk(f"{where}[{index}]", item, found, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for key, item in value.items():
            _walk(f"{where}[{key!r}]", item, found, depth + 1)


def input_mismatch(planned: dict[str, str], seen: dict[str, str]) -> str:
    """The first input whose shape differs from the plan's, as a phrase ('' if none differs).

    Inputs passed under the same names are compared by name; when no name is shared (profiled with
    keywords, run positionally), the tensors are compared in order.

    Example:
        >>> input_mismatch({"input_ids": "2x64"}, {"input_ids": "2x256"})
        'input_ids 2x256 (the plan was made at 2x64)'
    """
    shared = [name for name in seen if name in planned]
    pairs = [(name, planned[name], seen[name]) for name in shared] if shared else \
        [(name, was, now) for (_, was), (name, now) in zip(planned.items(), seen.items())]
    for name, was, now in pairs:
        if was != now:
            return f"{name} {now} (the plan was made at {was})"
    return ""


def watch_first_forward(model: nn.Module, planned: dict[str, str]) -> None:
    """On ``model``'s next forward, warn once (:class:`InputShapeWarning`) if its inputs' shapes differ from
    ``planned``; the check then removes itself.  Calling it again replaces the pending check.  Forwards traced
    by torch.compile skip it (it runs at the next eager forward).

    Example:
        >>> watch_first_forward(model, plan.meta["inputs"])   # Plan.apply does this
    """
    unwatch(model)
    # Kept on the model, read by a module-level hook: a planned model still deep-copies and pickles.
    model.__dict__[_EXPECTED] = dict(planned)
    model.__dict__[_HOOK] = model.register_forward_pre_hook(_check_first_forward, with_kwargs=True)


def unwatch(model: nn.Module) -> None:
    """Drop a pending :func:`watch_first_forward` check.

    Example:
        >>> unwatch(model)   # Plan.remove does this
    """
    handle = model.__dict__.pop(_HOOK, None)
    if handle is not None:
        handle.remove()
    model.__dict__.pop(_EXPECTED, None)


def _check_first_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():  # a traced hook's removal and warning would not happen: leave compiled code be
        return
    if lm_head_probing(module):  # chunk_lm_head's probe on a small cut of a call: not the user's first forward
        return
    planned = module.__dict__.get(_EXPECTED)
    unwatch(module)
    problem = input_mismatch(planned or {}, describe_inputs(args, kwargs))
    if problem:
        warnings.warn(InputShapeWarning(
            f"remat.Plan: {type(module).__name__} runs on {problem}, so the plan's predicted peak and extra time do "
            "not hold (activation memory scales with batch and sequence length); plan again at this shape."),
            stacklevel=user_stacklevel())
