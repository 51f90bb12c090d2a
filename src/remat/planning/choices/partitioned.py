"""``checkpoint_partitioned``: a tensor-parallel block checkpointed with its inputs kept as one shard per rank.

Under tensor parallel (without sequence parallel) every rank holds a block's input in full, and a checkpointed block
keeps it until its backward on every rank.  This option keeps each rank's ``1/tp`` slice instead and all-gathers
the whole in backward before the block is recomputed (DeepSpeed's ``partition_activations``;
:class:`~remat.policies.partition.PartitionInputs`), under :data:`remat.policies.save_collectives`, so its
recomputation sends nothing again but its own all-gathers.  Gradients are bitwise those without it.

Priced from the keep-collectives checkpoint of the block (the ``selective`` option that keeps every collective's
output, :func:`keep_collectives`), with what the profile measured of its inputs
(:class:`~remat.planning.measure.gathers.PartitionedInputs`):

* kept: that option's bytes, plus the collective outputs the rule keeps past the recomputation's last saved tensor
  (it keeps every collective's), less the inputs' whole bytes, plus the shard a rank keeps of them;
* transient: that option's, plus the gathered inputs, alive in the block's backward from the all-gather on; and
  through that backward, where the step without a plan held the whole inputs, the shard beside the gathered ones
  (the collective outputs past the last saved tensor are let go of by then, as the recomputation ends);
* forward: the shard is made while the whole input is still alive, so the forward holds it on top;
* extra time: that option's, plus the measured all-gathers, priced as communication.

Only a block whose sharded inputs are its own (no larger than the inputs only it holds, ``row.held_bytes``) has
the option: sharding a tensor other blocks hold too would free nothing.

Example:
    >>> base = selective_option(row, graph, keep_collectives(graph))
    >>> partitioned_option(row, graph, base, prof.partitioned[row.name])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from torch import nn

from ...api.modules import checkpoint_wrapper
from ...policies.rules import is_collective, save_collectives
from ..basics.ranks import original_class, tensor_parallel_group
from ..measure.gathers import PartitionedInputs
from ..measure.opgraph import BlockGraph
from ..measure.profile import ModuleProfile

__all__ = ["PARTITIONED", "keep_collectives", "partition_group", "partitioned_option", "partitioned_wrapper"]

PARTITIONED = "checkpoint_partitioned"
Option = TypeVar("Option")


def keep_collectives(graph: BlockGraph) -> list[int]:
    """The nodes of ``graph`` whose outputs :data:`remat.policies.save_collectives` keeps and the recomputation is
    served: every collective's a policy may keep.

    Example:
        >>> [graph.nodes[i].op for i in keep_collectives(graph)]
        ['_c10d_functional.all_reduce.default']
    """
    return [i for i in graph.keepable if is_collective(graph.nodes[i].op)]


def _kept_past_stop(graph: BlockGraph) -> int:
    """Bytes of collective outputs the rule keeps that the recomputation never reaches (made after its last saved
    tensor): kept from forward to backward all the same."""
    return sum(n.out_bytes for n in graph.nodes[graph.stop:]
               if n.kind == "compute" and is_collective(n.op) and not n.mutated)


def partitioned_option(row: ModuleProfile, graph: BlockGraph, keep_collectives_option: Option,
                       inputs: PartitionedInputs) -> list[Option]:
    """The ``checkpoint_partitioned`` option of ``row``'s block (none where its sharded inputs are not its own), from
    its keep-collectives checkpoint (``keep_collectives_option``, a
    :class:`~remat.planning.choices.options.BlockOption`) and the profile's measure of its inputs.

    Example:
        >>> [o.name for o in partitioned_option(row, graph, base, prof.partitioned[row.name])]
        ['checkpoint_partitioned']
    """
    if inputs.whole > row.held_bytes:
        return []
    base: Any = keep_collectives_option
    return [replace(base, name=PARTITIONED, kept=base.kept + _kept_past_stop(graph) - inputs.whole + inputs.shard,
                    extra_time=base.extra_time + inputs.gather_time, transient=base.transient + inputs.gathered,
                    spared=base.spared - inputs.shard, backward_held=inputs.shard + inputs.gathered - inputs.whole,
                    wrap=None, policy=None)]


def partitioned_wrapper(group: Any) -> Callable[[nn.Module], nn.Module]:
    """How a plan installs ``checkpoint_partitioned`` on a block: checkpointed under ``save_collectives`` with its
    inputs sharded over ``group``.

    Example:
        >>> model.blocks[0] = partitioned_wrapper(tensor_parallel_group(model))(model.blocks[0])
    """
    return lambda module: checkpoint_wrapper(module, policy=save_collectives, partition_inputs=group)


def partition_group(model: nn.Module, decisions: Mapping[str, str]) -> Any:
    """The process group a plan with ``decisions`` shards its ``checkpoint_partitioned`` blocks' inputs over:
    ``model``'s tensor-parallel group (:func:`~remat.planning.basics.ranks.tensor_parallel_group`); None where no
    block takes the option.  A model that is not tensor parallel is refused in one line.

    Example:
        >>> partition_group(model, plan.decisions)
    """
    partitioned = [name for name, decision in decisions.items() if decision == PARTITIONED]
    if not partitioned:
        return None
    group = tensor_parallel_group(model)
    if group is None:
        raise ValueError(f"remat.Plan.apply: the plan keeps `{partitioned[0]}`'s inputs as shards across "
                         f"tensor-parallel ranks ({PARTITIONED}) and this {original_class(model).__name__} is not "
                         "tensor parallel; apply it to the tensor-parallel model it was made for, or plan this model.")
    return group
