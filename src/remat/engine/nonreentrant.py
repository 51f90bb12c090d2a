"""The non-reentrant engine: saved-tensor hooks, placeholders and a frame per region.

How it works, in four steps:

1. Forward runs the region with grad enabled under a *pack* hook that hands
   autograd a tiny :class:`_Placeholder` instead of each tensor it wants to
   save.  The region's tensor inputs are saved by a no-op autograd node
   (:class:`_InputSaver`), so they live exactly as long as the graph needs
   them and in-place changes to them trip autograd's version check.
2. The first *unpack* of an empty placeholder during a backward reruns the region
   (same RNG, same autocast) under a second pack hook that files each
   recomputed tensor against the placeholder with the same index.
3. Recomputed tensors belong to that backward (graph task).  Each is released
   when it is unpacked, and whatever is left is dropped when the backward
   ends; a second backward (``retain_graph=True``) recomputes again.
4. With early stop the recomputation is interrupted as soon as the last
   placeholder still alive has been refilled.

Nesting needs no special code: an inner region's inputs are saved through
the outer region's hook (so they become outer placeholders), and refilling
them reruns the outer region, which meets the inner checkpoint again.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._autograd import _pop_saved_tensors_default_hooks, _push_saved_tensors_default_hooks
from torch.utils import _pytree as pytree

from .checks import CheckpointError, Divergence, OpTrace, describe_function, first_op_divergence
from .replay import ReplayState

__all__ = ["GraphExecGroup", "detached", "run_nonreentrant"]

_CONSUMED = object()
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_current_graph_task_id = torch._C._current_graph_task_id


class _StopRecompute(BaseException):
    """Unwinds a recomputation once it has produced what backward needs.

    A BaseException so that a broad ``except Exception`` in user code cannot
    swallow it.
    """


class _Placeholder:
    """What autograd stores instead of a saved tensor: its position in the region."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


class _InputSaver(torch.autograd.Function):
    """A no-op node that keeps the region's tensor inputs as saved tensors."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty(0)  # not from the anchor: an op reading it would be a tensor from outside a region

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("remat internal error: the input-saving node is never differentiated.")


# _InputSaver needs one input that requires grad for autograd to record it.
_ANCHOR = torch.empty(0, requires_grad=True)


def _drop_refill(frame_ref: weakref.ref[_Frame], key: int) -> None:
    frame = frame_ref()
    if frame is not None:
        frame.refills.pop(key, None)


def _identity(x: Any) -> Any:
    return x


_python_dispatch_off = torch._C._DisableTorchDispatch
_dispatch_modes = torch._C._len_torch_dispatch_stack


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``, unseen by the dispatch modes active (a selective policy's): a saved tensor a hook
    keeps is not one of the region's ops, and must not cost a trip through Python per saved tensor.

    Example:
        >>> value = detached(saved)   # in a pack hook, under any mode
    """
    if type(t) in _PLAIN and _dispatch_modes():
        with _python_dispatch_off():
            return t.detach()
    return t.detach()  # no mode to hide from, or a subclass, which keeps its own detach


def _is_plain(value: Any) -> bool:
    return not isinstance(value, (list, tuple, dict))


