"""Named tensors: :func:`tag` marks a value inside a checkpointed region for name-based policies.

In eager mode the name is looked up in the active selective store, which remembers the op and call that
produced each recent output; under ``torch.compile`` the name annotates the producing graph node.
"""

from __future__ import annotations

import weakref

import torch

from .decisions import _OFFLOAD, _RECOMPUTE, _VIEW_OR_INPLACE, _action, _traits
from .kept import _keep
from .selective import _active_store

__all__ = ["tag"]


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
        from .compiled import tag_in_graph

        return tag_in_graph(tensor, name)
    store = _active_store()
    if store is None or store.recent is None:
        return tensor
    found = store.recent.get(id(tensor))
    if found is None or found[0]() is not tensor:
        return tensor
    decision = store.policy.decide_name(name)
    if decision is None:
        return tensor
    _, op, index, siblings = found
    if _traits(op) & _VIEW_OR_INPLACE:
        raise ValueError(
            f"remat.tag: {name!r} names the output of {op}, a view or in-place op whose memory belongs to "
            "another tensor; tag the tensor it was computed from (e.g. before reshape/transpose/unbind)."
        )
    slot = store.slots[id(op)]
    action = _action(decision)
    if action == _RECOMPUTE:
        slot.kept.pop(index, None)
        return tensor
    if siblings is None:
        output = tensor
    else:
        # A multi-output op (e.g. attention with its log-sum-exp) is served whole or rerun whole.
        output = tuple(ref() if isinstance(ref, weakref.ref) else ref for ref in siblings)
        if any(t is None for t in output):
            return tensor
    slot.kept[index] = _keep(output, action == _OFFLOAD)
    return tensor
