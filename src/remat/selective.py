"""Selective activation checkpointing: a policy decides, op by op, what to keep.

Inside a checkpointed region every operator's output is either *saved* (kept
from forward and handed back in recomputation instead of running the op
again), *offloaded* (saved in host memory, brought back to its device when
recomputation needs it) or *recomputed*.  Two dispatch modes implement it:
:class:`_Recorder` runs in forward and keeps what the policy asks for;
:class:`_Replayer` runs in recomputation and serves those outputs in the same
order.  ``create_selective_checkpoint_contexts`` returns the pair for
``checkpoint(..., context_fn=...)``.

Differences from PyTorch 2.13 worth knowing: CPU_OFFLOAD really offloads in
eager mode; kept outputs stay valid for every backward of the graph (so
``retain_graph=True`` works); random ops are always rerun in recomputation so
the RNG advances exactly as in forward; and outputs can be selected by name
with :func:`remat.tag`.
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .offload import OffloadStats

__all__ = [
    "SAC_IGNORED_OPS",
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "create_selective_checkpoint_contexts",
    "tag",
]


class CheckpointPolicy(enum.Enum):
    """What to do with one operator's output. ``MUST_*`` may not be overridden by other systems."""

    # Same member names as torch's enum (drop-in); a policy may return either enum.
    MUST_SAVE = enum.auto()
    PREFER_SAVE = enum.auto()
    MUST_RECOMPUTE = enum.auto()
    PREFER_RECOMPUTE = enum.auto()
    MUST_CPU_OFFLOAD = enum.auto()
    PREFER_CPU_OFFLOAD = enum.auto()

    @classmethod
    def coerce(cls, decision: Any) -> CheckpointPolicy:
        """Accept this enum, torch's ``CheckpointPolicy`` or a bool (True = save)."""
        if isinstance(decision, cls):
            return decision
        if isinstance(decision, bool):
            return cls.MUST_SAVE if decision else cls.PREFER_RECOMPUTE
        name = getattr(decision, "name", None)
        if name in cls.__members__:
            return cls[name]
        # ValueError, not TypeError: torch's operator wrappers turn a TypeError into NotImplemented.
        raise ValueError(f"remat: a checkpoint policy must return a CheckpointPolicy or a bool, got {decision!r}.")

    @property
    def keeps(self) -> bool:
        return self in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

    @property
    def offloads(self) -> bool:
        return self in (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)


class SelectiveCheckpointContext:
    """Passed to a policy function with each operator: ``is_recompute`` and the op's output.

    Example:
        >>> def policy(ctx, op, *args, **kwargs):
        ...     return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else \\
        ...         CheckpointPolicy.PREFER_RECOMPUTE
    """

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


def _ops(*names: str) -> set:
    found = set()
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is not None and hasattr(packet, overload or "default"):
            found.add(getattr(packet, overload or "default"))
    return found


# Ops never subject to a policy: detach calls differ between forward and
# recompute by design, and metadata queries have no output worth keeping.
SAC_IGNORED_OPS: set = _ops("detach", "sym_size.int", "sym_stride.int", "sym_numel", "sym_storage_offset") | {
    torch.ops.prim.device.default
}


_RECOMPUTE = object()


class _Kept:
    """A kept output: its value (maybe in host memory), device and version at save time."""

    __slots__ = ("value", "device", "version", "offloaded")

    def __init__(self, value: torch.Tensor, device: torch.device, offloaded: bool) -> None:
        self.value = value
        self.device = device
        self.version = value._version
        self.offloaded = offloaded

    def get(self, allow_mutation: bool, op: Any) -> torch.Tensor:
        if not allow_mutation and self.value._version != self.version:
            raise RuntimeError(
                f"remat: the output of {op} kept by a selective-checkpoint policy was modified in place "
                "after forward, so recomputation would see the modified value. Stop mutating it, make the "
                "policy recompute that op, or pass allow_cache_entry_mutation=True if the change is intended."
            )
        if self.value.device != self.device:
            return self.value.to(self.device, non_blocking=True)
        return _alias(self.value)


