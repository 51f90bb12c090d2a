"""Op-level fronts: the demo GPT block's front of op-level policies, and what three points of it do to a step.

Run by hand:  python benchmarks/opfront.py [--repeats 7] [--json opfront_results.json]

1. Profiles the demo GPT at ``remat demo`` defaults (4 layers, d 128, 4 heads, seq 256,
   batch 8, dropout 0.1) op by op and prints its block's front: kept bytes vs predicted
   extra time per step, the recomputation's peak and how far the block's backward goes
   above plain autograd.
2. Picks the cheapest front points that keep at most 25%, 50% and 75% of what plain
   autograd keeps, puts every block at that point, and measures the whole training step
   against no checkpointing and full checkpointing: step time (interleaved rounds, one
   thread, medians; ratios to plain per round with their interquartile range) and peak
   memory above parameters (MemTracker).
3. Times the profile and the front, and the front of a 200-block model (one distinct
   block, so one front).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.blockpolicy import apply_block_policies
from remat.planning.basics.units import format_bytes
from remat.planning.choices.fronts import fronts, needed_ops, policy_for, thin_front
from remat.planning.measure.opgraph import profile_ops
from remat.tools.bench import interleaved_rounds

FRACTIONS = (0.25, 0.5, 0.75)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, median, q3


def _front_table(graph, front) -> str:
    lines = ["| kept | predicted extra / block | recompute peak | backward above plain | ops rerun | kept op outputs |",
             "|---|---|---|---|---|---|"]
    for p in thin_front(front, 16):
        kept = ", ".join(f"{graph.nodes[i].op.split('.')[1]}#{graph.nodes[i].call}" for i in p.kept
                         if graph.nodes[i].out_bytes >= 2**16)  # leave out the tiny mask constants
        lines.append(f"| {format_bytes(p.kept_bytes)} ({p.mode}) | {p.extra_time * 1e3:.1f} ms | "
                     f"{format_bytes(p.recompute_peak)} | {format_bytes(p.backward_extra)} | {p.recomputed_ops} | "
                     f"{kept or '-'} |")
    return "\n".join(lines)


def _step(model: GPT, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model.loss(tokens, targets).backward()


def run(repeats: int) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=256)
    reference = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 8)

    start = time.perf_counter()
    prof = profile_ops(copy.deepcopy(reference), tokens)
    profile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    per_block = fronts(prof)
    front_seconds = time.perf_counter() - start
    graph = prof.blocks["blocks.0"]
    front = per_block["blocks.0"]

    chosen = {}
    for fraction in FRACTIONS:
        fitting = [p for p in front if p.kept_bytes <= fraction * graph.keep_all_bytes]
        chosen[f"front {fraction:.0%}"] = fitting[-1]
    configs = {"plain": None, "checkpoint": front[0], **chosen}
    models = {}
    for label, point in configs.items():
        model = copy.deepcopy(reference)
        if point is not None:
            apply_block_policies(model, {name: policy_for(prof.blocks[name], point) for name in prof.blocks})
        models[label] = model

    rounds = interleaved_rounds({label: lambda m=model: _step(m, tokens, targets) for label, model in models.items()},
                                repeats)
    samples = {label: [r[label] for r in rounds] for label in configs}
    ratios = {label: [r[label] / r["plain"] for r in rounds] for label in configs}
    # Extra time relative to full checkpointing's in the same round: robust to the machine's load changing
    # between the profile and the measurement, which shifts absolute predictions.
    shares = {label: [(r[label] - r["plain"]) / (r["checkpoint"] - r["plain"]) for r in rounds] for label in configs}
    peaks = {label: remat.measure_step(lambda m=model: _step(m, tokens, targets), model).peak_above_params
             for label, model in models.items()}
    plain_time = statistics.median(samples["plain"])

    rows = []
    for label, point in configs.items():
        q1, ratio, q3 = _quartiles(ratios[label])
        row = {"config": label, "step_ms": statistics.median(samples[label]) * 1e3, "ratio": ratio,
               "ratio_iqr": [q1, q3], "peak_above_params": peaks[label],
               "peak_vs_plain": peaks[label] / peaks["plain"]}
        if point is not None:
            skippable = [i for i in range(graph.stop) if graph.nodes[i].kind != "ignored"
                         and i not in point.kept and i not in needed_ops(graph, point.kept)]
            row.update(mode=point.mode, kept_per_block=point.kept_bytes, kept_vs_keep_all=point.kept_bytes
                       / graph.keep_all_bytes, predicted_extra_ms=len(prof.blocks) * point.extra_time * 1e3,
                       measured_extra_ms=(statistics.median(samples[label]) - plain_time) * 1e3,
                       backward_extra=point.backward_extra,
                       share_predicted=point.extra_time / front[0].extra_time,
                       share_measured=_quartiles(shares[label]),
                       skippable_kernel_ms=len(prof.blocks) * sum(graph.nodes[i].kernel_time for i in skippable)
                       * 1e3)
        rows.append(row)

    # 200 identical blocks: one graph, one front (estimated times: the point is the solve, not the timing).
    big_cfg = GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=200, vocab_size=128, dropout=0.1)
    with torch.device("meta"):
        big = GPT(big_cfg)
        big_tokens = torch.zeros(2, big_cfg.seq_len, dtype=torch.long)
    start = time.perf_counter()
    big_prof = profile_ops(big, big_tokens, overheads=graph.overheads)
    big_profile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    big_fronts = fronts(big_prof)
    big_front_seconds = time.perf_counter() - start

    return {
        "graph": str(graph), "overheads": graph.overheads.__dict__, "front_points": len(front),
        "random_ms": sum(n.kernel_time for n in graph.nodes[:graph.stop] if n.random) * 1e3,
        "forward_ms": graph.forward_time * 1e3,
        "front_table": _front_table(graph, front), "profile_seconds": profile_seconds,
        "front_seconds": front_seconds, "keep_all_bytes": graph.keep_all_bytes, "rows": rows,
        "repeats": repeats, "big": {"blocks": len(big_prof.blocks), "distinct": len(big_prof.distinct),
                                    "front_points": len(big_fronts["blocks.0"]),
                                    "profile_seconds": big_profile_seconds, "front_seconds": big_front_seconds},
    }


def _rows_table(result: dict) -> str:
    lines = ["| every block at | kept / block | peak above params (vs plain) | step (median) | × plain [IQR] | "
             "predicted extra | measured extra | extra vs full ckpt: predicted / measured [IQR] "
             "| backward above plain / block | skippable kernels |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        kept = (f"{format_bytes(r['kept_per_block'])} ({r['kept_vs_keep_all']:.0%})" if "mode" in r
                else format_bytes(result["keep_all_bytes"]) + " (100%)")
        if "mode" in r:
            q1, share, q3 = r["share_measured"]
            extra = (f"{r['predicted_extra_ms']:.0f} ms", f"{r['measured_extra_ms']:.0f} ms",
                     f"{r['share_predicted']:.2f} / {share:.2f} [{q1:.2f}–{q3:.2f}]",
                     format_bytes(r["backward_extra"]), f"{r['skippable_kernel_ms']:.1f} ms")
        else:
            extra = ("",) * 5
        lines.append(f"| {r['config']} | {kept} | {format_bytes(r['peak_above_params'])} ({r['peak_vs_plain']:.0%}) | "
                     f"{r['step_ms']:.0f} ms | ×{r['ratio']:.2f} [{r['ratio_iqr'][0]:.2f}–{r['ratio_iqr'][1]:.2f}] | "
                     + " | ".join(extra) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="opfront_results.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args.repeats)
    print(result["graph"])
    print(f"\nmachinery overheads (s): {result['overheads']}")
    print(f"\nfront of the demo block: {result['front_points']} points (16 shown)")
    print(result["front_table"])
    print(f"\nprofile {result['profile_seconds']:.2f} s, fronts {result['front_seconds']:.3f} s; block forward "
          f"{result['forward_ms']:.1f} ms, of which random ops (rerun unless a point keeps them) "
          f"{result['random_ms']:.1f} ms")
    print(f"\nwhole step, every block at one point ({args.repeats} interleaved rounds, {args.threads} thread):")
    print(_rows_table(result))
    big = result["big"]
    print(f"\n200-block GPT on meta: {big['blocks']} blocks, {big['distinct']} distinct graph, "
          f"{big['front_points']} front points; profile {big['profile_seconds']:.2f} s, fronts "
          f"{big['front_seconds']:.3f} s")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
