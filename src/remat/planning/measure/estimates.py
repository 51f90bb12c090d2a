"""Op times where none is measured (the meta device, ``timing="estimate"``): what one rank's op costs.

A compute op costs the larger of its FLOPs / ``throughput`` and the bytes it reads and writes / the memory's
``bandwidth``, both counted on the rank's local shards where its tensors are DTensors (a column-wise layer's matmul
does ``1 / n`` of the whole one's work on each of ``n`` ranks); a collective costs what crossing the interconnect
costs (:mod:`remat.planning.measure.interconnect`).

Example:
    >>> a = torch.empty(1024, 1024, device="meta")
    >>> estimator(100e12, 2e12)(torch.ops.aten.mm.default, (a, a), {}, a @ a)   # 2 x 1024^3 FLOPs at 100 TFLOP/s
    2.147483648e-05
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ...policies.rules import is_collective
from ..basics.ranks import local
from .interconnect import Interconnect

__all__ = ["estimator", "rank_flop_formulas"]


def rank_flop_formulas() -> dict[Any, Callable[..., int]]:
    """torch's FLOP formulas (``torch.utils.flop_counter``), each counting on the local shards of its DTensor
    arguments: what this rank computes.  For ``FlopCounterMode(custom_mapping=...)``, which otherwise counts a
    DTensor op at the whole tensors' shapes.

    Example:
        >>> with FlopCounterMode(display=False, custom_mapping=rank_flop_formulas()) as flops:
        ...     tp_model(tokens).sum().backward()
    """
    from torch.utils.flop_counter import flop_registry

    return {packet: _on_local_shards(formula) for packet, formula in flop_registry.items()}


def _on_local_shards(formula: Callable[..., int]) -> Callable[..., int]:
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        args, kwargs, out_val = tree_map(_local, (args, kwargs, out_val))
        return formula(*args, **kwargs, out_val=out_val)

    count._get_raw = True  # FlopCounterMode passes it the tensors, not their (whole) shapes
    return count


def _local(x: Any) -> Any:
    return local(x) if isinstance(x, torch.Tensor) else x


def estimator(throughput: float, bandwidth: float, interconnect: Interconnect | None = None
              ) -> Callable[[Any, tuple, dict, Any], float]:
    """A function of an op call (``func, args, kwargs, out``) to its estimated seconds: a collective's over
    ``interconnect`` (default: :class:`Interconnect`'s defaults), any other op's the larger of its FLOPs /
    ``throughput`` and the bytes it reads and writes / ``bandwidth``.

    Example:
        >>> estimate = estimator(100e12, 2e12)
        >>> estimate(torch.ops.aten.mm.default, (a, b), {}, a @ b)
    """
    link, formulas = interconnect or Interconnect(), rank_flop_formulas()

    def estimate(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        if is_collective(func):
            return link.op_seconds(func, args, kwargs)
        count = formulas.get(func._overloadpacket)
        flops = count(*args, **kwargs, out_val=out) if count is not None else 0
        moved = sum(_nbytes(t) for t in _tensors((args, kwargs, out)))
        return max(flops / throughput, moved / bandwidth)

    return estimate


def _tensors(tree: Any) -> list[torch.Tensor]:
    # A DTensor as the part this rank holds, as the op graph counts it.
    return [local(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
