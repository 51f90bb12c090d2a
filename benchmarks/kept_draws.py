"""Kept dropout draws: the demo GPT with every block checkpointed, with and without its dropout masks kept.

Run by hand:  python benchmarks/kept_draws.py [--repeats 15]

The demo GPT at ``remat demo`` defaults (4 layers, d 128, 4 heads, seq 256, batch 8, dropout 0.1), every
block at one point of its op-level front: ``checkpoint`` (inputs only), ``checkpoint + masks`` (the three
``bernoulli_`` draws kept by value, everything else recomputed) and the cheapest front point holding at most
as many bytes as ``checkpoint + masks``.  Whole training steps, interleaved rounds (plain first in each),
one thread; medians of the step time, ratios to plain and to checkpoint per round with their interquartile
range, peak above parameters (MemTracker) and the cost model's prediction.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.blockpolicy import apply_block_policies
from remat.planning.basics.units import format_bytes
from remat.planning.choices.fronts import block_front, evaluate, policy_for
from remat.planning.measure.opgraph import profile_ops
from remat.tools.bench import interleaved_rounds


def _step(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model.loss(tokens, targets).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=256)
    reference = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 8)
    prof = profile_ops(copy.deepcopy(reference), tokens)
    graph = prof.blocks["blocks.0"]
    draws = [n.index for n in graph.nodes if n.random]
    masks = evaluate(graph, "selective", draws)
    front = block_front(graph)
    same_bytes = [p for p in front if p.kept_bytes <= masks.kept_bytes][-1]
    points = {"checkpoint": front[0], "checkpoint + masks": masks, "front at ≤ same bytes": same_bytes}
    print(f"block forward {graph.forward_time * 1e3:.1f} ms; draws {[graph.nodes[i].kernel_time * 1e3 for i in draws]}"
          f" ms; copy {graph.overheads.copy_per_byte * 1e9:.3f} ns/B")
    for label, point in points.items():
        print(f"{label}: {point.describe(graph)}")
    models = {"plain": copy.deepcopy(reference)}
    for label, point in points.items():
        model = copy.deepcopy(reference)
        apply_block_policies(model, {name: policy_for(prof.blocks[name], point) for name in prof.blocks})
        models[label] = model
    rounds = interleaved_rounds({label: lambda m=model: _step(m, tokens, targets) for label, model in models.items()},
                                args.repeats)
    samples = {label: [r[label] for r in rounds] for label in models}
    ratios = {label: [r[label] / r["plain"] for r in rounds] for label in models}
    versus_checkpoint = {label: [r[label] / r["checkpoint"] for r in rounds] for label in models}
    peaks = {label: remat.measure_step(lambda m=model: _step(m, tokens, targets), model).peak_above_params
             for label, model in models.items()}
    print(f"\n{args.repeats} interleaved rounds, 1 thread")
    print("| every block at | kept / block | peak above params | step (median) | × plain [IQR] | × checkpoint [IQR] "
          "| predicted extra |")
    print("|---|---|---|---|---|---|---|")
    for label in models:
        q1, ratio, q3 = statistics.quantiles(ratios[label], n=4)
        c1, versus, c3 = statistics.quantiles(versus_checkpoint[label], n=4)
        point = points.get(label)
        kept = format_bytes(point.kept_bytes) if point else format_bytes(graph.keep_all_bytes)
        predicted = f"{len(prof.blocks) * point.extra_time * 1e3:.0f} ms" if point else ""
        print(f"| {label} | {kept} | {format_bytes(peaks[label])} | {statistics.median(samples[label]) * 1e3:.0f} ms "
              f"| ×{ratio:.2f} [{q1:.2f}–{q3:.2f}] | ×{versus:.2f} [{c1:.2f}–{c3:.2f}] | {predicted} |")


if __name__ == "__main__":
    main()
