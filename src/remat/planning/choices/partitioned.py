"""``checkpoint_partitioned``: a tensor-parallel block checkpointed with its inputs kept as one shard per rank.

Under tensor parallel (without sequence parallel) every rank holds a block's input in full, and a checkpointed block
keeps it until its backward on every rank.  This option keeps each rank's ``1/tp`` slice instead and all-gathers
the whole in backward before the block is recomputed (DeepSpeed's ``partition_activations``;
:class:`~remat.policies.partition.PartitionInputs`), and keeps what crossed the wire: the outputs of the collectives
its recomputation reaches (as :data:`remat.policies.save_collectives` does, for those alone: an op-level policy), so
its recomputation sends nothing again but its own all-gathers.  Gradients are bitwise those without it.

Priced from the block's keep-collectives checkpoint (the ``selective`` option that keeps those outputs,
:func:`keep_collectives`; plain ``checkpoint`` where its recomputation reaches no collective), with what the
profile measured of its inputs (:class:`~remat.planning.measure.gathers.PartitionedInputs`):

* kept: that option's bytes less the inputs' whole bytes, plus the shard a rank keeps of them;
* transient: that option's, plus the gathered inputs, alive in the block's backward from the all-gather on; and
  through that backward, where the step without a plan held the whole inputs, the shard beside the gathered ones
  (``backward_held``, with the gather's padding);
* forward: the shard is made while the whole input is still alive, so the forward holds it on top;
* extra time: that option's, plus the measured all-gathers, priced as communication.

The inputs sharded are the block's activations (those that require grad: its hidden states), not the tensors a
model hands every layer (rotary tables, masks, position ids: alive anyway, a shard of them frees nothing), so a
Hugging Face decoder layer has the option as a GPT block does.  Only a block whose sharded inputs are its own (no
larger than the inputs only it holds, ``row.held_bytes``) and whose recomputation can be served every collective
it reaches has the option: sharding a tensor other blocks hold too would free nothing, and the option sends no
collective again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from torch import nn

from ...api.modules import checkpoint_wrapper
from ...policies.partition import PartitionInputs
from ..basics.blockpolicy import BlockPolicy
from ..basics.ranks import original_class, tensor_parallel_group
from ..measure.gathers import PartitionedInputs
from ..measure.opgraph import BlockGraph
from ..measure.prices import sent_again, wire_nodes
from ..measure.profile import ModuleProfile

__all__ = ["PARTITIONED", "keep_collectives", "partition_group", "partitioned_option", "partitioned_wrapper"]

PARTITIONED = "checkpoint_partitioned"
Option = TypeVar("Option")


def keep_collectives(graph: BlockGraph) -> list[int] | None:
    """The nodes of ``graph`` whose outputs the option keeps: every collective its recomputation reaches (a policy
    serves them instead of sending them again); None where one of them cannot be kept (written in place later).

    Example:
        >>> [graph.nodes[i].op for i in keep_collectives(graph)]      # GPT: dropout after the down projection
        ['_c10d_functional.all_reduce.default']
    """
    kept = list(wire_nodes(graph))
    return kept if set(sent_again(graph)) <= set(kept) else None


def partitioned_option(row: ModuleProfile, graph: BlockGraph, keep_collectives_option: Option,
                       inputs: PartitionedInputs) -> list[Option]:
    """The ``checkpoint_partitioned`` option of ``row``'s block (none where its sharded inputs are not its own), from
    its keep-collectives checkpoint (``keep_collectives_option``, a
    :class:`~remat.planning.choices.options.BlockOption`: ``selective`` keeping :func:`keep_collectives`'s nodes,
    or ``checkpoint`` where there are none) and the profile's measure of its inputs.

    Example:
        >>> [o.name for o in partitioned_option(row, graph, base, prof.partitioned[row.name])]
        ['checkpoint_partitioned']
    """
    if inputs.whole > row.held_bytes:
        return []
    base: Any = keep_collectives_option
    return [replace(base, name=PARTITIONED, kept=base.kept - inputs.whole + inputs.shard,
                    extra_time=base.extra_time + inputs.gather_time, transient=base.transient + inputs.gathered,
                    spared=base.spared - inputs.shard, backward_held=inputs.shard + inputs.gathered - inputs.whole,
                    resends=0, wrap=None)]


def partitioned_wrapper(group: Any, policy: BlockPolicy | None = None) -> Callable[[nn.Module], nn.Module]:
    """How a plan installs ``checkpoint_partitioned`` on a block: checkpointed with its activations among its inputs
    sharded over ``group`` (``PartitionInputs(group, activations_only=True)``: what the profile measured), under
    ``policy``'s op-level decisions (the collective outputs it keeps; None: it keeps nothing).

    Example:
        >>> model.blocks[0] = partitioned_wrapper(tensor_parallel_group(model))(model.blocks[0])
    """
    def wrap(module: nn.Module) -> nn.Module:
        hooks = PartitionInputs(group, activations_only=True)
        if policy is None:
            return checkpoint_wrapper(module, partition_inputs=hooks)
        return checkpoint_wrapper(module, context_fn=policy.context_fn, partition_inputs=hooks)
    return wrap


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
