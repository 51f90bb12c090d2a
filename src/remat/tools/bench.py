"""remat vs torch.utils.checkpoint vs no checkpointing, measured side by side in one run.

Run by hand (never in CI as a timed test):

    remat bench                              # all cases, table + bench_results.json
    remat bench --cases tiny --repeats 21    # (or: python benchmarks/run.py ...)

Each case builds one model and times a full training step (forward + backward)
under every variant on the device's clock (CUDA events on a GPU, the CPU's
clock on the CPU: see :mod:`remat.planning.measure.timing`), interleaved round-robin so
that machine noise hits all variants alike; warm-up rounds are excluded and the
median of ``--repeats``
rounds is reported with its spread (interquartile range).  After every timed step
the optimizer (``--optimizer``, AdamW by default: :mod:`remat.planning.basics.optimizers`)
steps the case's parameters, untimed, as a training loop would (``tiny`` has no
parameters to step).  Peak memory is MemTracker's whole-step peak minus
parameters and buffers, measured once per variant after the timed rounds, with
the optimizer's state in place and not counted (bytes are deterministic).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_ckpt
from torch import nn

from ..api.checkpoint import checkpoint
from ..models import Block, GPTConfig
from ..planning.basics.memory import measure_step
from ..planning.basics.optimizers import make_optimizer
from ..planning.measure.timing import Clock, device_of
from .arguments import add_optimizer_argument, at_least, writable_file

__all__ = ["VARIANTS", "Chain", "format_table", "interleaved_rounds", "main", "run_case"]

Wrap = Callable[..., torch.Tensor]


def _plain(fn, *args):
    return fn(*args)


VARIANTS: dict[str, Wrap] = {
    "plain": _plain,
    "torch": lambda fn, *a: torch_ckpt.checkpoint(fn, *a, use_reentrant=False),
    "remat": lambda fn, *a: checkpoint(fn, *a, use_reentrant=False),
    "torch-reentrant": lambda fn, *a: torch_ckpt.checkpoint(fn, *a, use_reentrant=True),
    "remat-reentrant": lambda fn, *a: checkpoint(fn, *a, use_reentrant=True),
}


class TinyBlock(nn.Module):
    """60 tiny elementwise ops: launch-bound, so bookkeeping dominates."""

    def forward(self, x):
        for i in range(20):
            x = x.sin() if i % 2 else x.tanh()
            x = x * x
            x = x + 0.5
        return x


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class WideBlock(nn.Module):
    """An MLP block whose hidden width differs from block to block (a heterogeneous chain)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Chain(nn.Module):
    """Blocks run one after another, as one model (for tools that take a model, like the planner).

    Example:
        >>> model = Chain(nn.ModuleList(WideBlock(256, h) for h in (256, 1024)))
    """

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Case:
    name: str
    blocks: nn.ModuleList
    make_input: Callable[[], torch.Tensor]
    description: str


def _cases() -> dict[str, Callable[[], Case]]:
    def tiny() -> Case:
        return Case("tiny", nn.ModuleList(TinyBlock() for _ in range(8)),
                    lambda: torch.randn(4, 64, requires_grad=True), "8 blocks x 60 elementwise ops, 4x64")

    def gpt() -> Case:
        cfg = GPTConfig(d_model=256, n_heads=4, seq_len=256, dropout=0.1)
        return Case("gpt", nn.ModuleList(Block(cfg) for _ in range(6)),
                    lambda: torch.randn(8, 256, 256, requires_grad=True), "6 GPT blocks d=256 seq=256 batch=8")

    def conv() -> Case:
        return Case("conv", nn.ModuleList(ConvBlock(32) for _ in range(6)),
                    lambda: torch.randn(8, 32, 32, 32, requires_grad=True), "6 residual conv+BN blocks, 32ch 32x32 b8")

    def wide() -> Case:
        hidden = [256, 1024, 512, 2048, 256, 1536, 768, 512]
        return Case("wide", nn.ModuleList(WideBlock(256, h) for h in hidden),
                    lambda: torch.randn(512, 256, requires_grad=True), "8 MLP blocks, hidden 256..2048, batch 512")

    return {"tiny": tiny, "gpt": gpt, "conv": conv, "wide": wide}


def _step(case: Case, wrap: Wrap, x: torch.Tensor) -> None:
    h = x
    for block in case.blocks:
        h = wrap(block, h)
    h.float().pow(2).mean().backward()


def _time_round(case: Case, wrap: Wrap, clock: Clock, optimizer: torch.optim.Optimizer | None) -> float:
    x = case.make_input()
    case.blocks.zero_grad(set_to_none=True)
    seconds = clock.time(lambda: _step(case, wrap, x))[1]
    if optimizer is not None:
        optimizer.step()
    return seconds


