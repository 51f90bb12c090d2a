"""A plan: one decision per candidate block, as plain data that installs itself on a model.

:class:`Plan` carries each block's decision (and a selective block's op-level decisions), the predicted
peak and extra time, and what was planned for.  ``apply`` wraps the planned modules in place,
``remove`` undoes it, ``save``/``load`` round-trip it through JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from ..api.modules import ActivationWrapper, checkpoint_wrapper, offload_wrapper
from ..policies.rules import save_matmuls
from .blockpolicy import BlockPolicy
from .units import format_bytes


@dataclass
class Plan:
    """One decision per candidate module, with the predicted peak and extra time.

    ``decisions`` maps each module's qualified name to its option; a ``selective`` block's op-level
    decisions are in ``policies`` (``{"mode", "ops": [{"op", "call", "bytes", "decision"}, ...]}``, see
    :class:`~remat.planning.blockpolicy.BlockPolicy`), and ``blocks`` holds what ``print(plan)`` shows per block.
    Everything is plain data: :meth:`save` writes it as JSON and :meth:`load` reads it back, ready to apply.

    Example:
        >>> p = prof.plan(0.5); p.save("plan.json")
        >>> remat.Plan.load("plan.json").apply(model)
    """

    decisions: dict[str, str]
    predicted_peak: int
    predicted_extra_time: float
    budget: int
    baseline_peak: int
    param_bytes: int
    step_time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {}  # per module: installers of custom options

    def _installer(self, name: str, decision: str) -> tuple[Callable[[nn.Module], nn.Module], Any]:
        """How to install ``name``'s decision, and what identifies it (to skip modules already installed)."""
        if name in self.policies:
            policy = BlockPolicy.from_dict(self.policies[name])
            return policy.wrap, (decision, policy.to_dict())
        wrap = self._wrappers.get(name) or _WRAPPERS.get(decision)
        if wrap is None:
            raise ValueError(f"remat.Plan.apply: no way to install {decision!r} on {name}: a plan loaded from "
                             "JSON knows only the built-in options and op-level policies; rebuild it from the "
                             "profile and options.")
        return wrap, (decision, None)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the planned modules in place (idempotent; a changed plan re-wraps). Returns ``model``.

        Example:
            >>> plan.apply(model)
        """
        for name, decision in self.decisions.items():
            parent, child, current = _locate(model, name)
            wrapped = isinstance(current, ActivationWrapper)
            inner = current._checkpoint_wrapped_module if wrapped else current
            if decision == "keep":
                setattr(parent, child, inner)
                continue
            wrap, identity = self._installer(name, decision)
            if wrapped and getattr(current, "_remat_decision", None) == identity:
                continue
            inner._remat_path = name
            wrapper = wrap(inner)
            wrapper._remat_decision = identity
            setattr(parent, child, wrapper)
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`. Returns ``model``.

        Example:
            >>> plan.remove(model)
        """
        for name in self.decisions:
            parent, child, current = _locate(model, name)
            if isinstance(current, ActivationWrapper):
                setattr(parent, child, current._checkpoint_wrapped_module)
        return model

    def save(self, path: str) -> None:
        """Write the plan as JSON keyed by module qualified names.

        Example:
            >>> plan.save("plan.json")
        """
        with open(path, "w") as f:
            json.dump({f.name: getattr(self, f.name) for f in fields(self)}, f, indent=2)

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by :meth:`save`.

        Example:
            >>> remat.Plan.load("plan.json").apply(model)
        """
        with open(path) as f:
            return cls(**json.load(f))

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for decision in self.decisions.values():
            counts[decision] = counts.get(decision, 0) + 1
        width = max([len(n) for n in self.decisions] + [6])
        lines = [f"{'module':<{width}}  {'decision':<12} {'kept':>10} {'extra ms':>9} {'ops rerun':>9}  keeps",
                 "-" * (width + 60)]
        for name, decision in self.decisions.items():
            block = self.blocks.get(name, {})
            kept = format_bytes(block["kept"]) if "kept" in block else ""
            extra = f"{block['extra_time'] * 1e3:.1f}" if "extra_time" in block else ""
            rerun = str(block.get("recomputed_ops", ""))
            lines.append(f"{name:<{width}}  {decision:<12} {kept:>10} {extra:>9} {rerun:>9}  "
                         f"{_kept_ops(self.policies.get(name))}".rstrip())
        summary = ", ".join(f"{count} {option}" for option, count in counts.items() if count)
        above = self.predicted_peak - self.param_bytes
        base_above = self.baseline_peak - self.param_bytes
        lines.append(
            f"{summary}. Predicted peak {format_bytes(self.predicted_peak)} (budget {format_bytes(self.budget)}; "
            f"{format_bytes(above)} above parameters vs {format_bytes(base_above)} without a plan); "
            f"predicted extra time {self.predicted_extra_time * 1e3:.1f} ms per step"
            + (f" (+{self.predicted_extra_time / self.step_time:.0%})" if self.step_time else "")
        )
        return "\n".join(lines)


def _kept_ops(policy: dict[str, Any] | None, shown: int = 4) -> str:
    """The largest op outputs a selective policy keeps, as ``op#call``."""
    if not policy:
        return ""
    kept = sorted((d for d in policy["ops"] if d["decision"] == "keep"), key=lambda d: -d["bytes"])
    names = [f"{d['op'].split('.')[1]}#{d['call']}" for d in kept[:shown]]
    more = f" +{len(kept) - shown} more" if len(kept) > shown else ""
    return ", ".join(names) + more


def _locate(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module]:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, ActivationWrapper):
        parent = parent._checkpoint_wrapped_module
    return parent, child, getattr(parent, child)


_WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint": checkpoint_wrapper,
    "save_matmuls": lambda m: checkpoint_wrapper(m, policy=save_matmuls),
    "offload": offload_wrapper,
}
