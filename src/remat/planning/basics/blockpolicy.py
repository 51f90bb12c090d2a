"""Install one op-level decision per block: keep exactly these op outputs, recompute the rest.

A :class:`BlockPolicy` is what a block's point on its front of op-level
policies turns into when it is applied (see :mod:`remat.planning.choices.fronts`): a mode and
a readable list of :class:`OpDecision` — ``(op, call index, bytes,
decision)``.  The call index counts the calls of that op overload within one
run of the block, so two matmuls of one block can get different decisions.

Modes:

* ``keep``: the block runs as is (plain autograd keeps what it saves); with ``offload`` entries, the saved
  tensors those op calls made go to host memory behind the forward and come back ahead of its backward
  (:class:`remat.offload` with ``outputs_of``): nothing is recomputed;
* ``checkpoint``: plain checkpointing, no per-op dispatch at all;
* ``selective``: checkpointing with a selective-checkpoint policy that keeps
  the ``keep`` entries, moves the ``offload`` entries to host memory until the
  recomputation is served them (on an accelerator), and recomputes everything
  else.  The policy is a per-op lookup in a precomputed table of call indices,
  with a counter per op that starts afresh in every checkpointed call of the block.

:func:`measure_overheads` measures, on this host, what the checkpoint
machinery itself costs (per region, per saved tensor, per op dispatched under
a policy in forward and in recomputation); the front's cost model adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ...api.modules import ActivationWrapper, checkpoint_wrapper, offload_wrapper
from ...policies.decisions import CheckpointPolicy
from ...policies.rules import Policy
from ...policies.selective import create_selective_checkpoint_contexts
from .units import format_bytes

__all__ = [
    "MODES",
    "BlockPolicy",
    "OpDecision",
    "apply_block_policies",
    "remove_block_policies",
    "resolve_op",
]

MODES = ("keep", "checkpoint", "selective")
_SAVE = CheckpointPolicy.MUST_SAVE
_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD
_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
_DECISIONS = {"keep": _SAVE, "offload": _OFFLOAD, "recompute": None}


def resolve_op(name: str) -> torch._ops.OpOverload:
    """The operator overload named like ``str(op)``: ``"aten.addmm.default"``.

    Example:
        >>> resolve_op("aten.addmm.default") is torch.ops.aten.addmm.default
        True
    """
    parts = name.split(".")
    try:
        if len(parts) != 3:
            raise AttributeError(name)
        namespace, packet, overload = parts
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"remat: no operator named {name!r}; write it as namespace.op.overload, e.g. 'aten.addmm.default' "
            "(load the library that defines custom ops before loading the policy)."
        ) from None


@dataclass(frozen=True)
class OpDecision:
    """What one op output of a block gets: ``decision`` is ``"keep"``, ``"offload"`` or ``"recompute"``."""

    op: str
    call: int
    bytes: int
    decision: str


class BlockPolicy:
    """One block's op-level decisions, ready to install; JSON-friendly through :meth:`to_dict`.

    Example:
        >>> policy = BlockPolicy("selective", [OpDecision("aten.addmm.default", 0, 3 << 20, "keep")])
        >>> block = policy.wrap(block)            # keeps the first addmm's output, recomputes the rest
        >>> BlockPolicy.from_dict(policy.to_dict()).kept == policy.kept
        True
    """

    def __init__(self, mode: str, decisions: list[OpDecision] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"remat: unknown block policy mode {mode!r}; choose from {list(MODES)}.")
        decisions = list(decisions or [])
        bad = [d for d in decisions if d.decision not in _DECISIONS]
        if bad:
            raise ValueError(f"remat: an op decision must be one of {list(_DECISIONS)}, got {bad[0].decision!r}.")
        allowed = {"selective": set(_DECISIONS), "keep": {"recompute", "offload"}}.get(mode, {"recompute"})
        if any(d.decision not in allowed for d in decisions):
            raise ValueError(f"remat: a {mode!r} block policy keeps no op outputs by choice"
                             + (" (it keeps all it saves); give it only 'offload' entries, or" if mode == "keep"
                                else " and offloads none;") + " use mode='selective'.")
        self.mode = mode
        self.decisions = decisions
        table: dict[Any, dict[int, CheckpointPolicy]] = {}
        for d in decisions:
            if d.decision != "recompute":
                table.setdefault(resolve_op(d.op), {})[d.call] = _DECISIONS[d.decision]
        self._table = table

        def call_rule(op: Any, index: int) -> CheckpointPolicy | None:
            calls = table.get(op)
            return calls.get(index) if calls is not None else None

        # A rules policy: asked once per op and call index, with no context object built per call.
        self.rules = Policy(call_rule=call_rule, name=f"{mode} block, {len(self.kept)} kept")

    @property
    def kept(self) -> list[tuple[str, int]]:
        """The ``(op, call index)`` pairs this policy keeps."""
        return [(d.op, d.call) for d in self.decisions if d.decision == "keep"]

    @property
    def kept_bytes(self) -> int:
        """Bytes of the kept op outputs (as profiled)."""
        return sum(d.bytes for d in self.decisions if d.decision == "keep")

    @property
    def offloaded_ops(self) -> dict[torch._ops.OpOverload, set[int]]:
        """``{op overload: call indices}`` of the op outputs moved to host memory (``outputs_of`` of
        :class:`remat.offload`)."""
        table: dict[torch._ops.OpOverload, set[int]] = {}
        for d in self.decisions:
            if d.decision == "offload":
                table.setdefault(resolve_op(d.op), set()).add(d.call)
        return table

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the op outputs moved to host memory (as profiled)."""
        return sum(d.bytes for d in self.decisions if d.decision == "offload")

    def policy_fn(self) -> Callable[..., CheckpointPolicy]:
        """A fresh policy function for one checkpointed call (its call counters start at zero).

        Only the ops that have kept calls are counted; the policy is asked
        about every call of such an op in forward, so its count is the call index.

        Example:
            >>> y = remat.checkpoint(block, x, policy=policy.policy_fn())  # for one call only
        """
        table = self._table
        counts = dict.fromkeys(table, 0)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            calls = table.get(op)
            if calls is None:
                return _RECOMPUTE
            index = counts[op]
            counts[op] = index + 1
            return calls.get(index, _RECOMPUTE)

        return policy

    def context_fn(self) -> tuple[Any, Any]:
        """The ``(forward, recompute)`` contexts for one checkpointed call, with fresh counters.

        Example:
            >>> y = remat.checkpoint(block, x, context_fn=policy.context_fn)
        """
        return create_selective_checkpoint_contexts(self.rules)

    def wrap(self, module: nn.Module, **offload_kwargs: Any) -> nn.Module:
        """``module`` set up to run under this policy (``keep``: the module itself, or with ``offload`` entries
        the module under an offloader moving those op outputs, made with ``offload_kwargs``: see
        :class:`remat.offload`).

        Example:
            >>> wrapped = BlockPolicy("checkpoint").wrap(model.blocks[0])
            >>> moving = BlockPolicy("keep", [OpDecision("aten.mm.default", 4, 88 << 20, "offload")]).wrap(layer)
        """
        if self.mode == "keep":
            if not any(d.decision == "offload" for d in self.decisions):
                return module
            wrapper = offload_wrapper(module, outputs_of=self.offloaded_ops, **offload_kwargs)
            wrapper._remat_block_policy = self
            return wrapper
        wrapper = checkpoint_wrapper(module) if self.mode == "checkpoint" else checkpoint_wrapper(
            module, context_fn=self.context_fn)
        wrapper._remat_block_policy = self
        return wrapper

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"mode": ..., "ops": [{"op", "call", "bytes", "decision"}, ...]}``.

        Example:
            >>> json.dump(policy.to_dict(), open("block0.json", "w"))
        """
        return {"mode": self.mode, "ops": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockPolicy:
        """Rebuild a policy written by :meth:`to_dict`.

        Example:
            >>> BlockPolicy.from_dict({"mode": "checkpoint", "ops": []}).mode
            'checkpoint'
        """
        try:
            return cls(data["mode"], [OpDecision(d["op"], int(d["call"]), int(d["bytes"]), d["decision"])
                                      for d in data.get("ops", [])])
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"remat: not a block policy ({error!r}); expected {{'mode': ..., 'ops': [{{'op', 'call', 'bytes', "
                "'decision'}, ...]}} as written by BlockPolicy.to_dict()."
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockPolicy) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        moved = f", {format_bytes(self.offloaded_bytes)} offloaded" if self.offloaded_bytes else ""
        return f"<BlockPolicy {self.mode}: {len(self.kept)} kept op outputs, {format_bytes(self.kept_bytes)}{moved}>"

    def __str__(self) -> str:
        lines = [f"{self.mode}: keeps {len(self.kept)} op outputs ({format_bytes(self.kept_bytes)})"]
        lines += [f"  {d.decision:<9} {d.op}#{d.call}  {format_bytes(d.bytes)}" for d in self.decisions]
        return "\n".join(lines)


def _locate(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module]:
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, ActivationWrapper):
            parent = parent._checkpoint_wrapped_module
        return parent, child, getattr(parent, child)
    except AttributeError:
        raise ValueError(f"remat: no module named {name!r} in {type(model).__name__}.") from None


def apply_block_policies(model: nn.Module, policies: Mapping[str, BlockPolicy]) -> nn.Module:
    """Install one :class:`BlockPolicy` per named block, in place (re-applying replaces). Returns ``model``.

    Example:
        >>> apply_block_policies(model, {"blocks.0": policy, "blocks.1": BlockPolicy("checkpoint")})
    """
    for name, policy in policies.items():
        parent, child, current = _locate(model, name)
        inner = current._checkpoint_wrapped_module if isinstance(current, ActivationWrapper) else current
        setattr(parent, child, policy.wrap(inner))
    return model


def remove_block_policies(model: nn.Module, names: list[str]) -> nn.Module:
    """Undo :func:`apply_block_policies` for ``names``. Returns ``model``.

    Example:
        >>> remove_block_policies(model, ["blocks.0", "blocks.1"])
    """
    for name in names:
        parent, child, current = _locate(model, name)
        if isinstance(current, ActivationWrapper):
            setattr(parent, child, current._checkpoint_wrapped_module)
    return model

