"""The planner's floor on a 12-block MLP chain of varied widths, against every block checkpointed.

Run by hand:  PYTHONPATH=src python benchmarks/chain_floor.py

Each block is Linear -> tanh -> Linear with a residual, hidden widths 64...1536 on a 128-wide stream, batch
1024.  The floor is the smallest peak the planner says any plan reaches; checkpointing every block is one
such plan, so a floor above what it measures means budgets are refused that would fit.
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile, predict_peak

HIDDEN = [128, 1024, 256, 512, 64, 1536, 384, 768, 192, 1280, 320, 896]


class TanhBlock(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(*[TanhBlock(128, h) for h in HIDDEN]), nn.Linear(128, 1))
    x = torch.randn(1024, 128)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    prof = remat.profile(model, x, loss_fn=loss_fn, hold_output=False)  # as its step: loss_fn(model(x)).backward()
    params = prof.param_bytes + prof.buffer_bytes
    try:
        plan_from_profile(prof, "1B", allow=("checkpoint",))  # one byte: nothing fits
    except InfeasibleBudget as error:
        floor = error.smallest - params
    every = plan_from_profile(prof, 1.0, allow=("checkpoint",))
    every.decisions = {row.name: "checkpoint" for row in prof.rows}
    predicted = predict_peak(prof, list(every.decisions.values()), ("checkpoint",)) - params
    every.apply(model)
    measured = remat.measure_step(lambda: loss_fn(model(x)).backward(), model).peak_above_params
    mib, base = 2**20, prof.peak_above_params
    print(f"unplanned {base / mib:.1f} MiB; planner floor {floor / mib:.1f} MiB ({floor / base:.0%}); every block "
          f"checkpointed: predicted {predicted / mib:.1f} MiB, "
          f"measured {measured / mib:.1f} MiB ({measured / base:.0%})")


if __name__ == "__main__":
    main()
