"""The planner on the zoo: blocks found, and for each budget the predicted and measured peak.

Run by hand:  PYTHONPATH=src:tests python benchmarks/zoo.py [model ...]

For every zoo model (tests/zoo.py: tiny random-weight language and vision models from transformers) it
profiles one step, plans budgets of 30/50/70% of the unplanned peak above parameters and the smallest
peak the planner names, and measures each plan with MemTracker.  Peaks are above parameters and buffers.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import zoo  # noqa: E402

import remat  # noqa: E402
from remat.planning.basics.units import format_bytes
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile

BUDGETS = (0.3, 0.5, 0.7)


def _measure(case, plan=None) -> int:
    if plan is not None:
        plan.apply(case.model)
    case.model.zero_grad(set_to_none=True)
    peak = remat.measure_step(lambda: case.loss().backward(), case.model).peak_above_params
    case.model.zero_grad(set_to_none=True)
    if plan is not None:
        plan.remove(case.model)
    return peak


def run(name: str) -> list[str]:
    case = zoo.BUILDERS[name]()
    start = time.perf_counter()
    # as its step, case.loss().backward(): the output gone once the loss is computed
    prof = remat.profile(case.model, *case.args, loss_fn=case.loss_fn, hold_output=False, **case.kwargs)
    seconds = time.perf_counter() - start
    params = prof.param_bytes + prof.buffer_bytes
    found = ", ".join(f"{count} {cls}" for cls, count in Counter(row.cls for row in prof.rows).items())
    every = plan_from_profile(prof, 1.0, allow=("checkpoint",))
    every.decisions = {row.name: "checkpoint" for row in prof.rows}
    floor = _measure(case, every)
    base = _measure(case)
    head = f"| {name} | {found} | {format_bytes(base)} | {format_bytes(floor)} ({floor / base:.0%}) | {seconds:.1f} s "
    lines = []
    try:
        plan_from_profile(prof, "1B")  # one byte: nothing fits
    except InfeasibleBudget as error:
        smallest = error.smallest
    for budget in (*BUDGETS, smallest):
        label = f"{budget:.0%}" if budget <= 1 else f"min {(budget - params) / prof.peak_above_params:.0%}"
        try:
            plan = prof.plan(budget)
        except InfeasibleBudget as error:
            lines.append(f"{head}| {label} | refused (smallest {format_bytes(error.smallest - params)}) | | | |")
            continue
        got = _measure(case, plan)
        predicted = plan.predicted_peak - params
        code = "".join(d[0].upper() for d in plan.decisions.values())
        lines.append(f"{head}| {label} = {format_bytes(plan.budget - params)} | {format_bytes(predicted)} | "
                     f"{format_bytes(got)} ({predicted / got:.3f}) | {got / (plan.budget - params):.2f} | {code} |")
    return lines


def main() -> None:
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(zoo.BUILDERS)
    print("| model | blocks found | unplanned peak | every block checkpointed | profile time | budget | "
          "predicted | measured (pred/meas) | measured/budget | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for line in run(name):
            print(line, flush=True)


if __name__ == "__main__":
    main()
