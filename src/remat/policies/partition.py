"""Keep a checkpointed region's inputs as shards across a process group; gather them whole for backward.

Under tensor parallel without sequence parallel every rank of the group holds a block's input in full, and a
checkpointed block keeps that input until its backward on every rank: the group holds it ``world`` times over.
:class:`PartitionInputs` is the saved-tensor hooks a region's inputs are saved under (``remat.checkpoint(...,
partition_inputs=group)``): each rank keeps its ``1/world`` slice, and backward all-gathers the whole before
the region is recomputed (DeepSpeed's ``partition_activations``).  The gather copies bytes, so the input comes
back exactly and gradients are bitwise those without it; it costs one all-gather per input per step, issued
by every rank in the same (backward) order.

The inputs must be equal on every rank of the group, as tensor parallel's replicated activations are: a
rank's slice stands for the others'.  Parameters, leaves that require grad (their memory stays alive anyway),
tensor subclasses (a DTensor is sharded already) and non-contiguous or small tensors are kept as they are.
``activations_only=True`` keeps whole every tensor that does not require grad too (rotary tables, masks,
position ids): a model hands those to every layer, so they stay alive whatever one layer keeps, and a shard of
them frees nothing; what it shards are the region's activations (hidden states).  Plans install it so.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PARTITION_MIN_BYTES", "PartitionInputs", "PartitionStats", "shard_bytes"]

PARTITION_MIN_BYTES = 1 << 20
"""The smallest input :class:`PartitionInputs` shards: below it the all-gather costs more than it frees."""


def shard_bytes(tensor: torch.Tensor, world: int, min_bytes: int = PARTITION_MIN_BYTES,
                activations_only: bool = False) -> int | None:
    """The bytes one rank of ``world`` keeps of ``tensor`` when :class:`PartitionInputs` saves it (its slice,
    padded to a ``1/world`` share), or None where the hooks keep it whole: a tensor subclass (a DTensor), a
    parameter or a leaf that requires grad, a non-contiguous tensor, one under ``min_bytes``, one rank alone,
    or, with ``activations_only``, a tensor that does not require grad.

    Example:
        >>> shard_bytes(torch.zeros(1024, 1024), world=2)
        2097152
        >>> shard_bytes(torch.zeros(1024, 1024), world=2, activations_only=True) is None   # a mask, a rotary table
        True
    """
    owner = tensor._base if tensor._base is not None else tensor
    if (type(tensor) is not torch.Tensor or world == 1 or tensor.nbytes < min_bytes or not tensor.is_contiguous()
            or (owner.is_leaf and (owner.requires_grad or isinstance(owner, nn.Parameter)))
            or (activations_only and not tensor.requires_grad)):
        return None
    return -(-tensor.numel() // world) * tensor.element_size()


@dataclass
class PartitionStats:
    """What a :class:`PartitionInputs` context did: tensors sharded, the bytes one rank keeps of them
    (``kept_bytes``) and their whole size (``whole_bytes``), and the all-gathers backward ran."""

    sharded_tensors: int = 0
    kept_bytes: int = 0
    whole_bytes: int = 0
    gathers: int = 0


@dataclass(frozen=True)
class _Saved:
    """A tensor saved under the hooks: whole (``part`` is the tensor) or as this rank's slice of it.  ``owner``
    and ``version``: the tensor's storage owner and version when saved; autograd's own check of an in-place
    change after the save does not see through saved-tensor hooks, so the unpack checks it."""

    part: torch.Tensor
    shape: torch.Size | None  # None: kept whole
    numel: int
    owner: weakref.ref
    version: int


class PartitionInputs(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep each rank's slice of the tensors saved under them; backward gathers them.

    ``group`` is a process group (or a 1-D ``DeviceMesh``) whose ranks all save equal tensors; tensors under
    ``min_bytes`` are kept whole, and with ``activations_only`` those that do not require grad too (see
    :func:`shard_bytes`).  :func:`remat.checkpoint` installs one around a region's inputs when given
    ``partition_inputs=group`` (or these hooks themselves, made with other settings).

    Example:
        >>> y = remat.checkpoint(block, x, policy=remat.policies.save_collectives, partition_inputs=tp_group)
        >>> hooks = PartitionInputs(tp_group, activations_only=True)     # a Llama layer: its hidden states only
        >>> y = remat.checkpoint(layer, h, position_embeddings=(cos, sin), partition_inputs=hooks)
    """

    def __init__(self, group: Any = None, min_bytes: int = PARTITION_MIN_BYTES, activations_only: bool = False
                 ) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("remat.checkpoint: partition_inputs needs torch.distributed's process group "
                             "(torch.distributed.init_process_group, as under torchrun); leave it out otherwise.")
        self.group = group.get_group() if hasattr(group, "get_group") else group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.min_bytes = min_bytes
        self.activations_only = activations_only
        self.stats = PartitionStats()
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        owner = tensor._base if tensor._base is not None else tensor
        if shard_bytes(tensor, self.world, self.min_bytes, self.activations_only) is None:
            return _Saved(tensor, None, tensor.numel(), weakref.ref(owner), tensor._version)
        flat = tensor.detach().reshape(-1)
        per_rank = -(-flat.numel() // self.world)
        part = flat.new_zeros(per_rank)
        mine = flat[self.rank * per_rank:(self.rank + 1) * per_rank]
        part[:mine.numel()].copy_(mine)
        self.stats.sharded_tensors += 1
        self.stats.kept_bytes += part.nbytes
        self.stats.whole_bytes += tensor.nbytes
        return _Saved(part, tensor.shape, flat.numel(), weakref.ref(owner), tensor._version)

    def _unpack(self, packed: _Saved) -> torch.Tensor:
        owner = packed.owner()
        if owner is not None and owner._version != packed.version:
            raise RuntimeError(
                "remat: a checkpointed region's input saved under partition_inputs was modified in place "
                f"after the region saved it (its version went from {packed.version} to {owner._version}); plain "
                "autograd refuses this too. Clone the tensor before modifying it, or modify it before the region.")
        if packed.shape is None:
            return packed.part
        import torch.distributed as dist

        whole = packed.part.new_empty(packed.part.numel() * self.world)
        dist.all_gather_into_tensor(whole, packed.part, group=self.group)
        self.stats.gathers += 1
        return whole[:packed.numel].view(packed.shape)