class GraphExecGroup:
    """Backward calls inside one group recompute each checkpointed region at most once.

    Use it when several ``backward``/``autograd.grad`` calls cover disjoint
    parts of one graph: without a group each call is its own backward and
    reruns the regions it touches.  Groups cannot be nested.

    Example:
        >>> x = torch.randn(4, requires_grad=True)
        >>> a, b = remat.checkpoint(lambda t: (t.sin(), t.cos()), x)
        >>> with GraphExecGroup():
        ...     torch.autograd.grad(a.sum(), x)
        ...     torch.autograd.grad(b.sum(), x)
    """

    def __init__(self) -> None:
        self._frames: list[weakref.ref[_Frame]] = []

    def __enter__(self) -> GraphExecGroup:
        if _get_group() is not None:
            raise RuntimeError(
                "remat.GraphExecGroup: groups cannot be nested; leave the current group first."
            )
        _set_group(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _set_group(None)
        for ref in self._frames:
            frame = ref()
            if frame is not None:
                frame.refills.pop(self, None)
        self._frames.clear()


if hasattr(torch._C, "_set_graph_exec_group"):
    # Share torch's slot: it travels with autograd's thread-local state into
    # device threads, and torch's own checkpoint sees our groups too.
    _get_group = torch._C._get_graph_exec_group
    _set_group = torch._C._set_graph_exec_group
else:
    _group_slot: list[Any] = [None]

    def _get_group() -> Any:
        return _group_slot[0]

    def _set_group(group: Any) -> None:
        _group_slot[0] = group


class _Frame:
    """Everything one checkpointed call needs to rerun itself in backward."""

    __slots__ = (
        "fn", "leaves", "tensor_positions", "spec", "input_node", "state", "recompute_context",
        "metadata_fn", "early_stop", "traces", "placeholders", "metas", "forward_done", "refills", "__weakref__",
    )

    def __init__(self, fn, recompute_context, metadata_fn, early_stop, traces) -> None:
        self.fn = fn
        self.state: ReplayState | None = None  # captured once the inputs are known
        self.recompute_context = recompute_context
        self.metadata_fn = metadata_fn
        self.early_stop = early_stop
        self.traces = traces
        self.placeholders: list[weakref.ref[_Placeholder]] = []
        self.metas: list[Any] = []
        self.forward_done = False
        # graph task id (or GraphExecGroup) -> recomputed tensors, by placeholder index
        self.refills: dict[Any, list[Any]] = {}

    # ---- inputs -------------------------------------------------------------
    def save_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if not kwargs and all(map(_is_plain, args)):
            leaves, self.spec = list(args), None
        else:
            leaves, self.spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        for i in positions:
            leaves[i] = None
        self.leaves, self.tensor_positions = leaves, positions
        self.input_node = _InputSaver.apply(_ANCHOR, *tensors) if tensors else None
        return tensors

    def _input_tensors(self) -> tuple[torch.Tensor, ...]:
        # Once per recomputation (an input saved through an outer region is unpacked from it); raises
        # autograd's own error if an input was modified in place.
        return self.input_node.grad_fn.saved_tensors if self.input_node is not None else ()

    def _inputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_positions, tensors):
            leaves[i] = t
        if self.spec is None:
            return tuple(leaves), {}
        return pytree.tree_unflatten(leaves, self.spec)

    # ---- forward hook -------------------------------------------------------
    def make_pack_hook(self) -> Callable[[Any], _Placeholder]:
        """The forward pack hook, with everything it touches bound as locals (it runs per saved tensor)."""
        placeholders, new_ref, remember = self.placeholders, weakref.ref, self.placeholders.append
        metadata_fn, keep_metadata = self.metadata_fn, self.metas.append

        def pack(x: torch.Tensor) -> _Placeholder:
            index = len(placeholders)
            placeholder = _Placeholder(index)
            remember(new_ref(placeholder))
            if metadata_fn is not None:
                keep_metadata(metadata_fn(x))
            return placeholder

        return pack

    def unpack(self, placeholder: _Placeholder) -> torch.Tensor:
        key = _get_group()
        if key is None:
            key = _current_graph_task_id()
            if key == -1:
                # Unpacked outside any backward (e.g. reading grad_fn._saved_*):
                # nothing to share the result with, so recompute just for this.
                return self._recompute()[placeholder.index]
        refill = self.refills.get(key)
        if refill is None:
            refill = self.refills[key] = self._recompute()
            if isinstance(key, int):
                # Weakly: the frame must be free to die as soon as its part of the graph has run.
                _queue_callback(functools.partial(_drop_refill, weakref.ref(self), key))
            elif isinstance(key, GraphExecGroup):
                key._frames.append(weakref.ref(self))
        index = placeholder.index
        value = refill[index] if index < len(refill) else None
        if value is None or value is _CONSUMED:
            raise self._unpack_error(value, key)
        refill[index] = _CONSUMED
        return value

    def _unpack_error(self, value: Any, key: Any) -> RuntimeError:
        region = describe_function(self.fn)
        if value is _CONSUMED:
            extra = (
                " Inside a GraphExecGroup, two backward calls may not need the same saved tensor."
                if not isinstance(key, int)
                else " A custom autograd.Function should read ctx.saved_tensors only once per backward."
            )
            return CheckpointError(f"remat: a tensor saved in {region} was unpacked twice in one backward.{extra}")
        return CheckpointError(
            f"remat: a tensor saved in {region} was not refilled by its recomputation (internal state "
            "was lost; this is a bug in remat, please report it)."
        )

    # ---- recomputation ------------------------------------------------------
    def _recompute(self) -> list[Any]:
        count = len(self.placeholders)
        stop_at = count
        if self.early_stop:
            # Placeholders released by an earlier partial backward need no refill.
            while stop_at and self.placeholders[stop_at - 1]() is None:
                stop_at -= 1
        inputs = self._input_tensors()
        refill = _Refill(self)
        args, kwargs = self._inputs(inputs)
        trace = self.traces[1] if self.traces else None
        _push_saved_tensors_default_hooks(refill.make_pack_hook(stop_at if self.early_stop else -1), _identity)
        try:
            with torch.enable_grad(), self.state.replay(), self.recompute_context:
                if trace is None:
                    self.fn(*args, **kwargs)
                else:
                    trace.ops.clear()
                    with trace:
                        self.fn(*args, **kwargs)
        except _StopRecompute:
            pass
        except BaseException as error:
            # Same exception, same type; the note says it came from a recomputation in backward.
            error.add_note(f"(raised while remat was recomputing {describe_function(self.fn)} for backward)")
            raise
        finally:
            _pop_saved_tensors_default_hooks()
        refill.finish()
        return refill.tensors


