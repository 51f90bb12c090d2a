"""Module state a region changes in forward: as forward found it when the region reruns, as forward left it after.

A checkpointed region runs twice.  A module that updates a buffer in place in forward would otherwise update
it a second time in the recomputation, from the value forward already changed:

* BatchNorm's running statistics and ``num_batches_tracked`` would be updated once per recomputation too;
* spectral norm's power iteration (``u`` and ``v``) would start from the vectors forward already advanced, so
  the recomputed weight, and every gradient through it, would differ from plain autograd's.

:class:`RegionBuffers` copies the buffers of the modules a region is given before its forward runs, keeps the
copies of those the forward wrote (their version counter moved, or they are a training normalization layer's
running statistics, which its kernel writes without moving it), and around each recomputation puts those
buffers back as forward found them, then as they were before the recomputation.

Which modules: the region's function when it is a module, a bound method of one (``layer.forward``), or a
``functools.partial`` or ``__wrapped__`` chain around either (what wrappers and Hugging Face's layers pass).
Buffers of modules a plain function reaches through its closure are not seen; such a region reruns as
torch's checkpoint reruns it.

Example:
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> buffers = RegionBuffers.before_forward(bn)
    >>> y = bn(torch.randn(8, 4))
    >>> buffers.after_forward()
    >>> with buffers.as_forward_found():     # running statistics as before the forward, during the rerun
    ...     _ = bn(torch.randn(8, 4))
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["RegionBuffers", "region_modules"]

_python_dispatch_off = torch._C._DisableTorchDispatch


def region_modules(fn: Any) -> list[nn.Module]:
    """The modules a region's function is, or is a bound method, partial or ``__wrapped__`` of.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> region_modules(functools.partial(layer.forward)) == [layer]
        True
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    pending = [fn]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, nn.Module):
            found.append(item)
        elif isinstance(item, functools.partial):
            pending.append(item.func)
        else:
            pending.append(getattr(item, "__self__", None))
            pending.append(getattr(item, "__wrapped__", None))
    return found


class RegionBuffers:
    """The buffers one region's forward wrote, with their values from before it (see the module docstring)."""

    __slots__ = ("buffers", "copies", "versions", "norms")

    def __init__(self, buffers: list[torch.Tensor], norms: list[_NormBase]) -> None:
        self.buffers = buffers
        self.versions = [b._version for b in buffers]
        self.norms = norms
        with _python_dispatch_off(), torch.no_grad():
            self.copies = [b.clone() for b in buffers]

    @classmethod
    def before_forward(cls, fn: Any) -> RegionBuffers | None:
        """Copy the buffers of ``fn``'s modules before its forward; None where it has none."""
        modules = region_modules(fn)
        if not modules:
            return None
        buffers: dict[int, torch.Tensor] = {}
        norms: dict[int, _NormBase] = {}
        for root in modules:
            for module in root.modules():
                for buffer in module._buffers.values():
                    if buffer is not None and not buffer.is_meta:
                        buffers.setdefault(id(buffer), buffer)
                if isinstance(module, _NormBase):
                    norms.setdefault(id(module), module)
        if not buffers:
            return None
        return cls(list(buffers.values()), list(norms.values()))

    def after_forward(self) -> None:
        """Keep the copies of the buffers this forward wrote; let the others go."""
        # The statistics a training normalization layer's kernel writes without moving their version counters.
        running = {id(t) for norm in self.norms if norm.training and norm.track_running_stats
                   for t in (norm.running_mean, norm.running_var) if t is not None}
        kept = [(b, c) for b, c, v in zip(self.buffers, self.copies, self.versions)
                if b._version != v or id(b) in running]
        self.buffers, self.copies = [b for b, _ in kept], [c for _, c in kept]
        self.versions, self.norms = [], []

    @property
    def written(self) -> bool:
        """Whether the forward wrote any of the buffers (after :meth:`after_forward`)."""
        return bool(self.buffers)

    def restore(self) -> None:
        """Put the written buffers back as forward found them, for good (after :meth:`after_forward`)."""
        with _python_dispatch_off(), torch.no_grad():
            for buffer, copy in zip(self.buffers, self.copies):
                buffer.copy_(copy)

    @contextlib.contextmanager
    def as_forward_found(self) -> Iterator[None]:
        """Run the body (a recomputation) with the written buffers as forward found them; put back after it
        what they held before it."""
        with _python_dispatch_off(), torch.no_grad():
            now = [b.clone() for b in self.buffers]
            for buffer, copy in zip(self.buffers, self.copies):
                # Through .data: the version counter stays put, so nothing autograd saved from the buffer in
                # forward reads as modified.
                buffer.data.copy_(copy)
        try:
            yield
        finally:
            with _python_dispatch_off(), torch.no_grad():
                for buffer, value in zip(self.buffers, now):
                    buffer.data.copy_(value)
