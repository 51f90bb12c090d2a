"""Why no plan fits a budget, in the terms the budget was asked in: :class:`InfeasibleBudget`.

Example:
    >>> try:
    ...     prof.plan(0.01)
    ... except InfeasibleBudget as refused:
    ...     print(refused.smallest, refused.parts)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..basics.units import format_bytes

__all__ = ["InfeasibleBudget"]


class InfeasibleBudget(ValueError):
    """No plan fits the budget.

    ``budget`` and ``smallest`` are whole-step peaks in bytes (parameters and buffers included, as
    ``Plan.predicted_peak``); ``smallest`` is the lowest peak any plan reaches. The message states both above
    parameters as well, the terms a fractional budget such as ``0.5`` or ``"50%"`` is given in.  Its advice is
    only what lowers that peak: ``writing`` names the blocks that write in place to their inputs, which no region
    may start at, ``in_place`` the layers among them built to (``nn.ReLU(inplace=True)``), and ``unwritten`` the
    smallest peak were they not to (None: not lower, so no advice about them); ``nothing_frees``: no option of the
    blocks frees memory, and ``chained``: runs of them as one region were weighed too, so larger blocks made of
    them would free no more; ``unavailable``: a sentence on the options asked for that this device cannot have;
    ``where``: the stretch of the step where the smallest peak falls, in words (what dominates it).
    ``parts``: what that peak is made of, in bytes that sum to ``smallest`` (one rank's, on a distributed model):
    ``states`` (parameters, gradients and buffers, the rank's shards of them where sharded, DDP's gradient
    buckets; no optimizer state, which no plan's peak counts), ``gathered`` (the parameters FSDP2 gathers),
    ``activations`` (what the blocks keep, a recomputation, backward's working tensors) and ``head`` (the output
    layer and loss's logits and gradients); empty where the profile did not record them.  The message names
    the parts of 5% or more, largest first.
    ``reasons`` holds these, to state them again for another budget or smallest peak.
    """

    def __init__(self, budget: int, smallest: int, param_bytes: int = 0, unplanned_above: int = 0,
                 requested: object = None, nothing_frees: bool = False, writing: Sequence[str] = (),
                 in_place: Sequence[str] = (), unwritten: int | None = None, unavailable: str = "",
                 chained: bool = False, where: str = "", parts: Mapping[str, int] | None = None) -> None:
        self.budget, self.smallest, self.param_bytes = budget, smallest, param_bytes
        self.parts = dict(parts or {})
        self.reasons: dict[str, Any] = {"nothing_frees": nothing_frees, "writing": tuple(writing),
                                        "in_place": tuple(in_place), "unwritten": unwritten,
                                        "unavailable": unavailable, "chained": chained, "where": where,
                                        "parts": self.parts}
        asked = ""
        if isinstance(requested, float):
            asked = f"{requested:.0%} came to "
        elif isinstance(requested, str):
            asked = f"{requested} is "

        # Exact bytes where rounding would print the budget and the smallest peak alike.
        exact = format_bytes(budget) == format_bytes(smallest)

        def both(total: int) -> str:
            above = total - param_bytes
            whole = f"{total:,} bytes" if exact else format_bytes(total)
            if above < 0:
                return f"{whole} whole step, less than the parameters alone ({format_bytes(param_bytes)})"
            share = f", {above / unplanned_above:.0%} of the unplanned peak" if unplanned_above else ""
            return f"{format_bytes(above)} above parameters{share} ({whole} whole step)"

        advice = "Raise the budget to at least that, or reduce the batch / sequence length."
        lowered = unwritten is not None and unwritten < smallest
        if nothing_frees and not lowered and chained:
            advice = ("No option of these blocks frees memory, nor any run of them as one region: reduce the batch / "
                      "sequence length.")
        elif nothing_frees and not lowered:  # every option keeps what it would free; larger blocks may free some
            advice = ("No option of these blocks frees memory (a block checkpointed alone keeps its inputs, all "
                      "that a single layer saves); name larger blocks with modules=[...], or reduce the batch / "
                      "sequence length.")
        if lowered:
            advice = f"{advice[:-1]}, {_unwriting(writing, in_place, both(unwritten))}."
        if unavailable:
            advice = f"{unavailable} {advice}"
        super().__init__(
            f"no plan fits the budget: {asked}{both(budget)}; the smallest peak any plan reaches is "
            f"{both(smallest)}{f', {where}' if where else ''}{_made_of(self.parts)}. {advice}"
        )


_NAMED = {"gathered": "gathered parameters", "activations": "activations", "head": "output layer and loss"}
_SHOWN = 0.05  # parts below this share of the peak are left out of the message (``parts`` has them all)


def _made_of(parts: Mapping[str, int]) -> str:
    """``parts`` in words, the largest first, those under 5% of their sum left out."""
    total = sum(parts.values())
    if total <= 0:
        return ""
    # the states are the rank's shards where FSDP2 gathers the parameters
    named = {**_NAMED, "states": "sharded states" if parts.get("gathered") else "parameters and gradients"}
    shown = sorted(((nbytes, part) for part, nbytes in parts.items() if nbytes >= _SHOWN * total), reverse=True)
    return ": " + ", ".join(f"{format_bytes(nbytes)} {named[part]}" for nbytes, part in shown)


def _unwriting(writing: Sequence[str], in_place: Sequence[str], smallest: str) -> str:
    """The advice that lets regions start at the blocks that write in place to their inputs, and what it gives."""
    # a block with no in-place layer of its own writes in its forward's code
    by_code = [name for name in writing if not any(layer == name or layer.startswith(f"{name}.")
                                                   for layer in in_place)]
    fixes = []
    if in_place:
        fixes.append(f"build {_some(in_place)} with inplace=False")
    if by_code:
        fixes.append(f"write to a copy (x = x.clone()) in the forward of {_some(by_code)}")
    return (f"or let regions start at the blocks that write in place to their inputs ({_some(writing)}): "
            f"{' and '.join(fixes)}; the smallest peak would then be about {smallest}")


def _some(names: Sequence[str]) -> str:
    """Up to three module paths, quoted, and how many more."""
    shown = ", ".join(f"`{name}`" for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
