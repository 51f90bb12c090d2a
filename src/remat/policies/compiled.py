"""Under ``torch.compile``: hand checkpointed regions to the compiler's own rematerialization.

remat's eager engine works by saved-tensor hooks and dispatch modes that run
Python per saved tensor and per operator.  A compiled graph has neither: its
forward and backward are fixed programs, and the compiler (AOTAutograd's
partitioner) decides which forward values the backward reads and which it
recomputes.  So while dynamo traces, :func:`remat.checkpoint` does not run its
engine at all; it calls ``torch.utils.checkpoint.checkpoint``, which dynamo
turns into its activation-checkpoint higher-order op, and hands the region's
policy over as the compiler's selective-checkpoint tags:

* remat's policies, op lists and policy functions (``policy=`` or
  ``context_fn=partial(create_selective_checkpoint_contexts, ...)``) are asked
  the same question per operator while the compiler traces the region, and
  their answers become torch's ``CheckpointPolicy`` tags;
* ``CPU_OFFLOAD`` becomes ``SAVE`` of the same strength: the partitioner knows
  saving and recomputing only, so an offloaded tensor stays on its device;
* views and in-place ops are recomputed without asking the policy, in-place
  random ops included: eager remat keeps those by value (dropout's
  ``bernoulli_`` on CPU), the compiled lowering does not (PyTorch's
  selective checkpointing under compile warns against in-place ops in the
  region).  Under dynamo dropout is one out-of-place ``native_dropout``, which
  a policy can keep; a plan profiled in eager mode names ``bernoulli_``
  calls, so under compile its kept draws are recomputed;
* :func:`remat.tag` names the graph node that produced a tensor (an fx
  ``custom`` annotation); the name rule is applied to every operator that
  node lowers to.

Everything here runs while compiling; the compiled program contains no
remat code.  (When dynamo cannot trace a region's body, without fullgraph,
it runs that region through PyTorch's eager checkpoint, which then calls
:func:`_compiler_contexts` at run time: same decisions, no tags.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .decisions import CheckpointPolicy, SelectiveCheckpointContext, _is_view_or_inplace
from .selective import _Recorder

__all__ = ["checkpoint_in_graph", "tag_in_graph"]

# Key under node.meta["custom"] (the fx annotation dictionary) that carries a remat.tag name.
_TAG_KEY = "remat_tag"

_SAVE_INSTEAD_OF_OFFLOAD = {
    CheckpointPolicy.MUST_CPU_OFFLOAD: CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: CheckpointPolicy.PREFER_SAVE,
}


def checkpoint_in_graph(function: Callable[..., Any], args: tuple, kwargs: dict, context_fn: Callable | None) -> Any:
    """Checkpoint ``function(*args, **kwargs)`` inside the graph dynamo is tracing.

    ``context_fn`` is the caller's selective-checkpoint context function, or
    None for plain checkpointing.  Called by :func:`remat.checkpoint` when
    ``torch.compiler.is_compiling()``: dynamo traces it into the graph.

    Example:
        >>> @torch.compile(fullgraph=True)
        ... def step(x):
        ...     return checkpoint_in_graph(block, (x,), {}, None).sum()
    """
    if context_fn is None:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    # A partial of constants: dynamo hands it to the higher-order op, which calls it while AOTAutograd traces.
    lowered = functools.partial(_compiler_contexts, context_fn)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=lowered, **kwargs)


def _compiler_contexts(context_fn: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts standing for what ``context_fn`` asks (runs at compile time)."""
    forward, recompute = context_fn()
    if isinstance(forward, _Recorder):
        store = forward.store
        policy = store.policy
        if getattr(policy, "by_call", False):
            policy = _CallCounter(policy)  # fresh counters: this runs once per traced region
        decide = functools.partial(_decide_for_compiler, policy)
        return torch_checkpoint.create_selective_checkpoint_contexts(decide, store.allow_mutation)
    if isinstance(forward, TorchDispatchMode) and isinstance(recompute, TorchDispatchMode):
        return forward, recompute  # torch's own selective contexts: already what the compiler reads
    if isinstance(forward, contextlib.nullcontext) and isinstance(recompute, contextlib.nullcontext):
        return torch_checkpoint.create_selective_checkpoint_contexts(_recompute_everything)
    raise ValueError(
        f"remat.checkpoint under torch.compile: context_fn returned ({type(forward).__name__}, "
        f"{type(recompute).__name__}); inside a compiled graph only selective-checkpoint contexts can apply. "
        "Use policy= or context_fn=partial(remat.create_selective_checkpoint_contexts, ...), or call the "
        "function outside torch.compile (e.g. under torch.compiler.disable) to run other contexts."
    )


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


class _CallCounter:
    """A policy with call rules asked as a PyTorch ``policy_fn``: counts each op's calls in traced order."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.decide_name = policy.decide_name
        self.calls: dict[Any, int] = {}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        index = self.calls.get(op, 0)
        self.calls[op] = index + 1
        return self.policy.decide(op, index)


def _decide_for_compiler(policy: Callable[..., Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """One remat policy decision, as the torch ``CheckpointPolicy`` tag the partitioner reads."""
    if isinstance(op, torch._ops.OpOverload) and _is_view_or_inplace(op):
        # Views and in-place results alias another value; in-place draws, kept by value in eager mode, are
        # recomputed here too (see the module docstring).
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    remat_ctx = SelectiveCheckpointContext(is_recompute=ctx.is_recompute, op_output=getattr(ctx, "op_output", None))
    decision = CheckpointPolicy.coerce(policy(remat_ctx, op, *args, **kwargs))
    name = fx_traceback.get_current_meta().get("custom", {}).get(_TAG_KEY)
    decide_name = getattr(policy, "decide_name", None)
    if name is not None and decide_name is not None:
        decision = decide_name(name) or decision
    decision = _SAVE_INSTEAD_OF_OFFLOAD.get(decision, decision)
    return torch_checkpoint.CheckpointPolicy[decision.name]


def _annotate_producer(ctx: Any) -> None:
    # Runs inside dynamo (via comptime) with tag_in_graph's locals: files the name on the tensor's graph node.
    tensor = ctx.get_local("tensor")
    if not tensor.is_proxy():
        return
    name = ctx.get_local("name").as_python_constant()
    node = tensor.as_proxy().node
    node.meta.setdefault("custom", {})[_TAG_KEY] = name


def tag_in_graph(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`remat.tag` while dynamo traces: name the graph node that produced ``tensor``.

    Example:
        >>> h = tag_in_graph(x @ w, "proj")  # inside a function torch.compile traces
    """
    from torch._dynamo.comptime import comptime  # dynamo is loaded when this runs; `import remat` stays light

    comptime(_annotate_producer)
    return tensor
