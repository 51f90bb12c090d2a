"""The memory/time frontier: remat's plans against every way of checkpointing people use today.

Run by hand (several minutes: inductor compiles each budget once):

    python benchmarks/frontier.py                       # both models, table + frontier_results.json
    python benchmarks/frontier.py --models demo --repeats 9 --no-compile

For each model (the demo GPT at `remat demo` defaults, and the `gpt` case of `remat bench`: 6 blocks,
d 256, seq 256, batch 8) it measures, in eager mode and interleaved round-robin (one CPU thread), no
checkpointing, every-k checkpointing (k = 1 is full checkpointing), every block under `save_matmuls`, and
`remat.plan` at 30/50/70% of the unplanned peak above parameters — all from one profile. Then, each in its
own subprocess (the compiler's budget is read when a graph is compiled), torch.compile (inductor) with
`torch._functorch.config.activation_memory_budget` at 1.0/0.7/0.5/0.3, interleaved there with eager
no-checkpointing so its time ratio is measured side by side too.

Every mode trains: after each of its steps its own optimizer (``--optimizer``, AdamW with ``foreach`` by
default) steps its parameters, outside the timed span. The steps timed are thus those of a training loop,
whose optimizer writes every parameter in place between them, and the times compare with the plans'
predictions, which price forward and backward only.

Peak: the whole training step's peak above parameters and buffers (gradients, activations, tensors
recomputed in backward), measured after the timed rounds with the optimizer's state in place and not
counted — what ``plan.predicted_peak - plan.param_bytes`` predicts. Eager rows use MemTracker; compiled rows
use the profiler's allocation events (`remat.planning.basics.memory.profiled_peak`), which give the same bytes on
eager code. Time: median step time over no-checkpointing's in the same round (median over rounds, with the
interquartile range of those ratios); extra time: the median over rounds of the step's time minus
no-checkpointing's. A plan's row shows its predicted peak (and the measured peak's error against it) and its
predicted extra time, on the scale of the profile's step time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.planning.basics.memory import profiled_peak
from remat.planning.basics.optimizers import make_optimizer
from remat.planning.basics.units import format_bytes
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile
from remat.tools.arguments import add_optimizer_argument
from remat.tools.bench import Chain, _cases, interleaved_rounds

PLAN_FRACTIONS = (0.3, 0.5, 0.7)
COMPILE_BUDGETS = (1.0, 0.7, 0.5, 0.3)


@dataclass
class Workload:
    """A model, its inputs and its loss: one training step is ``loss_fn(model(*inputs)).backward()``."""

    model: nn.Module
    inputs: tuple
    loss_fn: Callable[[object], torch.Tensor]

    def step(self, model: nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        self.loss_fn(model(*self.inputs)).backward()


def workload(name: str) -> Workload:
    """The benchmark's models, built identically in every process (seeded)."""
    torch.manual_seed(0)
    if name == "demo":
        cfg = GPTConfig(seq_len=256)  # `remat demo`'s defaults
        tokens, targets = synthetic_batch(cfg, 8, generator=torch.Generator().manual_seed(0))
        return Workload(GPT(cfg), (tokens,), lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()))
    if name == "gpt":
        case = _cases()["gpt"]()
        x = case.make_input().detach()
        return Workload(Chain(case.blocks), (x,), lambda out: out.float().pow(2).mean())
    raise ValueError(f"unknown model {name!r}; choose demo or gpt")


def _wrapped(work: Workload, every_n: int = 1, policy=None) -> nn.Module:
    model = copy.deepcopy(work.model)
    remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block), every_n=every_n,
                                         policy=policy)
    return model


def eager_variants(work: Workload, blocks_only: bool = True) -> tuple[dict[str, nn.Module], dict[str, str],
                                                                   dict[str, Plan]]:
    """Every eager configuration, by label, a note on each plan (its decisions, or why it was refused) and the
    plans themselves.

    Besides the fractional budgets, each baseline gets a plan whose budget is that baseline's own measured
    peak ("remat.plan at every 2"): the head-to-head comparison at equal memory.
    """
    variants = {"no checkpointing": work.model}
    for k in (1, 2, 3):
        variants["full checkpointing" if k == 1 else f"every {k}"] = _wrapped(work, every_n=k)
    variants["save_matmuls"] = _wrapped(work, policy=remat.policies.save_matmuls)
    prof = remat.profile(work.model, *work.inputs, loss_fn=work.loss_fn, hold_output=False)  # as work.step
    budgets: dict[str, float | int] = {f"{fraction:.0%}": fraction for fraction in PLAN_FRACTIONS}
    for label in list(variants)[1:]:
        peak = remat.measure_step(lambda m=variants[label]: work.step(m), variants[label]).peak_above_params
        budgets[f"at {label}"] = prof.param_bytes + prof.buffer_bytes + peak
    notes, plans = {}, {}
    families = {"remat.plan": ("checkpoint", "save_matmuls", "selective")}
    if blocks_only:
        families["remat.plan blocks only"] = ("checkpoint", "save_matmuls")
    for when, budget in budgets.items():
        for family, allow in families.items():
            label = f"{family} {when}"
            try:
                plan = plan_from_profile(prof, budget, allow=allow)
            except InfeasibleBudget as error:
                notes[label] = f"refused: {error}"
                continue
            variants[label] = plan.apply(copy.deepcopy(work.model))
            plans[label] = plan
            notes[label] = "".join(_LETTERS[d] for d in plan.decisions.values())
    return variants, notes, plans


_LETTERS = {"keep": "K", "checkpoint": "C", "save_matmuls": "M", "selective": "S", "offload": "O", "segment": "G"}


