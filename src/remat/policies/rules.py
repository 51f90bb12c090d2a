"""Ready-made selective-checkpointing policies: small rules that combine with ``|``.

A :class:`Policy` has up to three parts, each a small pure function:

* an *op rule* ``(op) -> CheckpointPolicy | None``: what to do with the
  output of an operator (``None``: no opinion);
* a *call rule* ``(op, index) -> CheckpointPolicy | None``: what to do with the
  ``index``-th call (from 0) of ``op`` in the region; it overrides the op rule
  for that call (a per-call plan is a dict lookup here);
* a *name rule* ``(name) -> CheckpointPolicy | None``: what to do with a
  tensor marked by :func:`remat.tag`; it overrides the other rules for that tensor.

remat asks the op rule once per operator and region, and the call rule once
per call, with no per-call context object; a plain ``policy_fn`` is asked per
call with the PyTorch signature.

``a | b`` (or :func:`combine`) asks both and takes the stronger answer:
``MUST_*`` beats ``PREFER_*``, and at equal strength keeping beats offloading
beats recomputing.  With no opinion at all the output is recomputed.

Example:
    >>> policy = save_matmuls | offload_names("attn_probs")
    >>> y = remat.checkpoint(block, x, policy=policy)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .decisions import CheckpointPolicy, SelectiveCheckpointContext, _ops

__all__ = [
    "MATMUL_OPS",
    "Policy",
    "combine",
    "is_collective",
    "offload_names",
    "save_all_but_names",
    "save_collectives",
    "save_matmuls",
    "save_names",
    "save_nothing",
]

Decision = CheckpointPolicy | None

_P = CheckpointPolicy
_RANK = {
    _P.PREFER_RECOMPUTE: 0, _P.PREFER_CPU_OFFLOAD: 1, _P.PREFER_SAVE: 2,
    _P.MUST_RECOMPUTE: 3, _P.MUST_CPU_OFFLOAD: 4, _P.MUST_SAVE: 5,
}


def _stronger(a: Decision, b: Decision) -> Decision:
    if a is None or b is None:
        return a if b is None else b
    return a if _RANK[a] >= _RANK[b] else b


def _no_opinion(_: Any) -> Decision:
    return None


class Policy:
    """A selective-checkpointing policy; callable as a PyTorch-style ``policy_fn``.

    Example:
        >>> keep_mm = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default
        ...                  else None, name="keep mm")
    """

    def __init__(
        self,
        op_rule: Callable[[Any], Decision] = _no_opinion,
        name_rule: Callable[[str], Decision] = _no_opinion,
        name: str = "policy",
        call_rule: Callable[[Any, int], Decision] | None = None,
    ) -> None:
        self.op_rule = op_rule
        self.name_rule = name_rule
        self.call_rule = call_rule
        self.name = name

    @property
    def by_call(self) -> bool:
        """Whether decisions depend on the call index, not only on the operator."""
        return self.call_rule is not None

    @property
    def has_names(self) -> bool:
        """Whether :func:`remat.tag` names can change a decision (only then does remat track outputs)."""
        return self.name_rule is not _no_opinion

    def decide(self, op: Any, index: int) -> CheckpointPolicy:
        """The decision for the ``index``-th call of ``op`` in a region (``index`` matters to call rules only)."""
        decision = self.call_rule(op, index) if self.call_rule is not None else None
        return decision or self.op_rule(op) or CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.call_rule is not None:
            raise TypeError(
                f"{self!r} decides by call index, which only remat's create_selective_checkpoint_contexts "
                "counts; use remat.checkpoint(..., policy=...) rather than torch.utils.checkpoint."
            )
        return self.op_rule(op) or CheckpointPolicy.PREFER_RECOMPUTE

    def decide_name(self, name: str) -> Decision:
        """The decision for a tensor tagged ``name`` (None: keep the op rule's)."""
        return self.name_rule(name)

    def __or__(self, other: Policy) -> Policy:
        return combine(self, other)

    def __repr__(self) -> str:
        return f"<remat policy {self.name}>"


def combine(*policies: Policy) -> Policy:
    """One policy that asks each of ``policies`` and takes the strongest answer.

    Example:
        >>> both = combine(save_matmuls, save_names("x"))
    """

    def op_rule(op: Any) -> Decision:
        decision = None
        for p in policies:
            decision = _stronger(decision, p.op_rule(op))
        return decision

    def name_rule(name: str) -> Decision:
        decision = None
        for p in policies:
            decision = _stronger(decision, p.name_rule(name))
        return decision

    def call_rule(op: Any, index: int) -> Decision:
        # Each policy's own answer for this call (its call rule, else its op rule), strongest wins.
        decision = None
        for p in policies:
            own = p.call_rule(op, index) if p.call_rule is not None else None
            decision = _stronger(decision, own or p.op_rule(op))
        return decision

    return Policy(
        op_rule,
        name_rule if any(p.has_names for p in policies) else _no_opinion,
        name=" | ".join(p.name for p in policies),
        call_rule=call_rule if any(p.by_call for p in policies) else None,
    )


#: Operators whose outputs ``save_matmuls`` keeps: the expensive, compute-bound ones.
MATMUL_OPS = frozenset(
    _ops(
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "matmul", "linear", "_int_mm",
        "convolution", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math", "_scaled_mm",
    )
)

_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})


