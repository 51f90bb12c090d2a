"""Hooks that run a plan's copy schedule on its blocks: bound the copies in flight where a block starts or ends.

A plan whose blocks move bytes to host memory (:mod:`remat.planning.solve.copyplan`) bounds their copies at block
boundaries (its kept blocks' copies out run with no window limit), to the bytes its peak counted there.
:func:`schedule_hooks` installs that on one block: before its forward, the host waits until the copies in flight are
within ``before`` bytes (:meth:`~remat.policies.hostcopy.HostCopies.drain`); after it, within ``after`` bytes.
Neither acts in a recomputation (it runs in backward), without grad (nothing is saved), or while dynamo traces.

Example:
    >>> handles = schedule_hooks(model.layers[3], "cuda", before=64 << 20)
    >>> for handle in handles: handle.remove()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hostcopy import engine_for

__all__ = ["schedule_hooks"]


def schedule_hooks(module: nn.Module, device: str, before: int | None = None, after: int | None = None
                   ) -> list[RemovableHandle]:
    """Install a block's part of a copy schedule (see the module docstring); the handles remove it.

    Example:
        >>> handles = schedule_hooks(model.layers[-1], "cuda", after=0)  # every copy out complete before the loss
    """
    engine = engine_for(device.split(":")[0])
    if engine is None:
        return []
    handles = []
    if before is not None:
        def drain_before(module: nn.Module, args: Any) -> None:
            if _in_forward():
                engine.drain(before)

        handles.append(module.register_forward_pre_hook(drain_before))
    if after is not None:
        def drain_after(module: nn.Module, args: Any, output: Any) -> None:
            if _in_forward():
                engine.drain(after)

        handles.append(module.register_forward_hook(drain_after))
    return handles


def _in_forward() -> bool:
    return (torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and not torch.compiler.is_compiling())
