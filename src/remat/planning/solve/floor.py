"""What the smallest peak any plan reaches is made of: where the plan that reaches it peaks, in words, and that
peak's bytes in the user's parts (:data:`~remat.planning.measure.timeline.PARTS`: this rank's parameters,
gradients and buffers, FSDP2's gathered parameters, activations, the output layer and loss), for a refusal to state.

Every part but the activations is what the step without a plan held at that moment: no block's option changes a
parameter, a gradient, a gathered unit or the head's logits.  The activations are the rest, so the parts sum to the
smallest peak exactly.

Example:
    >>> floor(prof, cheapest(prof, smallest, options), smallest)
    {'where': "in the backward of `blocks.3` (...)", 'parts': {'states': 6291456, 'gathered': 2097152, ...}}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..choices.options import BlockOption
from ..measure.profile import StepProfile
from ..measure.timeline import PARTS
from .accounting import Accounting

__all__ = ["floor"]


def floor(prof: StepProfile, placed: Sequence[tuple[int, BlockOption]], smallest: int) -> dict[str, Any]:
    """Where the plan ``placed`` (one that reaches ``smallest``) peaks, in words (``where``), and that peak's bytes
    by part (``parts``, summing to ``smallest``; empty where the profile did not record what its stretches held).

    Example:
        >>> floor(prof, placed, smallest)["parts"]
        {'states': 6291456, 'gathered': 2097152, 'activations': 1048576, 'head': 0}
    """
    accounting = Accounting(prof)
    best, where, moment = -1, "", (0, False)
    freed = mask = 0
    for p, option in [*placed, (accounting.n, None)]:
        for check, label, t in zip(accounting.checks[p], accounting.labels[p], accounting.moments[p]):
            if accounting.value(check, freed, mask) > best:
                best, where, moment = accounting.value(check, freed, mask), label, (t, False)
        if option is None:
            break
        # the highest of the stretches the option decides, each lower by what the blocks before free
        value, t, at_start = max(accounting.stretches(p, option, mask), key=lambda stretch: stretch[0])
        if value - freed > best:
            best, where, moment = value - freed, f"block {p}", (t, at_start)
        freed += accounting.freed_by(p, option)
        mask |= accounting.holds(p, option)
    parts = _parts(prof, *moment, smallest)
    return {"where": _in_words(prof, where, guessed=not parts), "parts": parts}


def _parts(prof: StepProfile, t: int, at_start: bool, total: int) -> dict[str, int]:
    """``total`` by part at segment ``t``'s peak (or start): the unplanned step's parts there, the activations
    being what is left."""
    if t >= len(prof.segments):
        return {}
    measured = prof.segments[t].start_parts if at_start else prof.segments[t].parts
    if not measured:
        return {}
    parts = {part: measured.get(part, 0) for part in PARTS}
    parts["activations"] = total - sum(nbytes for part, nbytes in parts.items() if part != "activations")
    return parts if parts["activations"] >= 0 else {}


def _in_words(prof: StepProfile, where: str, guessed: bool) -> str:
    """A stretch of the step as the accounting labels it, in words; ``guessed``: with what usually dominates there,
    where the parts it holds are not known."""
    head = {"loss": "at the loss" + " (the output's logits and what every block keeps)" * guessed,
            "after loss": "in the output layer and loss's backward" + " (the logits' gradients)" * guessed
                          + ", which no block option changes (remat.chunked_lm_loss computes them in chunks)"}
    if where in head:
        return head[where]
    kind, _, index = where.rpartition(" ")
    name = f"`{prof.rows[int(index)].name}`" if index.isdigit() else ""
    stretch, usually = {"block": (f"in {name}'s own forward or backward", "what it keeps, or its recomputation"),
                        "forward": (f"in the forward after {name}", "what the blocks before keep"),
                        "before forward": (f"in the forward before {name}", "what the blocks before keep"),
                        "backward": (f"in the backward of {name}", "the gradients so far and what later blocks keep"),
                        }.get(kind, ("", ""))
    return f"{stretch} ({usually})" if guessed and stretch else stretch
