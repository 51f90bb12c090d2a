"""Why no plan fits a budget, in the terms the budget was asked in: :class:`InfeasibleBudget`.

Example:
    >>> try:
    ...     prof.plan(0.01)
    ... except InfeasibleBudget as refused:
    ...     print(refused.smallest)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..basics.units import format_bytes

__all__ = ["InfeasibleBudget"]


class InfeasibleBudget(ValueError):
    """No plan fits the budget.

    ``budget`` and ``smallest`` are whole-step peaks in bytes (parameters and buffers included, as
    ``Plan.predicted_peak``); ``smallest`` is the lowest peak any plan reaches. The message states both above
    parameters as well, the terms a fractional budget such as ``0.5`` or ``"50%"`` is given in.  ``writing``
    names the blocks that write in place to their inputs, which no region may start at.
    """

    def __init__(self, budget: int, smallest: int, param_bytes: int = 0, unplanned_above: int = 0,
                 requested: object = None, nothing_frees: bool = False, writing: Sequence[str] = ()) -> None:
        self.budget, self.smallest, self.param_bytes = budget, smallest, param_bytes
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
        if nothing_frees:  # every option of these blocks keeps what it would free: larger blocks may not
            advice = ("No option of these blocks frees memory (a block checkpointed alone keeps its inputs, all "
                      "that a single layer saves); name larger blocks with modules=[...], or reduce the batch / "
                      "sequence length.")
        if writing:
            shown = ", ".join(writing[:3]) + (f" and {len(writing) - 3} more" if len(writing) > 3 else "")
            advice = (f"{shown} write in place to their inputs, so none can be checkpointed on its own (it would "
                      "rerun from the written input): write to a copy in their forward (x = x.clone()), or name "
                      f"larger blocks with modules=[...]. {advice if not nothing_frees else ''}").rstrip()
        super().__init__(
            f"no plan fits the budget: {asked}{both(budget)}; the smallest peak any plan reaches is "
            f"{both(smallest)}. {advice}"
        )
