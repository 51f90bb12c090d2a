"""Points of each block's op-level front, offered to the planner as ``selective`` options.

A front point (:class:`~remat.opfront.FrontPoint`) is stated in the op graph's terms: bytes the block keeps
(its inputs plus the kept op outputs) and extra seconds predicted from per-op kernel times.  The planner
(:mod:`remat.planner`) works in the whole-step profile's terms.  The translation, per block:

* kept bytes: what the block holds when checkpointed (``row.held_bytes``) plus the kept op outputs —
  exact, both are storage bytes;
* transient: the recomputation's measured peak (``row.recompute_bytes``) less what the kept outputs
  spare it (the front's ``recompute_peak`` of plain checkpointing minus the point's);
* extra time: the point's predicted time scaled by the block's measured whole-step price of checkpointing
  over the front's prediction of it, so every option of a block is priced on one scale.

Only the front's interior points become options: its two ends are the planner's own ``checkpoint`` and
``keep``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .opfront import FrontPoint, fronts, policy_for, thin_front
from .planner import BlockOption

if TYPE_CHECKING:
    from .opgraph import BlockGraph, OpProfile
    from .profile import ModuleProfile, Profile

__all__ = ["selective_options"]


def selective_options(prof: Profile, ops: OpProfile, points: int = 12) -> dict[str, list[BlockOption]]:
    """Per block of ``prof`` with an op graph in ``ops``: up to ``points`` selective options from its front.

    Example:
        >>> extra = selective_options(prof, remat.profile_ops(model, tokens))
        >>> [o.name for o in extra["blocks.0"]]
        ['selective', 'selective', ...]
    """
    per_block = fronts(ops)
    options: dict[str, list[BlockOption]] = {}
    for row in prof.rows:
        front = per_block.get(row.name)
        if not front or front[0].mode != "checkpoint" or row.checkpoint_time == float("inf"):
            continue
        graph = ops.blocks[row.name]
        interior = [p for p in thin_front(front, points + 2) if p.mode == "selective"]
        options[row.name] = [_option(row, graph, front[0], p) for p in interior]
    return options


def _option(row: ModuleProfile, graph: BlockGraph, checkpoint: FrontPoint, point: FrontPoint) -> BlockOption:
    scale = row.checkpoint_time / checkpoint.extra_time if checkpoint.extra_time > 0 else 1.0
    policy = policy_for(graph, point)
    return BlockOption(
        "selective",
        kept=row.held_bytes + point.kept_bytes - point.input_bytes,
        extra_time=point.extra_time * scale,
        transient=max(0, row.recompute_bytes - (checkpoint.recompute_peak - point.recompute_peak)),
        recomputes=True,
        wrap=policy.wrap,
        policy=policy,
        recomputed_ops=point.recomputed_ops,
    )
