"""What a program (:mod:`.program`) needs to know of a recorded region's random ops: whether each draws on
from where the one before it left its generator.

A program reruns a region's random ops with the RNG put where it was when the region started, each needed
draw with every draw before it, so each draws what it drew in forward.  That holds only where nothing in the
region seeds or sets a generator between draws, and each op draws from a generator the replay restores (the
CPU's or a CUDA device's default): :class:`_RngWatch` checks both while the recording forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__: list[str] = []


class _RngWatch:
    """While recording: whether each random op draws on from where the one before it left its generator
    (nothing in the region seeds or sets it), from the state the region started with for the first."""

    def __init__(self) -> None:
        self.last: dict[Any, torch.Tensor] = {}  # generator -> its state after the last draw (or at the start)
        self.last[torch.default_generator] = torch.default_generator.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for generator in torch.cuda.default_generators:
                self.last[generator] = generator.get_state()

    def check(self, op: Any, args: tuple, kwargs: dict) -> str | None:
        generator = self._generator(args, kwargs)
        if generator is None:
            return f"{op} draws from a generator the replay does not restore"
        before = self.last.get(generator)
        if before is None or not torch.equal(before, generator.get_state()):
            return f"the region sets the RNG before {op} draws"
        return None

    def drew(self, args: tuple, kwargs: dict) -> None:
        generator = self._generator(args, kwargs)
        if generator is not None:
            self.last[generator] = generator.get_state()

    @staticmethod
    def _generator(args: tuple, kwargs: dict) -> Any:
        """The default generator a random op draws from; None for an explicit one or another device's."""
        if kwargs.get("generator") is not None:
            return None
        tensor = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None)
        device = tensor.device if tensor is not None else torch.device(kwargs.get("device") or "cpu")
        if device.type == "cpu":
            return torch.default_generator
        if device.type == "cuda":
            return torch.cuda.default_generators[device.index if device.index is not None else
                                                 torch.cuda.current_device()]
        return None