def interleaved_rounds(steps: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                       device: str | torch.device = "cpu",
                       after: Mapping[str, Callable[[], object]] | None = None) -> list[dict[str, float]]:
    """Device seconds each step took, round by round: every step once per round, the order rotated.

    Times are taken on ``device``'s clock (:class:`~remat.planning.measure.timing.Clock`: events on an
    accelerator, read after one synchronize per round; the CPU's clock on the CPU).  Rounds are seeded
    (``torch.manual_seed(round)``) so every step sees the same dropout masks in a round; the ``warmup``
    first rounds are run and dropped.  Pair steps within a round (``r[a] / r[b]``) to cancel the machine's
    slow drifts.  ``after[label]()`` runs right after that label's step, outside its timed span (an
    optimizer's step, so that the steps timed are those of a training loop).

    Example:
        >>> times = interleaved_rounds({"plain": lambda: step(model), "ckpt": lambda: step(wrapped)}, 11,
        ...                            after={"plain": opt.step, "ckpt": wrapped_opt.step})
        >>> statistics.median(r["ckpt"] / r["plain"] for r in times)
    """
    labels = list(steps)
    after = after or {}
    clock = Clock(device)
    result = []
    for round_index in range(warmup + rounds):
        shift = round_index % len(labels)
        marks = {}
        for label in labels[shift:] + labels[:shift]:
            torch.manual_seed(round_index)
            start = clock.mark()
            steps[label]()
            marks[label] = start, clock.mark()
            if label in after:
                after[label]()
        times = clock.read()
        if round_index >= warmup:
            result.append({label: times[end] - times[start] for label, (start, end) in marks.items()})
    return result


def run_case(case: Case, variants: list[str], repeats: int, warmup: int, optimizer: str = "adamw") -> dict:
    times: dict[str, list[float]] = {v: [] for v in variants}
    clock = Clock(device_of(case.blocks.parameters()))
    params = list(case.blocks.parameters())
    stepper = make_optimizer(optimizer, params) if params else None
    for round_index in range(warmup + repeats):
        # rotate the order each round so no variant always runs first
        order = variants[round_index % len(variants):] + variants[: round_index % len(variants)]
        for variant in order:
            elapsed = _time_round(case, VARIANTS[variant], clock, stepper)
            if round_index >= warmup:
                times[variant].append(elapsed)
    result = {"description": case.description, "variants": {}}
    for variant in variants:
        x = case.make_input()
        case.blocks.zero_grad(set_to_none=True)
        memory = measure_step(lambda v=variant, x=x: _step(case, VARIANTS[v], x), case.blocks)
        samples = sorted(times[variant])
        q1, q3 = statistics.quantiles(samples, n=4)[0], statistics.quantiles(samples, n=4)[2]
        result["variants"][variant] = {
            "median_ms": statistics.median(samples) * 1e3,
            "iqr_ms": (q3 - q1) * 1e3,
            "peak_above_params": memory.peak_above_params,
        }
    return result


def _ratio(results: dict, a: str, b: str, key: str = "median_ms") -> float | None:
    va, vb = results["variants"].get(a), results["variants"].get(b)
    return va[key] / vb[key] if va and vb else None


def _ms(variants: dict, key: str) -> str:
    return f"{variants[key]['median_ms']:.1f} ±{variants[key]['iqr_ms']:.1f}" if key in variants else "-"


def _ratio_text(results: dict, a: str, b: str) -> str:
    r = _ratio(results, a, b)
    return f"{r:.2f}" if r is not None else "-"


def format_table(all_results: dict) -> str:
    lines = [
        "| case | plain ms | torch ms | remat ms | remat/torch | remat/plain | torch-re ms | remat-re ms "
        "| re remat/torch | peak MiB plain / torch / remat |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in all_results["cases"].items():
        v = res["variants"]
        peaks = " / ".join(
            f"{v[k]['peak_above_params'] / 2**20:.2f}" for k in ("plain", "torch", "remat") if k in v
        )
        lines.append(
            f"| {name} | {_ms(v, 'plain')} | {_ms(v, 'torch')} | {_ms(v, 'remat')} | "
            f"{_ratio_text(res, 'remat', 'torch')} | {_ratio_text(res, 'remat', 'plain')} | "
            f"{_ms(v, 'torch-reentrant')} | {_ms(v, 'remat-reentrant')} | "
            f"{_ratio_text(res, 'remat-reentrant', 'torch-reentrant')} | {peaks} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, shared by ``remat bench`` and ``benchmarks/run.py``."""
    parser.add_argument("--cases", nargs="*", default=list(_cases()), choices=list(_cases()))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=at_least(2, "a median and a spread need two rounds"), default=9,
                        help="timed rounds per variant (default 9; 7 or more for steady figures)")
    parser.add_argument("--warmup", type=at_least(0), default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads (default 1)")
    add_optimizer_argument(parser)
    parser.add_argument("--json", type=writable_file, default="bench_results.json",
                        help="where to write the results")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark from the command line; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Run the cases named in ``args``; print one table and write the JSON file."""
    torch.set_num_threads(args.threads)
    machine = f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}, " \
              f"{args.threads} thread(s), python {platform.python_version()}"
    all_results = {"machine": machine, "repeats": args.repeats, "cases": {}}
    for name in args.cases:
        torch.manual_seed(0)
        case = _cases()[name]()
        all_results["cases"][name] = run_case(case, list(args.variants), args.repeats, args.warmup,
                                              args.optimizer)
        print(f"done: {name}", file=sys.stderr)
    print(f"machine: {machine}; median of {args.repeats} interleaved rounds (± interquartile range)")
    print(format_table(all_results))
    with open(args.json, "w") as f:
        json.dump(all_results, f, indent=2)
    return all_results