def is_collective(op: Any) -> bool:
    """Whether ``op`` (an operator, or its name as ``"_c10d_functional.all_reduce.default"``) is a functional
    collective or its wait (what tensor parallel's DTensor redistributions run).

    Rerunning one in recomputation sends the bytes over the wire again, and every rank must then rerun it in the
    same order; keeping its output costs only its bytes.

    Example:
        >>> is_collective(torch.ops._c10d_functional.all_reduce.default), is_collective(torch.ops.aten.mm.default)
        (True, False)
    """
    namespace, name = (op.split(".")[0], op.split(".")[1]) if isinstance(op, str) else (
        getattr(op, "namespace", None), getattr(op, "__name__", "_"))
    return namespace in _COLLECTIVE_NAMESPACES and not name.startswith("_")


save_nothing = Policy(name="save_nothing")
save_nothing.__doc__ = "Recompute everything: the same as plain checkpointing."

save_collectives = Policy(
    op_rule=lambda op: CheckpointPolicy.PREFER_SAVE if is_collective(op) else None,
    name="save_collectives",
)
save_collectives.__doc__ = """Keep what crossed the wire: the outputs of collectives (:func:`is_collective`), so a
checkpointed block's backward issues no more collectives than without checkpointing.  Combine it with other rules:
``save_collectives | save_names("attn_out")``; :data:`save_matmuls` already includes it."""

save_matmuls = Policy(
    op_rule=lambda op: CheckpointPolicy.PREFER_SAVE if op in MATMUL_OPS or is_collective(op) else None,
    name="save_matmuls",
)
save_matmuls.__doc__ = """Keep the outputs of matmul-like ops (:data:`MATMUL_OPS`) and of collectives
(:data:`save_collectives`); recompute the cheap rest."""


def _by_name(label: str, decision: CheckpointPolicy, names: tuple[str, ...]) -> Policy:
    chosen = frozenset(names)
    return Policy(name_rule=lambda n: decision if n in chosen else None, name=f"{label}{names}")


def save_names(*names: str) -> Policy:
    """Keep the tensors tagged with one of ``names``; recompute the rest.

    Example:
        >>> policy = save_names("attn_out", "mlp_in")
    """
    return _by_name("save_names", CheckpointPolicy.MUST_SAVE, names)


def offload_names(*names: str) -> Policy:
    """Keep the tensors tagged with one of ``names`` in host memory; recompute the rest.

    Example:
        >>> policy = save_matmuls | offload_names("attn_probs")
    """
    return _by_name("offload_names", CheckpointPolicy.MUST_CPU_OFFLOAD, names)


def save_all_but_names(*names: str) -> Policy:
    """Keep every op output except the tensors tagged with one of ``names``.

    Example:
        >>> policy = save_all_but_names("big_intermediate")
    """
    chosen = frozenset(names)
    return Policy(
        op_rule=lambda op: CheckpointPolicy.PREFER_SAVE,
        name_rule=lambda n: CheckpointPolicy.MUST_RECOMPUTE if n in chosen else None,
        name=f"save_all_but_names{tuple(names)}",
    )
