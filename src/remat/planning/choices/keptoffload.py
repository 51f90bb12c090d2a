"""Kept blocks whose largest saved tensors go to host memory: the ``keep_offload`` options.

A ``keep_offload`` block is not recomputed.  The op calls that make its largest saved tensors (chosen from the
block's op graph, largest first) are named in a :class:`~remat.planning.basics.blockpolicy.BlockPolicy` of mode
``keep`` with ``offload`` entries; installed, the block runs under :class:`remat.offload` with ``outputs_of``
those calls, counted afresh in every forward, so which tensors of a call move is decided by that call's own ops.
Their copies out run on the copy engine's side stream behind the forward, and come back ahead of the block's
backward.

Each block gets a few levels (the ``k`` largest for ``k`` in :data:`LEVELS`).  The chain's dynamic program adds prices
block by block, so each level carries a price of its own: the copy time beyond what one block's share of the link hides
(its forward going out, its backward coming back) plus the marking dispatch mode's host work where the device waits for
it.  A plan's copies are then priced together on the step's timeline (:func:`~remat.planning.measure.copyline.simulate`,
through :func:`~remat.planning.choices.options.step_extra_time`), where a block that moves more than its share borrows
the link from neighbours that move less.

A plan with such blocks runs its copies under a schedule (:func:`~remat.planning.choices.options.copy_schedule`): no
window limit in forward, the copies in flight bounded at each block's start instead, prefetch a block ahead in
backward; its peak counts the bytes the copies hold at each stretch of the step
(:mod:`remat.planning.solve.copyplan`), so the option counts nothing in flight of its own (``in_flight`` 0).

The chain's last block has none: backward starts there, with nothing to hide its copies back behind.

Example:
    >>> extra = keep_offload_options(prof, link_for(prof.device))
    >>> [o.name for o in extra[0]]
    ['keep_offload', 'keep_offload', ...]
"""

from __future__ import annotations

from ..basics.blockpolicy import BlockPolicy, OpDecision
from ..measure.copies import Link
from ..measure.copyline import Copy
from ..measure.opgraph import BlockGraph
from ..measure.profile import ModuleProfile, StepProfile
from .options import BlockOption

__all__ = ["LEVELS", "MIN_TENSOR_BYTES", "keep_offload_options", "offload_candidates"]

LEVELS = (1, 2, 3, 4, 6, 8, 12)
"""How many of a block's largest saved op outputs each ``keep_offload`` option moves."""
MIN_TENSOR_BYTES = 1 << 20
"""Smaller saved tensors stay: their copies' launches cost more than the bytes free (1 MiB, as other offloaders)."""


def offload_candidates(graph: BlockGraph) -> list[int]:
    """The nodes of ``graph`` whose saved outputs ``keep_offload`` may move, largest saved bytes first.

    Compute ops (views and in-place ops make no storage of their own) whose output no later op writes in place
    (the copy would be stale), saving at least :data:`MIN_TENSOR_BYTES`.

    Example:
        >>> [graph.nodes[i].op for i in offload_candidates(graph)][:2]
        ['aten.mm.default', 'aten.silu.default']
    """
    found = [n for n in graph.nodes if n.kind == "compute" and not n.mutated and n.saved_bytes >= MIN_TENSOR_BYTES]
    return [n.index for n in sorted(found, key=lambda n: (-n.saved_bytes, n.index))]


def keep_offload_options(prof: StepProfile, link: Link) -> dict[int, list[BlockOption]]:
    """Per block index of ``prof`` (with an op graph, not the last): its ``keep_offload`` options, one per level.

    ``link``: the device's link to host memory.

    Example:
        >>> options = keep_offload_options(prof, MODELLED_LINK)
    """
    if prof.ops is None:
        return {}
    found: dict[int, list[BlockOption]] = {}
    for p, row in enumerate(prof.rows[:-1]):
        graph = prof.ops.blocks.get(row.name)
        if graph is None:
            continue
        candidates = offload_candidates(graph)
        levels = sorted({min(k, len(candidates)) for k in LEVELS if candidates})
        options = [_option(row, graph, candidates[:k], link) for k in levels]
        found[p] = [o for o in options if o.kept < row.own_bytes]
    return {p: options for p, options in found.items() if options}


def _option(row: ModuleProfile, graph: BlockGraph, chosen: list[int], link: Link) -> BlockOption:
    nodes = graph.nodes
    moved = sum(nodes[i].saved_bytes for i in chosen)
    # the block's output is not among its own bytes (the next block's input holds it): moving it frees none of them
    returned = {s.producer for s in graph.storages if s.dies is None}
    freed = sum(nodes[i].saved_bytes for i in chosen if i not in returned)
    # a tensor is made when its op ends: its share of the block's forward; backward uses it at the mirror point
    total = sum(n.wall_time for n in nodes) or 1.0
    ends, elapsed = {}, 0.0
    for n in nodes:
        elapsed += n.wall_time
        ends[n.index] = elapsed / total
    copies = tuple(Copy(ends[i], 1.0 - ends[i], nodes[i].saved_bytes, scheduled=True) for i in chosen)
    f = row.forward_time
    alone = (max(0.0, link.seconds(moved, to_host=True) - f)
             + max(0.0, link.seconds(moved, to_host=False) - 2 * f))
    policy = BlockPolicy("keep", [OpDecision(nodes[i].op, nodes[i].call, nodes[i].saved_bytes, "offload")
                                  for i in sorted(chosen)])
    return BlockOption("keep_offload", max(row.held_bytes, row.own_bytes - freed), _host_time(graph, len(chosen))
                       + alone, wrap=policy.wrap, policy=policy, copy_time=alone,
                       copies=copies)


def _host_time(graph: BlockGraph, moved: int) -> float:
    """Seconds the device waits for the marking dispatch mode (every op of the forward) and the engine's work per
    moved tensor: all of it where the host does not run ahead, what it adds beyond the kernels where it does."""
    extra = len(graph.nodes) * graph.overheads.policy_forward + 2 * moved * graph.overheads.per_saved
    if not graph.asynchronous:
        return extra
    host = sum(n.host_time for n in graph.nodes)
    kernels = sum(n.kernel_time for n in graph.nodes)
    return max(0.0, host + extra - kernels) - max(0.0, host - kernels)
