"""The inputs a tensor-parallel block could keep as one shard per rank, and what gathering them back costs.

Under tensor parallel (without sequence parallel) every rank of the mesh holds a block's input in full.  A plan
may checkpoint the block with its inputs kept as a ``1/tp`` shard per rank, all-gathered whole in backward
(``checkpoint_partitioned``, :mod:`remat.planning.choices.partitioned`).  What that option keeps and costs is
measured here: which tensors each block's :class:`~remat.policies.partition.PartitionInputs` would shard (one
forward with a hook per block, by the rule of the hooks a plan installs, :func:`~remat.policies.partition.shard_bytes`
with ``activations_only``: the inputs that require grad, so that forward runs with grad), and the
seconds of a real all-gather of each of their sizes on the process group the model's mesh uses.

Those seconds are kept in the machine's timings file (:mod:`~remat.planning.measure.timecache`), keyed by the
shard's bytes, the group's size, its backend and the device, as the blocks' times are, so that a choice of the
option does not follow timing noise from one run to the next (:func:`kept_gather_times`: unsteady times are not
written, kept ones are checked against one all-gather timed now, ``fresh_timings=True`` measures again).  Every
rank runs that forward and those all-gathers in the same order (they are collectives), as the blocks' timed runs
are; rank 0 reads the file and its times decide on every rank, so that all plan alike.  On the CPU an all-gather
is timed on the wall clock: its time is waiting on the other ranks, which a thread's CPU time does not count.
On the meta device (a :func:`remat.fake_world` of N ranks) nothing runs: the same rule finds the inputs on meta
tensors, and an all-gather costs what crossing the interconnect costs
(:meth:`~remat.planning.measure.interconnect.Interconnect.seconds`: ``(n - 1) / n`` of the gathered tensor's bytes
over the link, plus its latency).  Where no process group runs the model's mesh off the meta device (one process,
a fake world on real tensors) nothing is measured and no block has the option.

Example:
    >>> measured.partitioned = partitioned_inputs(model, blocks, lambda: model(tokens), Ranks.of(model))
    >>> measured.partitioned["blocks.0"].gather_time
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...engine.replay import tensor_leaves
from ...policies.partition import shard_bytes
from ..basics.ranks import Ranks, reshard, tensor_parallel_group
from ..basics.userline import user_stacklevel
from .interconnect import Interconnect
from .timecache import StaleTimings, TimingCache, agrees, spread_of, stale_slack, timings_cache, unsteady_limit
from .timing import Clock

__all__ = ["PartitionedInputs", "kept_gather_times", "partitioned_inputs"]

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
                       ranks: Ranks, interconnect: Interconnect | None = None) -> dict[str, PartitionedInputs]:
    """Per block of ``blocks`` whose inputs :class:`~remat.policies.partition.PartitionInputs` would shard over
    ``model``'s tensor-parallel group: their bytes and the time of gathering them back.  Runs ``forward()`` once
    (without grad) on every rank, then the all-gathers, timed (kept in the timings file); on the meta device (a
    :func:`remat.fake_world`) the all-gathers are priced over ``interconnect`` (default:
    :class:`~remat.planning.measure.interconnect.Interconnect`'s).  Empty where ``ranks`` do not profile together
    on a mesh off the meta device, or where the mesh's group is not decidable.

    Example:
        >>> partitioned_inputs(model, [("blocks.0", model.blocks[0])], lambda: model(tokens), Ranks.of(model))
        {'blocks.0': PartitionedInputs(whole=1048576, shard=524288, ...)}
    """
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if not (ranks.together or on_meta):
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
    shards = {shard for block in sizes.values() for shard, _ in block}
    if on_meta:  # nothing to time: what crossing the interconnect costs, the whole gathered tensor's bus bytes
        link = interconnect or Interconnect()
        seconds = {shard: link.seconds("all_gather_into_tensor", shard * world, world) for shard in shards}
    else:
        seconds = _gather_times(shards, group, world, next(model.parameters()).device, ranks)
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
    """Per block, (shard bytes, whole bytes) of each input its first call's hooks would shard, in order: the
    hooks a plan installs (``activations_only``), so the forward runs with grad, as training does (which inputs
    require grad is the rule), and keeps no saved tensor (it holds what a forward without grad would)."""
    sizes: dict[str, list[tuple[int, int]]] = {}

    def recorder(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in sizes:
                sizes[name] = [(shard, t.nbytes) for t in tensor_leaves((args, kwargs))
                               if (shard := shard_bytes(t, world, activations_only=True)) is not None]
        return record

    handles = [module.register_forward_pre_hook(recorder(name), with_kwargs=True) for name, module in blocks]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked):
            forward()
    finally:
        for handle in handles:
            handle.remove()
        # FSDP2 units that keep their parameters gathered after a forward without backward.  The root's record of
        # this forward (for a backward's prefetches) is never read: a step's backward reads its own forward's
        # entries, after it, and clears them all at its end
        reshard(model)
    return sizes


def _dropped(tensor: torch.Tensor) -> None:
    """The pack hook of the measuring forward: nothing is kept for a backward that never runs."""


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("remat internal error: the forward that finds partitioned inputs has no backward.")


def kept_gather_times(cache: TimingCache, sizes: set[int], group_key: str, device: str,
                      timed: Callable[[int, int], list[float]]) -> dict[int, float]:
    """Seconds of an all-gather of a shard of each of ``sizes`` bytes: kept in the timings file (``cache``, under
    ``group_key``: the group's size and backend) or measured with ``timed(size, rounds)`` (that many timed
    all-gathers of ``size`` bytes after a warm-up; their median), smallest first, every rank in the same order.

    A measurement whose rounds spread by more than :func:`~remat.planning.measure.timecache.unsteady_limit` serves
    this profile only.  Kept times are checked first against one all-gather of the largest kept size timed now:
    apart by more than :func:`~remat.planning.measure.timecache.stale_slack`, every size is measured again, with
    one :class:`~remat.planning.measure.timecache.StaleTimings` line.  Ranks that time together decide from rank 0's
    times (``cache.same``).

    Example:
        >>> with timings_cache(ranks) as cache:
        ...     kept_gather_times(cache, {524288}, "2 ranks (gloo)", "cpu", timed)
        {524288: 0.00041}
    """
    kept = {size: cache.get("gather", f"{size}|{group_key}", device) for size in sorted(sizes)}
    found = [size for size, entry in kept.items() if entry]
    if found and stale_slack(0.0) != float("inf"):
        largest = found[-1]
        now, entry = cache.same(timed(largest, 1)[0]), kept[largest]
        if not agrees(entry["seconds"], now, stale_slack(entry["spread"])):
            warnings.warn(StaleTimings(
                f"remat.profile: the cached times of all-gathers over {group_key} are not this machine's now "
                f"(an all-gather of a {largest}-byte shard takes {entry['seconds'] * 1e3:.3f} ms by them, "
                f"{now * 1e3:.3f} ms now); measuring them again."), stacklevel=user_stacklevel())
            kept = dict.fromkeys(kept)
    seconds = {}
    for size, entry in kept.items():
        if entry is None:
            rounds = cache.same(timed(size, _ROUNDS))
            entry = {"seconds": statistics.median(rounds), "spread": spread_of(rounds)}
            if entry["spread"] <= unsteady_limit():  # an unsteady time serves this profile only
                cache.put("gather", f"{size}|{group_key}", device, entry)
        seconds[size] = entry["seconds"]
    return seconds


def _gather_times(sizes: set[int], group: Any, world: int, device: torch.device, ranks: Ranks) -> dict[int, float]:
    """Seconds of an all-gather on ``group`` of a shard of each of ``sizes`` bytes, kept or measured
    (:func:`kept_gather_times`); rank 0's on every rank (every decision there is made from rank 0's times)."""
    import torch.distributed as dist

    clock = Clock(device) if device.type != "cpu" else None

    def timed(size: int, rounds: int) -> list[float]:
        shard = torch.zeros(size, dtype=torch.uint8, device=device)
        whole = torch.empty(size * world, dtype=torch.uint8, device=device)
        seconds = []
        for _ in range(rounds + 1):  # the first a warm-up
            if clock is not None:
                seconds.append(clock.time(lambda: dist.all_gather_into_tensor(whole, shard, group=group))[1])
            else:
                start = time.perf_counter()
                dist.all_gather_into_tensor(whole, shard, group=group)
                seconds.append(time.perf_counter() - start)
        return seconds[1:]

    # the lock is not held across these collectives: rank 0 reads the file and hands its entries to every rank
    with timings_cache(ranks) as cache:
        return kept_gather_times(cache, sizes, f"{world} ranks ({dist.get_backend(group)})", str(device), timed)
