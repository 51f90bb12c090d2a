"""The demo: train the built-in GPT under several checkpointing modes and compare them.

Every mode starts from the same weights and sees the same batches and the
same dropout masks, so their losses and gradients must agree exactly; what
differs is peak memory and step time.  Modes: no checkpointing, every block
checkpointed, every block with ``save_matmuls``, and the planner's plan at a
budget, which may keep chosen op outputs of a block (``selective``).

Each step is timed from zeroing the gradients to the end of backward; the
optimizer's step (AdamW by default, :mod:`remat.planning.basics.optimizers`) follows it,
untimed.  The peak is measured after training, with the optimizer's state in
place and not counted: the figure the plan predicts.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..api.modules import apply_activation_checkpointing
from ..models import GPT, Block, GPTConfig, synthetic_batch
from ..planning.basics.memory import measure_step
from ..planning.basics.optimizers import make_optimizer
from ..planning.basics.units import format_bytes
from ..planning.choices.options import block_options
from ..planning.measure.timeline import live_bytes_timeline
from ..planning.solve.plan import Plan
from ..planning.solve.solver import InfeasibleBudget, plan_from_profile
from ..planning.workflow import Profile
from ..planning.workflow import profile as run_profile
from ..policies.rules import save_matmuls

__all__ = ["ModeResult", "plot", "run_demo"]


@dataclass
class ModeResult:
    """What one mode measured."""

    name: str
    decisions: list[str]
    kept: list[int]
    peak_total: int
    peak_above_params: int
    step_times: list[float]
    losses: list[torch.Tensor] = field(repr=False)
    grads: list[list[torch.Tensor]] = field(repr=False)
    timeline: list[int] = field(default_factory=list, repr=False)

    @property
    def step_time(self) -> float:
        """Median step time, the first (warm-up) step excluded when there are others."""
        times = self.step_times[1:] or self.step_times
        return statistics.median(times)

    def max_loss_diff(self, other: ModeResult) -> float:
        return max((a - b).abs().item() for a, b in zip(self.losses, other.losses))

    def max_grad_diff(self, other: ModeResult) -> float:
        return max(
            (a - b).abs().max().item()
            for mine, theirs in zip(self.grads, other.grads)
            for a, b in zip(mine, theirs)
        )


def _loss_fn(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())


_PLAN_OPTIONS = ("checkpoint", "save_matmuls", "selective")


def _modes(prof: Profile, budget: float | int | str) -> tuple[dict[str, Callable[[GPT], list[str]]], Plan]:
    n = len(prof.rows)
    is_block = lambda m: isinstance(m, Block)  # noqa: E731

    def plain(model: GPT) -> list[str]:
        return ["keep"] * n

    def every_block(model: GPT) -> list[str]:
        apply_activation_checkpointing(model, check_fn=is_block)
        return ["checkpoint"] * n

    def selective(model: GPT) -> list[str]:
        apply_activation_checkpointing(model, check_fn=is_block, policy=save_matmuls)
        return ["save_matmuls"] * n

    try:
        plan = plan_from_profile(prof, budget, allow=_PLAN_OPTIONS)
        label = f"plan at {budget:.0%}" if isinstance(budget, float) and budget <= 1 else f"plan at {budget}"
    except InfeasibleBudget as error:
        # The demo shows the planner at work rather than failing: plan at the smallest peak it can reach.
        plan = plan_from_profile(prof, error.smallest, allow=_PLAN_OPTIONS)
        label = f"plan at {format_bytes(error.smallest - plan.param_bytes)} (smallest feasible)"

    def planned(model: GPT) -> list[str]:
        plan.apply(model)
        return list(plan.decisions.values())

    modes = {"no checkpointing": plain, "every block": every_block, "save_matmuls": selective, label: planned}
    return modes, plan


def _train(name: str, model: GPT, decisions: list[str], kept: list[int], batches: list, seed: int,
           on_step: Callable[[], None], optimizer: str) -> ModeResult:
    opt = make_optimizer(optimizer, model.parameters())
    losses, grads, times = [], [], []
    for step, (tokens, targets) in enumerate(batches):
        torch.manual_seed(seed + step)  # same dropout masks in every mode
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        on_step()
    tokens, targets = batches[0]

    def one_step() -> None:
        model.zero_grad(set_to_none=True)
        model.loss(tokens, targets).backward()

    memory = measure_step(one_step, model)
    timeline = live_bytes_timeline(one_step, *model.parameters(), tokens, targets)
    model.zero_grad(set_to_none=True)
    return ModeResult(name, decisions, kept, memory.peak_total, memory.peak_above_params, times, losses, grads,
                      timeline)


def run_demo(
    cfg: GPTConfig,
    batch_size: int,
    steps: int,
    seed: int = 0,
    budget: float | int | str = 0.5,
    on_step: Callable[[], None] = lambda: None,
    optimizer: str = "adamw",
) -> tuple[list[ModeResult], Profile, Plan]:
    """Train ``steps`` steps per mode from identical starting points; return the measurements, profile and plan.

    ``optimizer`` names one of :data:`remat.planning.basics.optimizers.OPTIMIZERS`.

    Example:
        >>> results, prof, plan = run_demo(GPTConfig(n_layers=2, seq_len=32), batch_size=2, steps=2)
        >>> results[1].max_grad_diff(results[0])
        0.0
    """
    torch.manual_seed(seed)
    reference = GPT(cfg)
    generator = torch.Generator().manual_seed(seed)
    batches = [synthetic_batch(cfg, batch_size, generator) for _ in range(steps)]
    tokens, targets = batches[0]
    # the demo trains with model.loss(tokens, targets): the logits are gone once the loss is computed
    prof = run_profile(copy.deepcopy(reference), tokens, loss_fn=_loss_fn(targets), hold_output=False)
    modes, plan = _modes(prof, budget)
    results = []
    for name, prepare in modes.items():
        model = copy.deepcopy(reference)
        decisions = prepare(model)
        results.append(_train(name, model, decisions, _kept_by_block(prof, plan, decisions), batches, seed, on_step,
                              optimizer))
    return results, prof, plan


def _kept_by_block(prof: Profile, plan: Plan, decisions: list[str]) -> list[int]:
    """Bytes each block keeps through the step under the given decisions (a selective block's from the plan)."""
    options = block_options(prof, ("checkpoint", "save_matmuls"))
    kept = []
    for row, choices, decision in zip(prof.rows, options, decisions):
        if decision == "selective":
            kept.append(plan.blocks[row.name]["kept"])
            continue
        option = next(o for o in choices if o.name == decision)
        kept.append(option.kept + (row.act_bytes - row.own_bytes if decision == "keep" else 0))
    return kept


def plot(results: list[ModeResult], prof: Profile, path: str, plan: Plan | None = None) -> None:
    """Write a PNG: memory kept by each block per mode, and the live-memory timeline of one step, with the
    plan's budget as a line and its predicted peak as a marker (the last mode is the plan's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 5.4))
    n = len(prof.rows)
    width = 0.8 / len(results)
    colors = [f"C{k}" for k in range(len(results))]
    for k, result in enumerate(results):
        kept = [b / 2**20 for b in result.kept]
        bars.bar([i + k * width for i in range(n)], kept, width, color=colors[k], label=result.name)
        lines.plot([b / 2**20 for b in result.timeline], color=colors[k], linewidth=1.2)
    bars.set_xticks([i + 0.4 - width / 2 for i in range(n)], [r.name for r in prof.rows], rotation=30)
    bars.set_ylabel("MiB kept through the step")
    bars.set_title("activation memory kept by each block")
    lines.set_xlabel("operator (forward, then backward)")
    lines.set_ylabel("live MiB (parameters, gradients, activations)")
    lines.set_title("memory timeline of one training step")
    if plan is not None:
        share = (plan.budget - plan.param_bytes) / max(plan.baseline_peak - plan.param_bytes, 1)
        lines.axhline(plan.budget / 2**20, color="black", linestyle="--", linewidth=1,
                      label=f"budget: {format_bytes(plan.budget)} ({share:.0%} of the unplanned peak above parameters)")
        timeline = results[-1].timeline
        at = max(range(len(timeline)), key=timeline.__getitem__) if timeline else 0
        predicted = f"{results[-1].name}: predicted peak {format_bytes(plan.predicted_peak)}"
        lines.plot([at], [plan.predicted_peak / 2**20], marker="v", markersize=9, linestyle="none", color=colors[-1],
                   markeredgecolor="black", label=predicted)
    # legends below the panels, where they cover no bar and no line
    handles, labels = bars.get_legend_handles_labels()
    more, more_labels = lines.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower left", bbox_to_anchor=(0.06, 0.0), ncol=2, fontsize=9, frameon=False)
    if more:
        fig.legend(more, more_labels, loc="lower right", bbox_to_anchor=(0.99, 0.0), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
