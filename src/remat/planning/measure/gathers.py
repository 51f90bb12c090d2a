"""The inputs a tensor-parallel block could keep as one shard per rank, and what gathering them back costs.

Under tensor parallel (without sequence parallel) every rank of the mesh holds a block's input in full.  A plan
may checkpoint the block with its inputs kept as a ``1/tp`` shard per rank, all-gathered whole in backward
(``checkpoint_partitioned``, :mod:`remat.planning.choices.partitioned`).  What that option keeps and costs is
measured here, once per profile: which tensors each block's :class:`~remat.policies.partition.PartitionInputs`
would shard (one forward with a hook per block, by the hooks' own rule,
:func:`~remat.policies.partition.shard_bytes`), and the seconds of a real all-gather of each of their sizes on
the process group the model's mesh uses.

Every rank runs that forward and those all-gathers in the same order (they are collectives), as the blocks'
timed runs are; rank 0's times are handed to every rank, so that all plan alike.  On the CPU an all-gather is
timed on the wall clock: its time is waiting on the other ranks, which a thread's CPU time does not count.
Where no process group runs the model's mesh (one process, a fake world, the meta device) nothing is measured
and no block has the option.

Example:
    >>> measured.partitioned = partitioned_inputs(model, blocks, lambda: model(tokens), Ranks.of(model))
    >>> measured.partitioned["blocks.0"].gather_time
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.replay import tensor_leaves
from ...policies.partition import shard_bytes
from ..basics.ranks import Ranks, reshard, tensor_parallel_group
from .timing import Clock

__all__ = ["PartitionedInputs", "partitioned_inputs"]

_ROUNDS = 3  # timed all-gathers per size, after one warm-up: the median is kept


@dataclass(frozen=True)
class PartitionedInputs:
    """What a block's inputs come to kept as shards across ``world`` tensor-parallel ranks.

    ``whole``: their bytes, which every rank holds in full; ``shard``: the bytes one rank keeps of them (each
    padded to a ``1/world`` share); ``gathered``: what backward's all-gathers allocate (``shard`` times ``world``);
    ``gather_time``: seconds of those all-gathers, measured on the process group.

    Example:
        >>> PartitionedInputs(whole=1048576, shard=524288, gathered=1048576, gather_time=0.0004, world=2)
    """

    whole: int
    shard: int
    gathered: int
    gather_time: float
    world: int


def partitioned_inputs(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], forward: Callable[[], Any],
                       ranks: Ranks) -> dict[str, PartitionedInputs]:
    """Per block of ``blocks`` whose inputs :class:`~remat.policies.partition.PartitionInputs` would shard over
    ``model``'s tensor-parallel group: their bytes and the measured time of gathering them back.  Runs
    ``forward()`` once (without grad) on every rank, then the all-gathers; empty where ``ranks`` do not profile
    together on a mesh, on the meta device, or where the mesh's group is not decidable (more than 1-D).

    Example:
        >>> partitioned_inputs(model, [("blocks.0", model.blocks[0])], lambda: model(tokens), Ranks.of(model))
        {'blocks.0': PartitionedInputs(whole=1048576, shard=524288, ...)}
    """
    if not ranks.together or any(p.device.type == "meta" for p in model.parameters()):
        return {}
    try:
        group = tensor_parallel_group(model)
    except ValueError:  # an N-D mesh: which ranks hold equal activations is not known
        return {}
    if group is None:
        return {}
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = ranks.same(_shard_sizes(model, blocks, forward, world))  # every rank times the same all-gathers
    device = next(model.parameters()).device
    seconds = ranks.same(_gather_times({shard for block in sizes.values() for shard, _ in block}, group, world,
                                       device))
    found = {}
    for name, block in sizes.items():
        shard = sum(nbytes for nbytes, _ in block)
        if shard:
            found[name] = PartitionedInputs(whole=sum(whole for _, whole in block), shard=shard,
                                            gathered=shard * world,
                                            gather_time=sum(seconds[nbytes] for nbytes, _ in block), world=world)
    return found


def _shard_sizes(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], forward: Callable[[], Any],
                 world: int) -> dict[str, list[tuple[int, int]]]:
    """Per block, (shard bytes, whole bytes) of each input its first call's hooks would shard, in order."""
    sizes: dict[str, list[tuple[int, int]]] = {}

    def recorder(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in sizes:
                sizes[name] = [(shard, t.nbytes) for t in tensor_leaves((args, kwargs))
                               if (shard := shard_bytes(t, world)) is not None]
        return record

    handles = [module.register_forward_pre_hook(recorder(name), with_kwargs=True) for name, module in blocks]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
        reshard(model)  # FSDP2 units that keep their parameters gathered after a forward without backward
    return sizes


def _gather_times(sizes: set[int], group: Any, world: int, device: torch.device) -> dict[int, float]:
    """Median seconds of an all-gather on ``group`` of a shard of each of ``sizes`` bytes, smallest first (every rank
    in the same order)."""
    import torch.distributed as dist

    clock = Clock(device) if device.type != "cpu" else None
    seconds = {}
    for size in sorted(sizes):
        shard = torch.zeros(size, dtype=torch.uint8, device=device)
        whole = torch.empty(size * world, dtype=torch.uint8, device=device)
        rounds = []
        for _ in range(_ROUNDS + 1):
            if clock is not None:
                rounds.append(clock.time(lambda: dist.all_gather_into_tensor(whole, shard, group=group))[1])  # noqa: B023
            else:
                start = time.perf_counter()
                dist.all_gather_into_tensor(whole, shard, group=group)
                rounds.append(time.perf_counter() - start)
        seconds[size] = statistics.median(rounds[1:])
    return seconds

