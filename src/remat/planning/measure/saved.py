"""What the op recorder's and the timed runs' saved-tensor hooks keep of what autograd saves.

* :class:`Held` keeps every saved tensor in a list, the graph storing only its position: the tensors live as
  long as they would in the graph, until ``clear()``.  A pack hook must not return the tensor itself here:
  where autograd saves an op's own output (softmax, exp), the graph node would hold a tensor whose ``grad_fn``
  is that node, a cycle through autograd's C++ side that Python's gc cannot see, and everything the graph
  saved before it would outlive the forward.
* :class:`Unheld` keeps nothing: the graph stores a weak reference, so a storage dies when the block's code
  lets go of it, as in a checkpointed forward, and the recorder sees when the code is done with each.  A
  backward inside the forward (a block that calls ``torch.autograd.grad`` on its own activations) that needs a
  tensor the code let go of raises :class:`SavedTensorGone`: the forward is then recorded again under
  :class:`Held`, where the tensors live as the graph keeps them.

Example:
    >>> held = Held()
    >>> with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
    ...     y = torch.randn(4, requires_grad=True).exp()
    >>> len(held.tensors)
    1
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["Held", "SavedTensorGone", "Unheld"]


class SavedTensorGone(RuntimeError):
    """A backward inside the recorded forward needed a saved tensor the code had let go of."""


class Held:
    """Saved-tensor hooks that keep what autograd saves in a list (see the module docstring)."""

    __slots__ = ("tensors",)

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> int:
        self.tensors.append(t)
        return len(self.tensors) - 1

    def unpack(self, index: int) -> torch.Tensor:
        return self.tensors[index]

    def clear(self) -> None:
        self.tensors.clear()

    def after(self, observe: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], int]:
        """A pack hook that calls ``observe(t)`` first."""
        def pack(t: torch.Tensor) -> int:
            observe(t)
            return self.pack(t)

        return pack


class Unheld:
    """Saved-tensor hooks that keep only weak references (see the module docstring)."""

    @staticmethod
    def after(observe: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], weakref.ref]:
        """A pack hook that calls ``observe(t)`` first."""
        def pack(t: torch.Tensor) -> weakref.ref:
            observe(t)
            return weakref.ref(t)

        return pack

    @staticmethod
    def unpack(ref: weakref.ref) -> torch.Tensor:
        t = ref()
        if t is None:
            raise SavedTensorGone("a backward inside the forward needs a saved tensor its code let go of")
        return t
