"""In-place ops in programs (:mod:`.program`): which a program may rerun, and what each step must run after.

Dropout's mask on the CPU (``empty_like``, then ``bernoulli_`` and ``div_`` in place), an in-place ReLU on a
normalization's output, a residual ``add_`` and ``masked_fill_`` on attention scores all write memory the
region made.  Rerunning such a write on the memory the rerun made gives what forward computed, so it becomes
a step like any other: its output is the tensor it wrote, and later reads of that tensor refer to it.  A read
through another tensor on the same memory (a slice taken before the write) refers to the step that made that
view, so each step also names the last in-place write to every memory it reads (``after``), and the plan
runs that write before it, as forward did.

A region gets no program where rerunning a write could differ from forward:

- the memory is not the region's: an input, a parameter or buffer (BatchNorm's ``num_batches_tracked``),
  another tensor from outside, or a view of one; a rerun would write it a second time;
- the op writes an argument other than the ``self`` it returns (``out=``, several), or changes a tensor's
  shape or memory rather than its values (``resize_``, ``set_``, ``t_``: tagged ``inplace_view``);
- autograd saved a tensor on that memory before the write: a refill would return the written value (plain
  autograd raises there when backward reads it);
- an op updates running statistics its schema does not declare (``native_batch_norm`` in training, and its
  cuDNN and MIOpen forms): a rerun would update them again.

Memory an ``empty``-like op made, or an op that ran with grad disabled, may still be read once an op with grad
enabled has overwritten all of it without reading it (:data:`_FULL_WRITES`: ``bernoulli_``, ``uniform_``,
``fill_``, ``zero_``, ``copy_``, ...): nothing another kernel wrote there before survives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.multiprocessing.reductions import StorageWeakRef

__all__: list[str] = []


def _overloads(*names: str) -> frozenset:
    found = []
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None:
            continue
        found += [getattr(packet, o) for o in packet.overloads()] if not overload else \
            [getattr(packet, overload)] if overload in packet.overloads() else []
    return frozenset(found)


# In-place ops that write every element of ``self`` whatever it held: each draw, a fill, a copy (broadcast to
# ``self``'s shape).
_FULL_WRITES = _overloads("bernoulli_", "uniform_", "normal_", "exponential_", "geometric_", "cauchy_",
                          "log_normal_", "random_", "fill_.Scalar", "fill_.Tensor", "zero_.default", "copy_.default")
_STATISTICS = ("running_mean", "running_var")
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _tracked(t: torch.Tensor) -> bool:
    """A tensor whose memory can be told apart (not a subclass, sparse, or on the meta device)."""
    return type(t) in _PLAIN_TYPES and t.layout == torch.strided and t.device.type != "meta"


@dataclass
class _Made:
    """Memory an op of the region allocated."""

    storage: StorageWeakRef  # a freed address may be taken by later memory, which this is not
    root: int  # the step that allocated it
    last_write: int | None = None  # the last step that wrote it in place
    saved: bool = False  # autograd saved a tensor on it


def _storage_key(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


class _Memory:
    """While recording: the memory the region's ops allocated, the last in-place write to each, and which of
    it autograd saved.  Its methods but :meth:`refusal` take tensors :func:`_tracked` accepts."""

    def __init__(self) -> None:
        self.made: dict[tuple, _Made] = {}

    def lookup(self, t: torch.Tensor) -> _Made | None:
        found = self.made.get(_storage_key(t))
        if found is None or found.storage.expired() or found.storage != StorageWeakRef(t.untyped_storage()):
            return None
        return found

    def allocated(self, step: int, outputs: Iterable[torch.Tensor], arguments: Iterable[torch.Tensor]) -> None:
        """Step ``step``, an op whose schema returns no alias, made ``outputs`` (``_unsafe_view`` does return its
        argument's memory, unannotated: an output on an argument's memory is not new)."""
        taken = {_storage_key(t) for t in arguments}
        for t in outputs:
            key = _storage_key(t)
            if key not in taken and t.untyped_storage().nbytes() and self.lookup(t) is None:
                self.made[key] = _Made(StorageWeakRef(t.untyped_storage()), step)

    def last_writes(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The last in-place writes to the memory of ``tensors`` (what a step reading them must run after)."""
        found = set()
        for t in tensors:
            made = self.lookup(t)
            if made is not None and made.last_write is not None:
                found.add(made.last_write)
        return found

    def refusal(self, op: Any, args: tuple, out: Any) -> str | None:
        """Why in-place op ``op`` (its schema is mutable) cannot be a step; None where it can."""
        schema = op._schema
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        returns = schema.returns
        if (written != [0] or schema.arguments[0].kwarg_only or len(returns) != 1 or returns[0].alias_info is None
                or not returns[0].alias_info.is_write or not args or out is not args[0]):
            return f"{op} writes to an argument other than the self it returns (out= or several)"
        if torch.Tag.inplace_view in op.tags:
            return f"{op} changes a tensor's shape or memory in place"
        made = self.lookup(args[0]) if _tracked(args[0]) else None
        if made is None:
            return (f"{op} writes in place to memory the region did not make (an input, a parameter or buffer, a "
                    "tensor from outside or a view of one): a rerun would write it again")
        if made.saved:
            return f"{op} writes in place to memory autograd saved a tensor on: a refill would return it written"
        return None

    def wrote(self, step: int, target: torch.Tensor) -> int:
        """Step ``step`` wrote ``target`` in place (:meth:`refusal` let it); the step that allocated its memory."""
        made = self.lookup(target)
        made.last_write = step
        return made.root

    def saved(self, t: torch.Tensor) -> int | None:
        """Autograd saved ``t``: the last in-place write to its memory, if the region made it."""
        made = self.lookup(t)
        if made is None:
            return None
        made.saved = True
        return made.last_write


def covers(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are all of its memory's bytes (a write to each leaves nothing of what was there)."""
    return (t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()
            and is_non_overlapping_and_dense_or_false(t))


def updates_statistics(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` writes running statistics its schema does not mark written (batch norm in training)."""
    arguments = op._schema.arguments
    names = [a.name for a in arguments]
    if not any(name in _STATISTICS for name in names) or any(
            word in op._schema.name for word in ("no_update", "no_training", "functional")):
        return False

    def given(name: str) -> Any:
        position = names.index(name)
        return args[position] if position < len(args) else kwargs.get(name, arguments[position].default_value)

    declared = {a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write}
    if not any(name in names and name not in declared and isinstance(given(name), torch.Tensor)
               for name in _STATISTICS):
        return False
    return "training" not in names or bool(given("training"))
