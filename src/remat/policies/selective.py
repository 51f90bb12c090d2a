"""Selective activation checkpointing: a policy decides, op by op, what to keep.

Inside a checkpointed region every operator's output is either *saved* (kept
from forward and handed back in recomputation instead of running the op
again), *offloaded* (saved in host memory, brought back to its device when
recomputation needs it) or *recomputed*.  Two dispatch modes implement it:
:class:`_Recorder` runs in forward and keeps what the policy asks for;
:class:`_Replayer` runs in recomputation and serves those outputs to the
same calls, matched by operator and call index.
``create_selective_checkpoint_contexts`` returns the pair for
``checkpoint(..., context_fn=...)``.

Every call decides for itself.  Each forward runs under the recording mode and
asks the policy about each of its own ops; its recomputation is served what
that forward kept, matched by the op and call index that forward saw, and
nothing else.  No record outlives the call that made it, so a region whose
Python code, hooks, submodules or numbers change between calls is recorded
afresh each time (torch.compile is the route that reuses a trace, behind its
guards; see :mod:`.compiled`).

Lifetime of a kept output: it is released as soon as a recomputation has
served it, unless the backward keeps its graph (``retain_graph=True``), in
which case it stays for the next backward.  Anything a later recomputation
finds released is simply recomputed, so several backward calls over parts of
one graph work without ``retain_graph``.

Random ops: a kept output of a random op is served like any other, and the
generator it drew from is put where forward left it (a snapshot of its state
taken right after the op ran: the op's ``generator=`` or the default generator
of its device, CPU or CUDA), so the random ops rerun after it draw what they
drew in forward.  Random ops on other devices are served but still rerun, for
their RNG advance only.  In-place random ops that write one tensor
(``bernoulli_``, ``uniform_``, ``normal_``, ... — dropout's mask on CPU) are
asked like any other op and kept *by value*: forward keeps a copy of what the
op wrote (the region may change that storage later, e.g. dropout's ``div_``),
recomputation copies it back into the op's target and returns the target
instead of drawing.  Offloading such a draw keeps its copy in host memory.  The
snapshot is host memory too (5056 bytes for the CPU generator, 16 for CUDA)
and not counted in kept bytes.  A recomputation that set a generator's state
puts it back as it found it when it ends.  Other in-place ops and views are
never kept: they own no memory of their own.

In-place changes: a kept output that the region itself modifies in place is
not kept (it is recomputed, and the in-place op replayed on it, which is what
plain autograd computes); that is detected from its version counter when the
region's forward ends.  A kept output modified *after* forward is an error in
recomputation, or with ``allow_cache_entry_mutation=True`` is recomputed
instead of served, so gradients are never computed from a modified value.
An offloaded output is a copy in host memory, so later changes cannot reach it.

Offloaded outputs go through the device's copy engine (:mod:`.hostcopy`), on a
side stream: the region's end makes the device (never the host) wait for its
copies out, and a recomputation starts copying back what it will be served,
which comes back with the strides and alignment forward gave it.

Differences from PyTorch 2.13 worth knowing: CPU_OFFLOAD really offloads in
eager mode; ``retain_graph=True`` and partial backward calls work; a kept
random op is served with its generator set where forward left it, so the
random ops rerun after it draw exactly as in forward, and in-place random ops
(dropout's mask) can be kept, by value; an output modified in place by the
region needs no special flag; and outputs can be selected by name with
:func:`remat.tag` (a random op's output kept by name is served, but its op
still reruns for its draw).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .decisions import (
    _ASK_CALL,
    _ASK_FUNCTION,
    _IGNORE,
    _OFFLOAD,
    _RANDOM,
    _RANDOM_WRITE,
    _RECOMPUTE,
    _VIEW_OR_INPLACE,
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    _action,
    _traits,
)
from .kept import _Draw, _keep, _keep_draw, _Kept, _KeptOutputs, _prefetch, _settle, _unprefetch
from .offload import OffloadStats

__all__ = ["create_selective_checkpoint_contexts"]


class _OpSlot:
    """One operator in one region: its calls in forward and in the running recomputation, what it keeps."""

    __slots__ = ("op", "action", "random", "calls", "replayed", "kept")

    def __init__(self, op: Any, action: int) -> None:
        self.op = op
        self.action = action  # _IGNORE, _RECOMPUTE, _KEEP, _OFFLOAD, or ask per call
        self.random = bool(_traits(op) & _RANDOM)
        self.calls = 0
        self.replayed = 0
        self.kept: dict[int, _Kept | _KeptOutputs | _Draw] = {}  # call index -> kept output


class _Store:
    """What one region keeps, shared by its two modes."""

    def __init__(self, policy: Callable, allow_mutation: bool, stats: OffloadStats | None) -> None:
        from .rules import Policy

        self.policy = policy
        self.allow_mutation = allow_mutation
        self.stats = stats
        self.slots: dict[int, _OpSlot] = {}  # by id(op)
        self.offloads = False  # whether anything was kept for offloading
        # Generators whose state kept draws hold: a replay that serves them restores these when it ends.
        self.generators: dict[int, torch.Generator] = {}
        # A Policy is asked through its rules (no context object, op rule once per operator);
        # anything else, a subclass with its own __call__ included, with PyTorch's signature.
        self.by_rules = isinstance(policy, Policy) and type(policy).__call__ is Policy.__call__
        # id(output tensor) -> (weakref to it, op, call index, the op's outputs as weakrefs or None):
        # lets tag() re-decide the call that made a tensor. Only kept for policies with name rules.
        self.recent: dict[int, tuple[weakref.ref, Any, int, Any]] | None = (
            {} if getattr(policy, "has_names", False) else None
        )

    def first_sight(self, op: Any) -> _OpSlot:
        """The slot of an operator this region has not run yet, with what is known of it without asking."""
        if op in SAC_IGNORED_OPS:
            action = _IGNORE
        elif _traits(op) & _VIEW_OR_INPLACE and not _traits(op) & _RANDOM_WRITE:
            action = _RECOMPUTE
        elif not self.by_rules:
            action = _ASK_FUNCTION
        elif self.policy.by_call:
            action = _ASK_CALL
        else:
            action = _action(self.policy.decide(op, 0))
        slot = self.slots[id(op)] = _OpSlot(op, action)
        return slot

    def ask(self, slot: _OpSlot, index: int, args: tuple, kwargs: dict, out: Any) -> int:
        if slot.action == _ASK_CALL:
            return _action(self.policy.decide(slot.op, index))
        context = SelectiveCheckpointContext(is_recompute=False, op_output=out)
        return _action(self.policy(context, slot.op, *args, **kwargs))

    def forward_done(self) -> None:
        """Drop kept outputs the region modified in place (they are recomputed), settle the offloaded ones'
        copies, then count the rest."""
        for slot in self.slots.values():
            if slot.kept:
                for index in [i for i, kept in slot.kept.items() if kept.modified()]:
                    del slot.kept[index]
        if self.offloads:
            _settle(self.stashed())
        if self.stats is not None:
            for slot in self.slots.values():
                for kept in slot.kept.values():
                    for tensor in kept.tensors():
                        self.stats.add(tensor.nbytes, offloaded=tensor.offloaded)

    def stashed(self) -> list[_Kept]:
        """The kept tensors that live in host memory."""
        return [tensor for slot in self.slots.values() for kept in slot.kept.values()
                for tensor in kept.tensors() if tensor.stashed is not None]

    def keep(self, slot: _OpSlot, index: int, args: tuple, kwargs: dict, out: Any, offload: bool) -> None:
        self.offloads |= offload
        if not slot.random:
            slot.kept[index] = _keep(out, offload)
            return
        kept = _keep_draw(slot.op, args, kwargs, out, offload)
        if kept is None:
            return
        if isinstance(kept, _Draw):
            self.generators[id(kept.generator)] = kept.generator
        slot.kept[index] = kept

    def release_all(self) -> None:
        for slot in self.slots.values():
            if slot.kept:
                slot.kept = {}


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
        store = self.store
        if store.recent is not None:
            store.recent.clear()  # tag() only applies inside the forward
        try:
            store.forward_done()
        finally:
            super().__exit__(*exc)

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **kwargs) if kwargs else op(*args)
        store = self.store
        slot = store.slots.get(id(op))
        if slot is None:
            slot = store.first_sight(op)
        action = slot.action
        if action == _IGNORE:
            return out
        index = slot.calls
        slot.calls = index + 1
        if action >= _ASK_FUNCTION:
            action = store.ask(slot, index, args, kwargs or {}, out)
        if action != _RECOMPUTE:
            store.keep(slot, index, args, kwargs or {}, out, action == _OFFLOAD)
        if store.recent is not None:
            _remember(store.recent, out, op, index)
        return out


def _remember(recent: dict, out: Any, op: Any, index: int) -> None:
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    refs = tuple(weakref.ref(t) if isinstance(t, torch.Tensor) else t for t in outputs)
    for t, ref in zip(outputs, refs):
        if isinstance(t, torch.Tensor):
            recent[id(t)] = (ref, op, index, refs if outputs is out else None)


_current_graph_task_id = torch._C._current_graph_task_id
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


class _Replayer(TorchDispatchMode):
    """Recomputation: serve kept outputs to the calls that made them, run everything else."""

    def __init__(self, store: _Store) -> None:
        super().__init__()
        self.store = store
        self.release = False
        self.rng_before: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> _Replayer:
        self._begin()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._end()
        return super().__exit__(*exc)

    def _begin(self) -> None:
        for slot in self.store.slots.values():
            slot.replayed = 0  # each recomputation replays from the start
        # A backward that frees its graph can run this region's recomputation only once
        # per part of the graph; anything needed again later is recomputed.
        self.release = _current_graph_task_id() != -1 and not _keeps_graph()
        # Serving a draw sets its generator's state; the caller's RNG must not notice.
        self.rng_before = [(g, g.get_state()) for g in self.store.generators.values()]
        if self.store.offloads:
            _prefetch(self.store.stashed())

    def _end(self) -> None:
        for generator, state in self.rng_before:
            generator.set_state(state)
        self.rng_before = []
        if self.store.offloads:
            _unprefetch(self.store.stashed())
        if self.release:
            # Outputs not served (recomputation stopped early) can never be needed: a later
            # recomputation stops at the same place or sooner.
            self.store.release_all()

    def _take(self, slot: _OpSlot, index: int) -> _Kept | _KeptOutputs | _Draw | None:
        """The kept output of call ``index`` to serve, or None to run the call (nothing kept, or it changed in
        place since forward and the policy allows recomputing it)."""
        kept = slot.kept.get(index) if slot.kept else None
        if kept is None:
            return None
        if kept.modified():
            if not self.store.allow_mutation:
                raise self._modified(slot.op)
            # Recomputing gives the value forward saw, which serving the modified one would not
            # (a random op draws it again: the RNG is where forward had it, as every draw before is).
            del slot.kept[index]
            return None
        if self.release:
            del slot.kept[index]
        return kept

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        slot = self.store.slots.get(id(op))
        if slot is None:
            slot = self._unseen(op)
        if slot.action == _IGNORE:
            return op(*args, **kwargs) if kwargs else op(*args)
        index = slot.replayed
        if index >= slot.calls:
            raise self._diverged(op, index)
        slot.replayed = index + 1
        kept = self._take(slot, index)
        if kept is None:
            return op(*args, **kwargs) if kwargs else op(*args)
        if type(kept) is _Draw:
            return kept.serve(self.release, args, kwargs or {})
        if slot.random:
            # A draw whose generator is unknown runs again so the RNG advances as in forward.
            op(*args, **kwargs) if kwargs else op(*args)
        return kept.serve(take=self.release)

    def _unseen(self, op: Any) -> _OpSlot:
        if op in SAC_IGNORED_OPS:
            return self.store.first_sight(op)
        raise self._diverged(op, 0)

    @staticmethod
    def _diverged(op: Any, index: int) -> RuntimeError:
        return RuntimeError(
            f"remat: recomputation ran {op} (call #{index}) which the original forward did not run; the "
            "checkpointed function must run the same operators both times."
        )

    @staticmethod
    def _modified(op: Any) -> RuntimeError:
        return RuntimeError(
            f"remat: the output of {op} kept by a selective-checkpoint policy was modified in place after "
            "forward, so it no longer holds the value the gradients need. Stop modifying it (clone it first), "
            "or pass allow_cache_entry_mutation=True to create_selective_checkpoint_contexts and remat will "
            "recompute that output instead of serving it."
        )


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable[..., Any] | list,
    allow_cache_entry_mutation: bool = False,
    *,
    stats: OffloadStats | None = None,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The ``(forward, recompute)`` context pair for ``checkpoint(context_fn=...)``.

    ``policy_fn_or_list`` is a function ``(ctx, op, *args, **kwargs) ->
    CheckpointPolicy`` (or bool: True = save), a :mod:`remat.policies` policy, or
    a list of ``OpOverload``\\ s to save.  ``allow_cache_entry_mutation=True``
    turns the error about a kept output modified in place after forward into a
    recomputation of that output.  Pass ``stats=OffloadStats()`` to count what
    the policy kept and offloaded.

    Example:
        >>> import functools
        >>> ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
        >>> y = remat.checkpoint(fn, x, context_fn=ctx)
    """
    if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
        from .rules import Policy

        for op in policy_fn_or_list:
            if isinstance(op, torch._ops.OpOverloadPacket):
                raise ValueError(
                    f"remat: {op} is an OpOverloadPacket; list a specific overload instead, "
                    f"e.g. torch.ops.{op._qualified_op_name.replace('::', '.')}.default."
                )
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                raise ValueError(f"remat: expected OpOverloads in the op list, got {op!r} ({type(op).__name__}).")
        listed = frozenset(policy_fn_or_list)
        policy = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE if op in listed else None, name="op list")
    elif callable(policy_fn_or_list):
        policy = policy_fn_or_list
    else:
        raise TypeError("remat: policy_fn_or_list must be a policy function or a list of ops.")
    store = _Store(policy, allow_cache_entry_mutation, stats)
    return _Recorder(store), _Replayer(store)
