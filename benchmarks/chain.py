"""A model without repeated blocks: plans of segments against ``checkpoint_sequential`` at every segment count.

Run by hand:

    PYTHONPATH=src python benchmarks/chain.py                     # the tests' 12-layer MLP, 15 rounds
    PYTHONPATH=src python benchmarks/chain.py --width 128 --hidden 512 --batch 1024 --repeats 21

The model is an ``nn.Sequential`` of 12 Linear+GELU layers whose widths alternate as in a transformer's MLP
(width -> hidden -> width ...).  From one profile it plans at 50% and 30% of the unplanned peak above
parameters, and for each it also plans at the peak the fastest ``checkpoint_sequential`` reaching that memory
predicts.  Every variant (no checkpointing, the plans, ``checkpoint_sequential`` with 2 to 24 segments) has its
own copy of the model and an SGD optimizer; they run interleaved, round-robin with a rotating order, each
round timing one forward+backward per variant and then (untimed) stepping its optimizer, so weights move as in
training.  Peak: MemTracker's whole-step peak above parameters and buffers.  Time: the median over rounds of
each variant's step over no checkpointing's in the same round (interquartile range of those ratios), next to
the cost model's prediction.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from torch import nn

import remat
from remat.planning.basics.units import format_bytes
from remat.planning.choices.chain import chain_options, sequential_choice
from remat.planning.measure.timing import Clock
from remat.planning.solve.solver import predict


def build(width: int, hidden: int, batch: int) -> tuple[nn.Sequential, torch.Tensor]:
    """The benchmark's MLP and its input, seeded."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(12):
        layers += [nn.Linear(width if i % 2 == 0 else hidden, hidden if i % 2 == 0 else width), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(batch, width)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def timed_rounds(variants: dict[str, tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]], rounds: int,
                 warmup: int) -> dict[str, list[float]]:
    """Seconds of each variant's forward+backward per round; its optimizer steps (untimed) after each."""
    optimizers = {label: torch.optim.SGD(model.parameters(), lr=1e-3) for label, (model, _) in variants.items()}
    labels = list(variants)
    clock = Clock("cpu")
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(warmup + rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            model, forward = variants[label]
            start = clock.mark()
            loss_fn(forward(model)).backward()
            end = clock.mark()
            marks = clock.read()  # the clock starts afresh: the optimizer's step is not timed
            optimizers[label].step()
            optimizers[label].zero_grad(set_to_none=True)
            if round_index >= warmup:
                times[label].append(marks[end] - marks[start])
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, x = build(args.width, args.hidden, args.batch)
    prof = remat.profile(model, x, loss_fn=loss_fn, hold_output=False)  # as its steps: loss_fn(model(x)).backward()
    options = chain_options(prof)
    fixed = prof.param_bytes + prof.buffer_bytes
    sequential = {s: predict(prof, sequential_choice(prof, options, s)) for s in range(2, len(prof.rows) + 1)}

    def plain(m: nn.Module) -> torch.Tensor:
        return m(x)

    variants: dict[str, tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]] = {
        "no checkpointing": (copy.deepcopy(model), plain)}
    predicted = {"no checkpointing": (prof.peak_bytes, 0.0)}
    notes = {}
    for fraction in (0.5, 0.3):
        plan = prof.plan(fraction)
        label = f"plan at {fraction:.0%}"
        variants[label] = (plan.apply(copy.deepcopy(model)), plain)
        predicted[label] = (plan.predicted_peak, plan.predicted_extra_time)
        notes[label] = " ".join(f"[{run[0]}..{run[-1]}]" for run in plan.segments)
        fitting = [(extra, s) for s, (peak, extra) in sequential.items() if peak <= plan.predicted_peak]
        if fitting:
            best = min(fitting)[1]
            notes[label] += f"; best checkpoint_sequential within its peak: {best} segments"
    for s, prediction in sequential.items():
        label = f"checkpoint_sequential {s}"
        variants[label] = (copy.deepcopy(model), lambda m, s=s: remat.checkpoint_sequential(m, s, x))
        predicted[label] = prediction
    times = timed_rounds(variants, args.repeats, args.warmup)
    reference = times["no checkpointing"]
    base = prof.peak_above_params
    print(f"12 Linear+GELU layers ({args.width} -> {args.hidden} -> ...), batch {args.batch}, one CPU thread; "
          f"unplanned peak above parameters {format_bytes(base)}, step {statistics.median(reference) * 1e3:.1f} ms")
    print("| variant | peak above params (predicted) | % of plain | step vs plain (IQR) | predicted | note |")
    print("|---|---|---|---|---|---|")
    for label, (variant, forward) in variants.items():
        peak = remat.measure_step(lambda v=variant, f=forward: loss_fn(f(v)).backward(), variant).peak_above_params
        variant.zero_grad(set_to_none=True)
        ratios = [a / b for a, b in zip(times[label], reference)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        peak_predicted, extra = predicted[label]
        print(f"| {label} | {format_bytes(peak)} ({format_bytes(peak_predicted - fixed)}) | {peak / base:.0%} | "
              f"×{median:.2f} ({q1:.2f}–{q3:.2f}) | ×{1 + extra / prof.step_time:.2f} | {notes.get(label, '')} |")


if __name__ == "__main__":
    main()