class _Refill:
    """The recomputation's pack hook: files each saved tensor under its placeholder index."""

    __slots__ = ("frame", "tensors", "seen", "divergence", "stopped")

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame
        self.tensors: list[Any] = [None] * len(frame.placeholders)
        self.seen = 0
        self.divergence: Divergence | None = None
        self.stopped = False

    def make_pack_hook(self, stop_at: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The pack hook of one recomputation; ``stop_at`` < 0 disables early stop."""
        frame, tensors, count = self.frame, self.tensors, len(self.tensors)
        placeholders, metas, metadata_fn, forward_done = (
            frame.placeholders, frame.metas, frame.metadata_fn, frame.forward_done
        )

        def pack(recomputed: torch.Tensor) -> torch.Tensor:
            # Keep only the value: holding the recompute graph would keep all of it alive.
            x = detached(recomputed) if recomputed.requires_grad else recomputed
            index = self.seen
            self.seen = index + 1
            if index < count:
                if placeholders[index]() is not None:
                    if metadata_fn is not None and metadata_fn(x) != metas[index]:
                        grad_fn = recomputed.grad_fn
                        self._stop(Divergence("metadata", index=index, expected=metas[index], got=metadata_fn(x),
                                              producer=grad_fn.name() if grad_fn is not None else None))
                    tensors[index] = x
                if index + 1 == stop_at:
                    self._stop(None)
            elif forward_done:
                self._stop(Divergence("more", forward_count=count))
            # else: backward was called inside the still-running forward; the rest
            # of the region runs but saved nothing yet that needs a refill.
            return x

        return pack

    def _stop(self, divergence: Divergence | None) -> None:
        self.divergence = divergence
        self.stopped = True
        raise _StopRecompute

    def finish(self) -> None:
        frame = self.frame
        if self.divergence is None and not self.stopped and frame.forward_done and self.seen < len(self.tensors):
            self.divergence = Divergence("fewer", forward_count=len(self.tensors), recompute_count=self.seen)
        if self.divergence is None and frame.traces is not None and frame.forward_done:
            forward_ops, recompute_ops = frame.traces[0].ops, frame.traces[1].ops
            index = first_op_divergence(forward_ops, recompute_ops, complete=not self.stopped)
            if index is not None:
                self.divergence = Divergence("operators", index=index)
        if self.divergence is not None:
            raise self.divergence.to_error(frame.fn, frame.traces)


def run_nonreentrant(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
    metadata_fn: Callable[[torch.Tensor], Any] | None,
    debug: bool,
    early_stop: bool,
) -> Any:
    """Run ``fn`` as a non-reentrant checkpointed region (see the module docstring)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    forward_context, recompute_context = context_fn()
    traces = (OpTrace(), OpTrace()) if debug else None
    frame = _Frame(fn, recompute_context, metadata_fn, early_stop, traces)
    tensors = frame.save_inputs(args, kwargs)
    frame.state = state = ReplayState.capture(tensors, preserve_rng_state, fn)
    result = _NO_RESULT = object()
    _push_saved_tensors_default_hooks(frame.make_pack_hook(), frame.unpack)
    try:
        with forward_context:
            if traces is None:
                result = fn(*args, **kwargs)
            else:
                with traces[0]:
                    result = fn(*args, **kwargs)
    finally:
        _pop_saved_tensors_default_hooks()
    if result is _NO_RESULT:
        raise RuntimeError(
            "remat: the forward context returned by context_fn swallowed an exception raised by the "
            "checkpointed function; checkpoint has no value to return. Let the exception propagate."
        )
    frame.forward_done = True
    state.forward_done()
    if preserve_rng_state:
        state.check_device_not_initialized_by("a checkpointed function")
    return result
