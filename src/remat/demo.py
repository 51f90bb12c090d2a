"""The demo: train the built-in GPT under several checkpointing modes and compare them.

Every mode starts from the same weights and sees the same batches and the
same dropout masks, so their losses and gradients must agree exactly; what
differs is peak memory and step time.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .memory import measure_step
from .models import GPT, Block, GPTConfig, synthetic_batch
from .modules import apply_activation_checkpointing

__all__ = ["ModeResult", "run_demo", "MODES"]


def _no_checkpointing(model: GPT) -> None:
    return None


def _every_block(model: GPT) -> None:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


MODES: dict[str, Callable[[GPT], None]] = {
    "no checkpointing": _no_checkpointing,
    "every block": _every_block,
}


@dataclass
class ModeResult:
    """What one mode measured."""

    name: str
    peak_total: int
    peak_above_params: int
    step_times: list[float]
    losses: list[torch.Tensor] = field(repr=False)
    grads: list[list[torch.Tensor]] = field(repr=False)

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


def _train(name: str, model: GPT, batches: list, seed: int, on_step: Callable[[], None]) -> ModeResult:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
    model.zero_grad(set_to_none=True)
    return ModeResult(name, memory.peak_total, memory.peak_above_params, times, losses, grads)


def run_demo(
    cfg: GPTConfig,
    batch_size: int,
    steps: int,
    seed: int = 0,
    modes: dict[str, Callable[[GPT], None]] | None = None,
    on_step: Callable[[], None] = lambda: None,
) -> list[ModeResult]:
    """Train ``steps`` steps per mode from identical starting points; return the measurements.

    Example:
        >>> results = run_demo(GPTConfig(n_layers=2, seq_len=32), batch_size=2, steps=2)
        >>> results[1].max_grad_diff(results[0])
        0.0
    """
    modes = modes or MODES
    torch.manual_seed(seed)
    reference = GPT(cfg)
    generator = torch.Generator().manual_seed(seed)
    batches = [synthetic_batch(cfg, batch_size, generator) for _ in range(steps)]
    results = []
    for name, prepare in modes.items():
        model = copy.deepcopy(reference)
        prepare(model)
        results.append(_train(name, model, batches, seed, on_step))
    return results