def _alias(t: torch.Tensor) -> torch.Tensor:
    # Inside a dispatch mode we run below ADInplaceOrView, where detach() would
    # get a fresh version counter; re-enable the key so the alias shares it
    # and in-place changes to the original stay visible.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _keep(out: Any, offload: bool) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        value = _alias(t)
        if offload and value.device.type != "cpu":
            pin = torch.cuda.is_available() and value.device.type == "cuda"
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
            value = host.copy_(value, non_blocking=pin)
        return _Kept(value, t.device, offload)

    return tree_map(one, out)


@functools.cache
def _is_view_or_inplace(op: Any) -> bool:
    # Views own no memory and in-place ops return their (already kept or
    # recomputed) input: keeping either would only alias another entry.
    return any(r.alias_info is not None for r in op._schema.returns)


@functools.cache
def _is_random(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


class _Store:
    """Outputs kept by one region, by op and call index, shared by its two modes."""

    def __init__(self, policy: Callable, allow_mutation: bool, stats: OffloadStats | None) -> None:
        self.policy = policy
        self.allow_mutation = allow_mutation
        self.stats = stats
        self.entries: dict[Any, list[Any]] = defaultdict(list)
        # id(output tensor) -> (weakref to it, op, call index, weakrefs to all the op's outputs):
        # lets tag() re-decide the entry of the op that made a tensor
        self.recent: dict[int, tuple[weakref.ref, Any, int, Any]] = {}

    def count(self) -> None:
        """Add what this region keeps and offloads to the stats, once its forward is over."""
        if self.stats is None:
            return
        for calls in self.entries.values():
            for entry in calls:
                for kept in _leaves(entry):
                    self.stats.count(kept.value, offloaded=kept.offloaded)


def _leaves(entry: Any) -> list[_Kept]:
    if isinstance(entry, _Kept):
        return [entry]
    if isinstance(entry, (tuple, list)):
        return [k for item in entry for k in _leaves(item)]
    return []


_recording = threading.local()


def _active_store() -> _Store | None:
    stack = getattr(_recording, "stack", None)
    return stack[-1] if stack else None


class _Recorder(TorchDispatchMode):
    """Forward: run each op, ask the policy, keep its output when told to."""

    def __init__(self, store: _Store) -> None:
        super().__init__()
        self.store = store

    def __enter__(self) -> _Recorder:
        _recording.__dict__.setdefault("stack", []).append(self.store)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _recording.stack.pop()
        self.store.recent.clear()  # tag() only applies inside the forward
        self.store.count()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = op(*args, **kwargs)
        if op in SAC_IGNORED_OPS:
            return out
        store = self.store
        calls = store.entries[op]
        decision = CheckpointPolicy.PREFER_RECOMPUTE
        if not _is_view_or_inplace(op):
            decision = CheckpointPolicy.coerce(
                store.policy(SelectiveCheckpointContext(is_recompute=False, op_output=out), op, *args, **kwargs)
            )
        index = len(calls)
        calls.append(_keep(out, decision.offloads) if decision.keeps or decision.offloads else _RECOMPUTE)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        refs = tuple(weakref.ref(t) if isinstance(t, torch.Tensor) else t for t in outputs)
        for t, ref in zip(outputs, refs):
            if isinstance(t, torch.Tensor):
                store.recent[id(t)] = (ref, op, index, refs if outputs is out else None)
        return out


class _Replayer(TorchDispatchMode):
    """Recomputation: serve kept outputs in forward order, run everything else."""

    def __init__(self, store: _Store) -> None:
        super().__init__()
        self.store = store
        self.counters: dict[Any, int] = defaultdict(int)

    def __enter__(self) -> _Replayer:
        self.counters.clear()  # each recomputation replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op in SAC_IGNORED_OPS:
            return op(*args, **kwargs)
        index = self.counters[op]
        self.counters[op] = index + 1
        calls = self.store.entries.get(op)
        if calls is None or index >= len(calls):
            raise RuntimeError(
                f"remat: recomputation ran {op} (call #{index}) which the original forward did not run; the "
                "checkpointed function must run the same operators both times."
            )
        entry = calls[index]
        if entry is _RECOMPUTE or _is_random(op):
            # Random ops always run, so the RNG advances exactly as in forward.
            out = op(*args, **kwargs)
            if entry is _RECOMPUTE:
                return out
        allow = self.store.allow_mutation
        return tree_map(lambda k: k.get(allow, op) if isinstance(k, _Kept) else k, entry)


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``tensor`` inside a checkpointed region so name-based policies can keep it.

    Returns ``tensor`` itself: identity in value and gradient, and free when
    no selective policy is active.

    Example:
        >>> def block(x):
        ...     h = remat.tag(x @ w, "proj")
        ...     return h.relu()
        >>> remat.checkpoint(block, x, policy=remat.policies.save_names("proj"))
    """
    if torch.compiler.is_compiling():
        from .compiled import tag_in_graph  # imported here: compiled.py builds on this module

        return tag_in_graph(tensor, name)
    store = _active_store()
    if store is None:
        return tensor
    decide = getattr(store.policy, "decide_name", None)
    found = store.recent.get(id(tensor))
    if decide is None or found is None or found[0]() is not tensor:
        return tensor
    decision = decide(name)
    if decision is None:
        return tensor
    _, op, index, siblings = found
    if _is_view_or_inplace(op):
        raise ValueError(
            f"remat.tag: {name!r} names the output of {op}, a view or in-place op whose memory belongs to "
            "another tensor; tag the tensor it was computed from (e.g. before reshape/transpose/unbind)."
        )
    if not (decision.keeps or decision.offloads):
        store.entries[op][index] = _RECOMPUTE
        return tensor
    if siblings is None:
        output = tensor
    else:
        # A multi-output op (e.g. attention with its log-sum-exp) is served whole or rerun whole.
        output = tuple(ref() if isinstance(ref, weakref.ref) else ref for ref in siblings)
        if any(t is None for t in output):
            return tensor
    store.entries[op][index] = _keep(output, decision.offloads)
    return tensor


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable[..., Any] | list,
    allow_cache_entry_mutation: bool = False,
    *,
    stats: OffloadStats | None = None,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``(forward, recompute)`` context pair for ``checkpoint(context_fn=...)``.

    ``policy_fn_or_list`` is a function ``(ctx, op, *args, **kwargs) ->
    CheckpointPolicy`` (or bool: True = save), or a list of ``OpOverload``\\ s to
    save.  Pass ``stats=OffloadStats()`` to count what the policy kept and offloaded.

    Example:
        >>> import functools
        >>> ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        >>> y = remat.checkpoint(fn, x, context_fn=ctx)
    """
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        to_save = set()
        for op in policy_fn_or_list:
            if isinstance(op, torch._ops.OpOverloadPacket):
                raise ValueError(
                    f"remat: {op} is an OpOverloadPacket; list a specific overload instead, "
                    f"e.g. torch.ops.{op._qualified_op_name.replace('::', '.')}.default."
                )
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                raise ValueError(f"remat: expected OpOverloads in the op list, got {op!r} ({type(op).__name__}).")
            to_save.add(op)

        def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in to_save else CheckpointPolicy.PREFER_RECOMPUTE

    elif callable(policy_fn_or_list):
        policy = policy_fn_or_list
    else:
        raise TypeError("remat: policy_fn_or_list must be a policy function or a list of ops.")
    store = _Store(policy, allow_cache_entry_mutation, stats)
    return _Recorder(store), _Replayer(store)
