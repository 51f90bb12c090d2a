"""The optimizers remat trains with, by name: in :func:`~remat.planning.check.check_plan`, the demo and the
benchmarks.

A training loop runs an optimizer step between two forward-backward steps: it writes every parameter in
place (moving its version counter) and holds the optimizer's state from its first call on.  The benchmarks
run one between timed steps so that what they time is what a training loop runs; they leave the optimizer's
own time out of the timed span, as it is the same under every checkpointing mode and plans price forward and
backward only.

torch is imported only when an optimizer is made, so that the ``remat`` command can offer the names without
it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("adamw", "sgd", "adamw-fused")
"""The names :func:`make_optimizer` knows."""


def make_optimizer(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``params``.

    ``adamw``: AdamW, lr 1e-3, ``foreach=True`` (torch's default on accelerators; on the CPU its default is
    the loop over parameters); ``sgd``: SGD, lr 1e-2, momentum 0.9 (its momentum buffers are state, as
    AdamW's moments are); ``adamw-fused``: AdamW, lr 1e-3, with its fused kernel.  A tensor-parallel model's
    DTensor parameters and its plain ones go in two groups of the same settings: torch's foreach and fused
    kernels refuse a list that mixes them, and each parameter's update is the same in either grouping.

    Example:
        >>> opt = make_optimizer("adamw", model.parameters())
        >>> loss.backward(); opt.step()
    """
    import torch

    params = _groups(list(params))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def _groups(params: list[torch.Tensor]) -> list[torch.Tensor] | list[dict[str, list[torch.Tensor]]]:
    """``params``, or where DTensors and plain tensors mix, one group of each (in the order given)."""
    import torch.distributed as dist

    if not dist.is_available():  # no DTensor in this build
        return params
    from torch.distributed.tensor import DTensor

    distributed = [p for p in params if isinstance(p, DTensor)]
    if not distributed or len(distributed) == len(params):
        return params
    return [{"params": distributed}, {"params": [p for p in params if not isinstance(p, DTensor)]}]
