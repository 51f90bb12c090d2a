"""Determinism checks, debug traces and the error messages built from them.

The engine compares every recomputed tensor with what the forward saved in
its place.  This module decides *what* is compared (``determinism_check``),
records operator traces in debug mode, and turns a divergence into a
:class:`CheckpointError` that names the region, the tensor and, when traces
exist, the first operator that ran differently.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CheckpointError", "describe_function", "metadata_fn_for"]

Metadata = tuple[torch.Size, torch.dtype, torch.device]


class CheckpointError(RuntimeError):
    """A recomputation did not reproduce what the original forward saved.

    Example:
        >>> try:
        ...     raise CheckpointError("recomputed tensor 0 differs")
        ... except RuntimeError as e:
        ...     print(type(e).__name__)
        CheckpointError
    """


def _shape_dtype_device(x: torch.Tensor) -> Metadata:
    return (x.shape, x.dtype, x.device)


_CHECKS: dict[str, Callable[[torch.Tensor], Any] | None] = {
    "default": _shape_dtype_device,
    "none": None,
}


def metadata_fn_for(determinism_check: str) -> Callable[[torch.Tensor], Any] | None:
    """The function whose result must match between forward and recompute.

    Example:
        >>> metadata_fn_for("none") is None
        True
    """
    try:
        return _CHECKS[determinism_check]
    except (KeyError, TypeError):
        raise ValueError(
            f"determinism_check must be one of {sorted(_CHECKS)}, got {determinism_check!r}."
        ) from None


def describe_function(fn: Any) -> str:
    """A human name for a checkpointed callable: module class and path, or qualified name.

    Example:
        >>> describe_function(torch.nn.Linear(2, 2))
        'Linear module'
    """
    if isinstance(fn, functools.partial):
        return describe_function(fn.func)
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None:
        return describe_function(wrapped)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{describe_function(owner)} ({fn.__name__})"
    if isinstance(fn, torch.nn.Module):
        path = getattr(fn, "_remat_path", None)
        return f"{type(fn).__name__} module" + (f" at '{path}'" if path else "")
    qualname = getattr(fn, "__qualname__", None)
    if qualname is not None:
        module = getattr(fn, "__module__", None)
        return f"function {module}.{qualname}" if module else f"function {qualname}"
    return f"callable {type(fn).__name__}"


def _format_meta(meta: Any) -> str:
    if isinstance(meta, tuple) and len(meta) == 3:
        shape, dtype, device = meta
        return f"shape={tuple(shape)}, dtype={dtype}, device={device}"
    return repr(meta)


_PACKAGE_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def _user_location() -> str:
    """The innermost stack frame outside torch and remat: where the op was called."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRS):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class OpTrace(TorchDispatchMode):
    """Records each operator run under it, with its output shapes and call site.

    Example:
        >>> with OpTrace() as trace:
        ...     _ = torch.ones(2) * 2
        >>> trace.ops[-1][0]
        'aten.mul.Tensor'
    """

    # detach calls differ between forward and recompute by design of the engine.
    _IGNORED = frozenset({"aten.detach.default"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name not in self._IGNORED:
            self.ops.append((name, _user_location()))
        return out

    def __enter__(self) -> OpTrace:
        super().__enter__()
        return self


def first_op_divergence(forward: list[tuple[str, str]], recompute: list[tuple[str, str]],
                        complete: bool) -> int | None:
    """Index of the first operator that differs; a stopped recompute is compared as a prefix."""
    for i in range(min(len(forward), len(recompute))):
        if forward[i][0] != recompute[i][0]:
            return i
    if complete and len(forward) != len(recompute):
        return min(len(forward), len(recompute))
    return None


def _side_by_side(forward: list[tuple[str, str]], recompute: list[tuple[str, str]]) -> str:
    width = max([len(f"{op} @ {where}") for op, where in forward] + [24])
    first_diff = first_op_divergence(forward, recompute, complete=False)
    lines = [f"     {'#':>4}  {'original forward':<{width}}  recomputation", "     " + "-" * (width + 30)]
    for i in range(max(len(forward), len(recompute))):
        left = "{} @ {}".format(*forward[i]) if i < len(forward) else ""
        right = "{} @ {}".format(*recompute[i]) if i < len(recompute) else "(not run)"
        mark = ">>>  " if i == first_diff else "     "
        lines.append(f"{mark}{i:>4}  {left:<{width}}  {right}")
    if first_diff is None:
        lines.append(
            "     (same operators in the same order: the values or shapes flowing into them differ, "
            "e.g. from global state read by the function)"
        )
    else:
        lines.insert(
            0,
            f"first diverging operator: #{first_diff}: forward ran {forward[first_diff][0]} at "
            f"{forward[first_diff][1]}, recomputation ran {recompute[first_diff][0]} at "
            f"{recompute[first_diff][1]}",
        )
    return "\n".join(lines)


_DEBUG_TIP = (
    "Pass debug=True to checkpoint() (or use remat.set_checkpoint_debug_enabled(True)) to see the "
    "operators of the forward and the recomputation side by side, with the first divergence marked."
)

_CAUSES = (
    "The checkpointed function must compute the same thing when it is run again in backward. Common "
    "causes: it reads global state or Python attributes that changed after forward, takes a branch "
    "that depends on data or a step counter, or mutates its inputs."
)


class Divergence:
    """What went wrong in a recomputation, turned into an error on demand."""

    __slots__ = ("kind", "index", "expected", "got", "producer", "forward_count", "recompute_count")

    def __init__(self, kind: str, **fields: Any) -> None:
        self.kind = kind
        for name in self.__slots__[1:]:
            setattr(self, name, fields.get(name))

    def to_error(self, fn: Any, traces: tuple[OpTrace, OpTrace] | None) -> CheckpointError:
        region = describe_function(fn)
        if self.kind == "operators":
            head = (
                f"remat: recomputing {region} ran different operators than the original forward "
                f"(first difference at operator #{self.index}); its saved tensors kept their shapes, "
                "so only debug mode can see this."
            )
        elif self.kind == "metadata":
            head = (
                f"remat: recomputing {region} produced a different tensor at saved position "
                f"{self.index}:\n  forward saved:      {_format_meta(self.expected)}\n"
                f"  recompute produced: {_format_meta(self.got)}"
                + (f" (made by {self.producer})" if self.producer else "")
            )
        elif self.kind == "more":
            head = (
                f"remat: recomputing {region} saved more tensors than the original forward "
                f"({self.forward_count} in forward)."
            )
        else:
            head = (
                f"remat: recomputing {region} saved fewer tensors than the original forward "
                f"(forward: {self.forward_count}, recomputation: {self.recompute_count})."
            )
        body = _side_by_side(traces[0].ops, traces[1].ops) if traces else _DEBUG_TIP
        return CheckpointError(f"{head}\n{_CAUSES}\n{body}")
