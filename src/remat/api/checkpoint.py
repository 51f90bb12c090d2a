"""``remat.checkpoint``: argument handling, global switches and the choice of variant."""

from __future__ import annotations

import contextlib
import difflib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..engine.checks import metadata_fn_for
from ..engine.nonreentrant import run_nonreentrant
from ..engine.reentrant import CheckpointFunction
from ..policies import rules
from ..policies.compiled import checkpoint_in_graph
from ..policies.offload import offload
from ..policies.partition import PartitionInputs
from ..policies.selective import create_selective_checkpoint_contexts

__all__ = [
    "OFFLOAD_INPUTS_MIN_BYTES",
    "checkpoint",
    "noop_context_fn",
    "resolve_policy",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
]


def noop_context_fn() -> tuple[contextlib.nullcontext, contextlib.nullcontext]:
    """The default ``context_fn``: no extra context for forward or recomputation.

    Example:
        >>> forward_ctx, recompute_ctx = noop_context_fn()
    """
    return contextlib.nullcontext(), contextlib.nullcontext()


def _ready_made() -> dict[str, rules.Policy]:
    """The ready-made policies of :mod:`remat.policies.rules`, by name."""
    return {name: getattr(rules, name) for name in rules.__all__ if isinstance(getattr(rules, name), rules.Policy)}


def _name_policies() -> list[str]:
    """The names of the rules' factories that make a policy from tensor names (``save_names``...)."""
    return [name for name in rules.__all__ if name.endswith("_names")]


def resolve_policy(policy: Any, who: str = "remat.checkpoint") -> Any:
    """``policy`` as :func:`checkpoint` takes it: the name of a ready-made policy (``"save_matmuls"``) becomes
    that policy; a policy, a policy function or a list of ops is returned as it is; anything else is refused in
    one line naming ``who`` and the choices (ValueError for an unknown name, TypeError for another kind).

    Example:
        >>> resolve_policy("save_matmuls") is remat.policies.save_matmuls
        True
    """
    if isinstance(policy, str):
        ready = _ready_made()
        if policy in ready:
            return ready[policy]
        choices = " and ".join(repr(name) for name in ready)
        if policy in _name_policies():
            raise ValueError(f"{who}: {policy!r} needs the names of the tensors it applies to (marked with "
                             f"remat.tag): policy=remat.policies.{policy}('attn_out'); ready-made by name: {choices}.")
        close = difflib.get_close_matches(policy, [*ready, *_name_policies()], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{who}: no policy is named {policy!r}; {hint}the ready-made policies are {choices}, and "
                         f"{', '.join(f'remat.policies.{n}(...)' for n in _name_policies())} make one from tensor "
                         "names.")
    if callable(policy) or isinstance(policy, (list, tuple, set, frozenset)):
        return policy
    raise TypeError(f"{who}: policy must be the name of a ready-made policy ({' or '.join(map(repr, _ready_made()))}), "
                    "a policy such as remat.policies.save_names('attn_out'), a function (ctx, op, *args, **kwargs) -> "
                    f"CheckpointPolicy, or a list of ops whose outputs to keep; got {type(policy).__name__}.")


OFFLOAD_INPUTS_MIN_BYTES = 1 << 20
"""The smallest input ``offload_inputs=True`` moves: below it the copy costs more than the memory it frees (an
attention mask, position ids; Transformer Engine, Megatron and Unsloth set their floors near this)."""


def _input_offloader(offload_inputs: bool | int, args: tuple, kwargs: dict) -> offload | None:
    """The hooks the region's inputs are saved under when ``offload_inputs`` asks to move them, else None."""
    if offload_inputs is False:
        return None
    if offload_inputs is True:
        floor = OFFLOAD_INPUTS_MIN_BYTES
    elif isinstance(offload_inputs, int) and offload_inputs >= 0:
        floor = offload_inputs
    else:
        raise TypeError("remat.checkpoint: offload_inputs must be True, False or the smallest input to move in "
                        f"bytes (an int >= 0); got {offload_inputs!r}.")
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not inputs:
        return None
    return offload(min_bytes=floor, device_type=inputs[0].device.type)


def _partition(group: Any) -> PartitionInputs:
    """The hooks that shard a region's inputs over ``group`` (a process group, a 1-D mesh, or hooks already
    made, whose ``stats`` the caller reads)."""
    return group if isinstance(group, PartitionInputs) else PartitionInputs(group)


class _GlobalSwitch:
    """A global override that is set by a call and undone by leaving a ``with`` block."""

    value: bool | None = None

    def __init__(self, enabled: bool | None) -> None:
        cls = type(self)
        self._previous = cls.value
        cls.value = enabled

    def __enter__(self) -> _GlobalSwitch:
        return self

    def __exit__(self, *exc: object) -> None:
        type(self).value = self._previous

    @classmethod
    def resolve(cls, local: bool) -> bool:
        return local if cls.value is None else cls.value


class set_checkpoint_early_stop(_GlobalSwitch):  # noqa: N801 - drop-in name
    """Override ``early_stop`` for every checkpoint run in forward from now (or in a ``with`` block).

    Early stop ends a recomputation as soon as every tensor backward needs
    has been rebuilt.  The setting is read when the region's forward runs.

    Example:
        >>> with set_checkpoint_early_stop(False):
        ...     y = checkpoint(torch.sin, x)  # recomputes the whole function
        >>> set_checkpoint_early_stop(None)  # called bare: sets the global; None = per call
    """

    value: bool | None = None


