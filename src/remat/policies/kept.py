"""Outputs a policy keeps from forward, and how recomputation is served them.

A kept output is an alias of the op's output (sharing its version counter, so in-place changes after
forward are seen), or a copy for in-place random ops, optionally offloaded to host memory.  A kept random
op also carries its generator's state right after it ran, so the ops rerun after it draw as in forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .decisions import _RANDOM_WRITE, _traits, _written_argument
from .hostcopy import engine_for

__all__: list[str] = []  # the selective engine's machinery, nothing public


class _Kept:
    """A kept tensor: an alias of the op's output (or a copy of it), its device and version then.

    ``copy=True`` keeps a private copy, for a value whose storage the region overwrites later; nothing else
    can reach the copy, so it never counts as modified.  Offloaded (where the device's copy engine moves
    tensors), the value goes to host memory on the engine's side stream: the alias stays until the region's
    forward ends, to tell whether the region changed it in place while it was being copied (then it is
    recomputed, like any kept output the region modifies), and :func:`_settle` makes the device wait for the
    copies before anything after the region can write to them.
    """

    __slots__ = ("value", "device", "version", "offloaded", "stashed", "nbytes")

    def __init__(self, output: torch.Tensor, offload: bool, copy: bool = False) -> None:
        value = _alias(output)
        if copy:
            value = value.clone()
        engine = engine_for(value.device.type) if offload else None
        self.stashed = engine.stash(value) if engine is not None and engine.moves else None
        if self.stashed is not None and copy:
            value = None  # the private copy is on its way to the host; nothing can change it
        self.value = value
        self.device = output.device
        self.version = value._version if value is not None else 0
        self.offloaded = offload
        self.nbytes = output.numel() * output.element_size()

    def modified(self) -> bool:
        return self.value is not None and self.value._version != self.version

    def serve(self, take: bool) -> torch.Tensor:
        if self.stashed is not None:
            # No prefetch beyond the region: its recomputation already started copying back all it will be
            # served, and fetching ahead per served output would bring back earlier regions' outputs (newest
            # first, the last their recomputations need) and hold them on the device until then.
            value = self.stashed.engine.fetch(self.stashed)
            if take:
                self.stashed = None  # its host block goes back to the pool
            return value
        # A taken value is no longer held here, so it can be handed out as is.
        return self.value if take else _alias(self.value)

    def tensors(self) -> list[_Kept]:
        return [self]


class _KeptOutputs:
    """The kept outputs of a multi-output op, served whole (e.g. attention with its log-sum-exp)."""

    __slots__ = ("structure",)

    def __init__(self, outputs: Any, offload: bool) -> None:
        self.structure = tree_map(lambda t: _Kept(t, offload) if isinstance(t, torch.Tensor) else t, outputs)

    @classmethod
    def of(cls, structure: Any) -> _KeptOutputs:
        """Outputs already kept one by one (``structure`` holds :class:`_Kept` leaves)."""
        kept = cls.__new__(cls)
        kept.structure = structure
        return kept

    def tensors(self) -> list[_Kept]:
        found: list[_Kept] = []
        tree_map(lambda k: found.append(k) if isinstance(k, _Kept) else None, self.structure)
        return found

    def modified(self) -> bool:
        return any(k.modified() for k in self.tensors())

    def serve(self, take: bool) -> Any:
        return tree_map(lambda k: k.serve(take) if isinstance(k, _Kept) else k, self.structure)


def _settle(stashed: list[_Kept]) -> None:
    """A region's forward has ended: the device waits for its copies out before anything after the region
    runs (which could write to what is being copied), and the device values are let go."""
    for engine in dict.fromkeys(k.stashed.engine for k in stashed):
        engine.fence(k.stashed for k in stashed if k.stashed.engine is engine)
    for kept in stashed:
        kept.value = None


def _prefetch(stashed: list[_Kept]) -> None:
    """A recomputation starts: copy back what it will be served, in the order forward kept it."""
    handles = sorted((k.stashed for k in stashed), key=lambda handle: handle.order)
    for engine in dict.fromkeys(handle.engine for handle in handles):
        engine.prefetch(handle for handle in handles if handle.engine is engine)


def _unprefetch(stashed: list[_Kept]) -> None:
    """A recomputation ended (maybe early): device copies it was not served are let go."""
    for kept in stashed:
        if kept.stashed is not None:
            kept.stashed.on_device = None


def _keep(outputs: Any, offload: bool) -> _Kept | _KeptOutputs:
    if isinstance(outputs, torch.Tensor):
        return _Kept(outputs, offload)
    return _KeptOutputs(outputs, offload)


def _alias(t: torch.Tensor) -> torch.Tensor:
    # Inside a dispatch mode we run below ADInplaceOrView, where detach() would
    # get a fresh version counter; re-enable the key so the alias shares it
    # and in-place changes to the original stay visible.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _argument(args: tuple, kwargs: dict, where: tuple[int, str]) -> Any:
    position, name = where
    return args[position] if position < len(args) else kwargs[name]


def _generator(kwargs: dict, device: torch.device) -> torch.Generator | None:
    """The generator a random op drew from: its ``generator=``, else its device's default (CPU or CUDA only)."""
    generator = kwargs.get("generator")
    if generator is not None:
        return generator
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


class _Draw:
    """A kept random op: its kept output (for an in-place op, a copy of what it wrote) and its generator's
    state right after it ran in forward."""

    __slots__ = ("kept", "generator", "state", "target")

    def __init__(self, kept: _Kept | _KeptOutputs, generator: torch.Generator, target: tuple[int, str] | None):
        self.kept = kept
        self.generator = generator
        self.state = generator.get_state()
        self.target = target  # where the in-place op's written argument is, or None for an out-of-place op

    def modified(self) -> bool:
        return self.kept.modified()

    def tensors(self) -> list[_Kept]:
        return self.kept.tensors()

    def serve(self, take: bool, args: tuple, kwargs: dict) -> Any:
        """What the op returns, without drawing; the generator is left as the op left it in forward."""
        self.generator.set_state(self.state)
        if self.target is None:
            return self.kept.serve(take)
        # Below autograd and ADInplaceOrView, like the op itself: the copy neither records nor bumps versions.
        target = _argument(args, kwargs, self.target)
        return target.copy_(self.kept.serve(take))


def _keep_draw(op: Any, args: tuple, kwargs: dict, out: Any, offload: bool) -> _Draw | _Kept | _KeptOutputs | None:
    """Keep a random op's output with its generator's state; None if it cannot be kept (rerun instead)."""
    target = _written_argument(op) if _traits(op) & _RANDOM_WRITE else None
    first = out if isinstance(out, torch.Tensor) else next(
        (t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
    generator = _generator(kwargs, first.device) if first is not None else None
    if target is not None:
        if generator is None:
            return None
        return _Draw(_Kept(_argument(args, kwargs, target), offload, copy=True), generator, target)
    kept = _keep(out, offload)
    # Without a generator to restore the replay reruns the op for its RNG advance and serves this.
    return kept if generator is None else _Draw(kept, generator, None)
