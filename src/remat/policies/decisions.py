"""What a policy's decision means, and the facts about operators that decisions depend on.

:class:`CheckpointPolicy` (the drop-in enum) and :class:`SelectiveCheckpointContext` are what a policy
function sees and returns.  The selective engine turns each decision into a small int action and asks each
operator once for its traits (view or in-place, random, random and writing one tensor in place).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy as _TorchCheckpointPolicy

__all__ = ["SAC_IGNORED_OPS", "CheckpointPolicy", "SelectiveCheckpointContext"]


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

    __slots__ = ("is_recompute", "op_output")

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


# What the modes do with one call. Plain ints: the dispatch path compares them per operator.
_RECOMPUTE, _KEEP, _OFFLOAD, _IGNORE, _ASK_FUNCTION, _ASK_CALL = range(6)


# Decisions by identity (enum members are singletons; hashing an Enum runs Python code).
_ACTION_BY_ID: dict[int, int] = {}


def _register_decisions(enum_class: Any) -> None:
    for member in enum_class:
        name = member.name
        action = _KEEP if name.endswith("_SAVE") else _OFFLOAD if name.endswith("_OFFLOAD") else _RECOMPUTE
        _ACTION_BY_ID[id(member)] = action


_register_decisions(CheckpointPolicy)


_register_decisions(_TorchCheckpointPolicy)


def _action(decision: Any) -> int:
    action = _ACTION_BY_ID.get(id(decision))
    if action is not None:
        return action
    if decision is True or decision is False:
        return _KEEP if decision else _RECOMPUTE
    return _ACTION_BY_ID[id(CheckpointPolicy.coerce(decision))]  # raises a clear error on anything else


# Per-operator facts, by id (operators live as long as the process): bit 1 = view or
# in-place, bit 2 = random, bit 4 = random and writing one tensor in place (kept by value).
_TRAITS: dict[int, int] = {}


_VIEW_OR_INPLACE, _RANDOM, _RANDOM_WRITE = 1, 2, 4


def _traits(op: Any) -> int:
    traits = _TRAITS.get(id(op))
    if traits is None:
        schema = getattr(op, "_schema", None)
        # Views own no memory and in-place ops return their (already kept or
        # recomputed) input: keeping either would only alias another entry.
        aliasing = schema is not None and any(r.alias_info is not None for r in schema.returns)
        random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
        # A random in-place op is the exception: what it wrote cannot be recomputed without drawing.
        random_write = random and aliasing and len(schema.returns) == 1 and _written_argument(op) is not None
        traits = _TRAITS[id(op)] = ((_VIEW_OR_INPLACE if aliasing else 0) | (_RANDOM if random else 0)
                                    | (_RANDOM_WRITE if random_write else 0))
    return traits


def _is_view_or_inplace(op: Any) -> bool:
    return bool(_traits(op) & _VIEW_OR_INPLACE)


def _is_random_write(op: Any) -> bool:
    """Whether ``op`` is a random in-place op writing one tensor, which a policy may keep by value."""
    return bool(_traits(op) & _RANDOM_WRITE)


@functools.cache
def _written_argument(op: Any) -> tuple[int, str] | None:
    """(position, name) of the one tensor argument ``op`` writes in place, or None (none or several)."""
    written = [(i, a.name) for i, a in enumerate(op._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    return written[0] if len(written) == 1 else None