class set_checkpoint_debug_enabled(_GlobalSwitch):  # noqa: N801 - drop-in name
    """Override ``debug`` for every checkpoint (``None`` defers to each call's own flag).

    Example:
        >>> with set_checkpoint_debug_enabled(True):
        ...     y = checkpoint(fn, x)  # a mismatch error will show operator traces
    """

    value: bool | None = None


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    policy: Any = None,
    offload_inputs: bool | int = False,
    partition_inputs: Any = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Drop-in for ``torch.utils.checkpoint.checkpoint``.  ``use_reentrant=None``
    (the default) selects the non-reentrant variant, silently.
    ``preserve_rng_state`` (default True) travels in ``kwargs`` as in PyTorch.
    ``policy`` (a :mod:`remat.policies` policy or its name, ``"save_matmuls"``,
    a policy function or a list of ops) selects what to keep, offload or
    recompute, op by op; it is sugar for
    ``context_fn=partial(create_selective_checkpoint_contexts, policy)``.
    Under ``torch.compile`` the region and its policy go into the compiled
    graph (see :mod:`remat.policies.compiled`).

    ``offload_inputs=True`` ("offloaded gradient checkpointing") also moves the
    inputs the region keeps for its recomputation to host memory: each input
    of at least :data:`OFFLOAD_INPUTS_MIN_BYTES` (an int sets another floor)
    is copied out on the copy engine's side stream as soon as forward saves it
    and copied back one region ahead in backward, when the region saved just
    after it is recomputed (:mod:`remat.policies.hostcopy`; pinned host buffers
    reused from step to step).  Gradients are bitwise those without it.  Leave
    it off on the last region of a chain: backward needs its inputs first, with
    no other region's backward to hide their copy back behind.  Not with
    ``use_reentrant=True``; under ``torch.compile`` the inputs stay on the
    device.

    ``partition_inputs=group`` (a process group or a 1-D ``DeviceMesh`` whose ranks all hold the region's inputs
    in full, as tensor parallel's are) keeps each rank's ``1/world`` slice of every input of 1 MiB and more,
    and all-gathers it whole in backward (:class:`~remat.policies.partition.PartitionInputs`; pass those hooks
    made with ``activations_only=True`` to keep whole the inputs that require no grad, such as rotary tables and
    masks every layer is handed).  Gradients are bitwise those without it.  Not with ``offload_inputs`` or
    ``use_reentrant=True``; under ``torch.compile`` the inputs are kept whole.

    Example:
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(block, x)
        >>> y.sum().backward()
        >>> z = remat.checkpoint(block, torch.randn(4, 8) * 2, offload_inputs=0)  # inputs go to host memory
        >>> z.sum().backward()
    """
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    if policy is not None:
        if context_fn is not noop_context_fn:
            raise ValueError("remat: pass either policy= or context_fn=, not both (a policy is a context_fn).")
        context_fn = functools.partial(create_selective_checkpoint_contexts, resolve_policy(policy))
    if use_reentrant:
        if kwargs:
            raise ValueError(
                f"remat: the reentrant checkpoint takes no keyword arguments for the function "
                f"(got {', '.join(kwargs)}); pass use_reentrant=False or bind them with functools.partial."
            )
        if context_fn is not noop_context_fn or debug or offload_inputs is not False:
            raise ValueError("remat: context_fn, policy, debug and offload_inputs need use_reentrant=False.")
        if partition_inputs is not None:
            raise ValueError("remat: partition_inputs needs use_reentrant=False.")
    metadata_fn = metadata_fn_for(determinism_check)
    if torch.compiler.is_compiling():
        # Traced by dynamo: the compiler rematerializes.  remat's engine must never be traced: its hooks and
        # dispatch modes would be baked into a graph that saves other tensors than the recomputation refills.
        return checkpoint_in_graph(function, args, kwargs, None if context_fn is noop_context_fn else context_fn)
    if use_reentrant:
        return CheckpointFunction.apply(function, preserve_rng_state, *args)
    if partition_inputs is not None and offload_inputs is not False:
        raise ValueError("remat.checkpoint: pass offload_inputs or partition_inputs, not both: an input is either "
                         "moved to host memory or kept as a shard.")
    offloader = _input_offloader(offload_inputs, args, kwargs) if partition_inputs is None else (
        _partition(partition_inputs))
    # The region saves its inputs before its own hooks take over: the offloader's hooks see those saves only.
    with offloader if offloader is not None else contextlib.nullcontext():
        result = run_nonreentrant(
            function,
            args,
            kwargs,
            preserve_rng_state=preserve_rng_state,
            context_fn=context_fn,
            metadata_fn=metadata_fn,
            debug=set_checkpoint_debug_enabled.resolve(debug),
            early_stop=set_checkpoint_early_stop.resolve(early_stop),
        )
    if isinstance(offloader, offload):
        # Its fetch in backward brings back as many tensors as it sent (the region saved just before is run
        # alike): the previous region's inputs, one region ahead.  Inputs an earlier region sent already (a
        # mask every layer takes) travel once and are not counted.
        stats = offloader.stats
        offloader.prefetch_depth = max(1, stats.offloaded_tensors - stats.shared_tensors)
    return result
