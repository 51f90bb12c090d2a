"""The reentrant variant: one autograd.Function that reruns the region inside backward.

Forward runs the function under ``no_grad`` (nothing inside is recorded) and
saves only its inputs.  Backward reruns it with grad enabled, under the
forward's RNG and autocast state, and back-propagates the incoming gradients
through that fresh graph: autograd is *re-entered* from inside a backward.

Limits, inherited from the design: only ``.backward()`` without ``inputs=``
(not ``torch.autograd.grad``), positional tensor arguments only, and at least
one output must require grad.  Prefer the non-reentrant variant.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .replay import ReplayState

__all__ = ["CheckpointFunction", "check_backward_validity", "detach_variable"]


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach every tensor of a tuple, keeping its ``requires_grad`` flag.

    Example:
        >>> x = torch.ones(2, requires_grad=True) * 2
        >>> (y,) = detach_variable((x,))
        >>> y.grad_fn is None, y.requires_grad
        (True, True)
    """
    if not isinstance(inputs, tuple):
        raise RuntimeError(f"detach_variable expects a tuple, got {type(inputs).__name__}.")
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            requires_grad = value.requires_grad
            value = value.detach()
            value.requires_grad_(requires_grad)
        detached.append(value)
    return tuple(detached)


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor input requires grad (the reentrant variant then gives no gradients).

    Example:
        >>> check_backward_validity([torch.ones(1, requires_grad=True)])
    """
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        warnings.warn(
            "remat: none of the inputs of this reentrant checkpoint requires grad, so its parameters "
            "get no gradients. Use use_reentrant=False (the default), which does not need that.",
            stacklevel=3,
        )


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint as an autograd.Function.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> CheckpointFunction.apply(lin, True, x).sum().backward()
    """

    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, *args):
        check_backward_validity(args)
        ctx.run_function = run_function
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.replay_state = ReplayState.capture(tensors, preserve_rng_state, run_function)
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.replay_state.forward_done()
        if preserve_rng_state:
            ctx.replay_state.check_device_not_initialized_by("a reentrant checkpointed function")
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "remat: the reentrant checkpoint (use_reentrant=True) only supports .backward() "
                "without inputs=; torch.autograd.grad and backward(inputs=...) need "
                "use_reentrant=False."
            )
        args = list(ctx.other_args)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors):
            args[position] = tensor
        with ctx.replay_state.replay():
            inputs = detach_variable(tuple(args))
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                "remat: no output of the reentrant checkpointed function requires grad, so there is "
                "nothing to back-propagate; checkpointing it is unnecessary."
            )
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return (None, None) + tuple(x.grad if isinstance(x, torch.Tensor) else None for x in inputs)
