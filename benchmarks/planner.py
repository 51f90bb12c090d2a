"""How good are remat's plans? Predicted vs measured, and against uniform checkpointing at equal memory.

Run by hand:  python benchmarks/planner.py [--repeats 7]

For the demo GPT and a heterogeneous chain, and budgets of 20/35/50/75/100% of the
unplanned step's peak above parameters, it reports the plan's predicted and
measured (MemTracker) whole-step peak above parameters, its predicted and
measured step-time overhead over no checkpointing, and the overhead of the
cheapest every-k checkpointing (k = 1 is full checkpointing) whose measured peak
also fits the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.discovery import candidate_modules
from remat.planning.basics.units import format_bytes
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile
from remat.tools.bench import WideBlock

FRACTIONS = (0.2, 0.35, 0.5, 0.75, 1.0)




def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=6, d_model=128, n_heads=4, seq_len=256, vocab_size=512, dropout=0.1)
    tokens, targets = synthetic_batch(cfg, 8)
    return GPT(cfg), (tokens,), lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _chain():
    torch.manual_seed(0)
    hidden = [256, 1024, 512, 2048, 256, 1536, 768, 512]
    model = nn.Sequential(nn.Sequential(*[WideBlock(256, h) for h in hidden]), nn.Linear(256, 1))
    return model, (torch.randn(512, 256),), lambda out: out.pow(2).mean()


def _every_k(k: int):
    def decide(names):
        return {name: ("checkpoint" if i % k == 0 else "keep") for i, name in enumerate(names)}

    return decide


def _measure_peak(model, inputs, loss_fn) -> int:
    result = remat.measure_step(lambda: loss_fn(model(*inputs)).backward(), model)
    model.zero_grad(set_to_none=True)
    return result.peak_above_params


def _times(model, inputs, loss_fn, configs: dict, repeats: int) -> dict[str, float]:
    """Median step time of each config (a decisions dict), interleaved round-robin."""
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for round_index in range(repeats + 1):
        for name, plan in configs.items():
            plan.apply(model)
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss_fn(model(*inputs)).backward()
            elapsed = time.perf_counter() - start
            plan.remove(model)
            if round_index:  # the first round warms up
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def run(name: str, build, repeats: int) -> list[dict]:
    model, inputs, loss_fn = build()
    prof = remat.profile(model, *inputs, loss_fn=loss_fn, hold_output=False)  # as its step: the output dropped
    names = [n for n, _ in candidate_modules(model)]
    base = plan_from_profile(prof, 1.0)
    uniform = {}
    for k in range(1, len(names) + 1):
        p = plan_from_profile(prof, 1.0)
        p.decisions = _every_k(k)(names)
        uniform[f"every-{k}"] = p
    plans = {}
    for fraction in FRACTIONS:
        try:
            plans[fraction] = plan_from_profile(prof, fraction)
        except InfeasibleBudget as error:
            plans[fraction] = error
    configs = {"none": base, **uniform, **{f"plan-{f}": p for f, p in plans.items() if not isinstance(p, Exception)}}
    times = _times(model, inputs, loss_fn, configs, repeats)
    peaks = {}
    for label, p in configs.items():
        p.apply(model)
        peaks[label] = _measure_peak(model, inputs, loss_fn)
        p.remove(model)
    rows = []
    for fraction, p in plans.items():
        budget_above = int(fraction * prof.peak_above_params)
        fitting = [u for u in uniform if peaks[u] <= budget_above]
        best_uniform = min(fitting, key=lambda u: times[u]) if fitting else None
        row = {"model": name, "budget": fraction, "budget_above_params": budget_above}
        if isinstance(p, Exception):
            row.update(infeasible=True, smallest_above_params=p.smallest - prof.param_bytes - prof.buffer_bytes)
        else:
            label = f"plan-{fraction}"
            row.update(
                infeasible=False,
                decisions="".join(d[0].upper() for d in p.decisions.values()),
                predicted_above=p.predicted_peak - p.param_bytes,
                measured_above=peaks[label],
                predicted_overhead=p.predicted_extra_time / prof.step_time,
                measured_overhead=times[label] / times["none"] - 1,
            )
        row.update(
            full_overhead=times["every-1"] / times["none"] - 1, full_above=peaks["every-1"],
            best_uniform=best_uniform,
            best_uniform_overhead=(times[best_uniform] / times["none"] - 1) if best_uniform else None,
        )
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "| model | budget | plan (K/C/S) | predicted peak | measured peak | predicted overhead | measured overhead "
        "| full ckpt overhead | best every-k at this memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['budget']:.0%} = {format_bytes(r['budget_above_params'])}"
        uniform = (f"{r['best_uniform']}: {r['best_uniform_overhead']:+.0%}" if r["best_uniform"] else "none fits")
        if r["infeasible"]:
            lines.append(f"| {r['model']} | {budget} | infeasible (min {format_bytes(r['smallest_above_params'])}) "
                         f"| | | | | {r['full_overhead']:+.0%} | {uniform} |")
            continue
        lines.append(
            f"| {r['model']} | {budget} | {r['decisions']} | {format_bytes(r['predicted_above'])} | "
            f"{format_bytes(r['measured_above'])} | {r['predicted_overhead']:+.0%} | {r['measured_overhead']:+.0%} | "
            f"{r['full_overhead']:+.0%} | {uniform} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="planner_results.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = run("gpt", _gpt, args.repeats) + run("chain", _chain, args.repeats)
    print("peaks are above parameters (MemTracker); overheads are step time vs no checkpointing; "
          "K = keep, C = checkpoint, S = save_matmuls")
    print(_table(rows))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