def interleaved_times(work: Workload, variants: dict[str, nn.Module], repeats: int, warmup: int,
                      optimizer: str) -> dict:
    """Step times of each variant, round-robin with a rotating order so noise hits all alike (paired by round);
    each variant's optimizer steps after each of its steps, untimed."""
    optimizers = {label: make_optimizer(optimizer, model.parameters()) for label, model in variants.items()}
    rounds = interleaved_rounds({label: lambda m=model: work.step(m) for label, model in variants.items()},
                                repeats, warmup, after={label: opt.step for label, opt in optimizers.items()})
    return {label: [r[label] for r in rounds] for label in variants}


def _summary(samples: list[float], reference: list[float]) -> dict:
    """Median step time, the median of per-round ratios to ``reference`` (same round, so slow drifts of
    the machine cancel) with the ratios' interquartile range, and the median per-round difference."""
    ratios = [a / b for a, b in zip(samples, reference)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    extra = statistics.median(a - b for a, b in zip(samples, reference))
    return {"median_ms": statistics.median(samples) * 1e3, "ratio": median, "ratio_q1": q1, "ratio_q3": q3,
            "extra_ms": extra * 1e3}


def _predictions(plan: Plan) -> dict:
    """What a plan predicts, in the rows' terms: peak above parameters and buffers, extra time and its ratio."""
    return {"predicted_peak": plan.predicted_peak - plan.param_bytes,
            "predicted_extra_ms": plan.predicted_extra_time * 1e3,
            "predicted_ratio": 1 + plan.predicted_extra_time / plan.step_time}


def measure_eager(name: str, repeats: int, warmup: int, optimizer: str, blocks_only: bool = True) -> list[dict]:
    work = workload(name)
    variants, notes, plans = eager_variants(work, blocks_only)
    samples = interleaved_times(work, variants, repeats, warmup, optimizer)
    rows = []
    for label, model in variants.items():
        peak = remat.measure_step(lambda m=model: work.step(m), model).peak_above_params
        predicted = _predictions(plans[label]) if label in plans else {}
        rows.append({"model": name, "mode": label, "peak_above_params": peak, "note": notes.get(label, ""),
                     **predicted, **_summary(samples[label], samples["no checkpointing"])})
    for label, note in notes.items():
        if label not in variants:
            rows.append({"model": name, "mode": label, "peak_above_params": None, "note": note})
    return rows


def measure_compiled(name: str, budget: float, repeats: int, warmup: int, optimizer: str) -> dict:
    """torch.compile (inductor) at one activation_memory_budget, interleaved with eager plain."""
    import torch._functorch.config as functorch_config

    work = workload(name)
    compiled_model = copy.deepcopy(work.model)
    compiled = torch.compile(compiled_model)
    with functorch_config.patch(activation_memory_budget=budget):
        work.step(compiled)  # compiles forward and backward under this budget
    samples = interleaved_times(work, {"no checkpointing": work.model, "compiled": compiled}, repeats, warmup,
                                optimizer)
    compiled_model.zero_grad(set_to_none=True)
    peak = profiled_peak(lambda: work.step(compiled))
    return {"model": name, "mode": f"torch.compile budget {budget:g}", "peak_above_params": peak, "note": "",
            **_summary(samples["compiled"], samples["no checkpointing"])}


def _compiled_in_subprocess(name: str, budget: float, repeats: int, warmup: int, optimizer: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--compiled-one", name, str(budget), "--repeats", str(repeats),
         "--warmup", str(warmup), "--optimizer", optimizer], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    lines = ["| model | mode | peak above params | % of plain | predicted peak (measured's error) "
             "| step time vs plain (IQR) | predicted | extra ms: measured / predicted | plan / note |",
             "|---|---|---|---|---|---|---|---|---|"]
    plain = {r["model"]: r["peak_above_params"] for r in rows if r["mode"] == "no checkpointing"}
    for r in rows:
        if r["peak_above_params"] is None:
            lines.append(f"| {r['model']} | {r['mode']} | — | — | — | — | — | — | {r['note']} |")
            continue
        share = r["peak_above_params"] / plain[r["model"]]
        timing = f"×{r['ratio']:.2f} ({r['ratio_q1']:.2f}–{r['ratio_q3']:.2f})"
        predicted_peak = predicted_ratio = ""
        extra = f"{r['extra_ms']:+.1f}"
        if "predicted_peak" in r:
            error = r["peak_above_params"] / r["predicted_peak"] - 1
            predicted_peak = f"{format_bytes(r['predicted_peak'])} ({error:+.1%})"
            predicted_ratio = f"×{r['predicted_ratio']:.2f}"
            extra += f" / {r['predicted_extra_ms']:+.1f}"
        lines.append(f"| {r['model']} | {r['mode']} | {format_bytes(r['peak_above_params'])} | {share:.0%} | "
                     f"{predicted_peak} | {timing} | {predicted_ratio} | {extra} | {r['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["demo", "gpt"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-blocks-only", action="store_true",
                        help="skip the plans restricted to block-level options")
    add_optimizer_argument(parser)
    parser.add_argument("--json", default="frontier_results.json")
    parser.add_argument("--compiled-one", nargs=2, metavar=("MODEL", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.compiled_one:
        name, budget = args.compiled_one
        print(json.dumps(measure_compiled(name, float(budget), args.repeats, args.warmup, args.optimizer)))
        return
    rows = []
    for name in args.models:
        rows += measure_eager(name, args.repeats, args.warmup, args.optimizer, not args.no_blocks_only)
        if not args.no_compile:
            rows += [_compiled_in_subprocess(name, b, args.repeats, args.warmup, args.optimizer)
                     for b in COMPILE_BUDGETS]
    print(format_table(rows))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
