"""Profiling leaves the model as it found it: buffers, gradients and random number generators.

A profile runs the model's training steps many times over (timed steps, an instrumented step, timed runs of
every block).  Each forward of a module in training mode may write its state: batch norm's running statistics
and ``num_batches_tracked``, spectral norm's vectors, a buffer a forward replaces.  Profiling a trained model
must not cost it its statistics, so :func:`left_as_found` puts back, after the body, every buffer the body
wrote or replaced, every parameter's ``.grad``, and the CPU's and the model's accelerators' RNG states.  An
FSDP2 model is left sharded: a forward without a backward leaves a unit that keeps its parameters gathered
(``reshard_after_forward=False``) holding copies the next optimizer step would leave stale.

Parameters need no copy: nothing in a profile steps an optimizer, and autograd refuses in-place writes to a
parameter that requires grad.

Example:
    >>> with left_as_found(model):
    ...     model(x).sum().backward()      # batch norm statistics and .grad are back as they were after
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...engine.buffers import RegionBuffers
from .ranks import reshard

__all__ = ["left_as_found"]


@contextlib.contextmanager
def left_as_found(model: nn.Module) -> Iterator[None]:
    """Run the body, then put back ``model``'s buffers, its parameters' gradients and the RNG states as the
    body found them (also when it raises).

    Example:
        >>> with left_as_found(model):
        ...     remat.planning.measure.profile.measure(model, (x,), {}, blocks, loss_fn, None, 100e12, 3)
    """
    slots = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    values = RegionBuffers.before_forward(model)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    devices = sorted({t.get_device() for t in params if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for module, name, buffer in slots:  # a forward that assigned a new tensor to a buffer's name
            module._buffers[name] = buffer
        if values is not None:
            values.after_forward()
            values.restore()
        for p, g in zip(params, grads):
            p.grad = g
        reshard(model)
