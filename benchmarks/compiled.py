"""Whole-model torch.compile (inductor, CPU): remat vs PyTorch's checkpoint vs no checkpointing.

Run by hand (never in CI):

    python benchmarks/compiled.py                       # GPT d=128, 4 layers, seq 128, batch 8
    python benchmarks/compiled.py --repeats 31 --layers 2

Every variant is the same GPT (same seed) with its blocks wrapped, compiled whole with
``torch.compile(model, backend="inductor", fullgraph=True)``: ``plain`` (no checkpointing), ``torch``
(PyTorch's ``apply_activation_checkpointing``), ``remat`` (``remat.apply_activation_checkpointing``), and the
selective pair ``torch-sac`` / ``remat-sac`` (keep matmul outputs: PyTorch's selective-checkpoint contexts
with that policy, remat's ``save_matmuls``).  One training step (forward + backward) per variant per round,
rounds interleaved with the order rotated on the device's clock (``remat.tools.bench.interleaved_rounds``),
warm-up rounds excluded; medians with interquartile ranges, and the median of the per-round ratios
remat/torch (robust to machine drift).  Saved bytes are the distinct
non-parameter storages that reach an outer ``saved_tensors_hooks`` during the compiled forward
(deterministic).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.utils.checkpoint as torch_ckpt
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.planning.basics.memory import saved_bytes
from remat.policies.rules import MATMUL_OPS, save_matmuls
from remat.tools.bench import interleaved_rounds


def _is_block(module: torch.nn.Module) -> bool:
    return isinstance(module, Block)


def _torch_keep_matmuls(ctx, op, *args, **kwargs):
    policy = torch_ckpt.CheckpointPolicy
    return policy.PREFER_SAVE if op in MATMUL_OPS else policy.PREFER_RECOMPUTE


def _torch_wrap(model: torch.nn.Module, selective: bool) -> None:
    extra = {}
    if selective:
        extra["context_fn"] = functools.partial(torch_ckpt.create_selective_checkpoint_contexts, _torch_keep_matmuls)
    wrapper = functools.partial(torch_wrappers.checkpoint_wrapper, **extra)
    torch_wrappers.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=_is_block)


WRAPS: dict[str, Callable[[torch.nn.Module], object]] = {
    "plain": lambda m: None,
    "torch": lambda m: _torch_wrap(m, selective=False),
    "remat": lambda m: remat.apply_activation_checkpointing(m, check_fn=_is_block),
    "torch-sac": lambda m: _torch_wrap(m, selective=True),
    "remat-sac": lambda m: remat.apply_activation_checkpointing(m, check_fn=_is_block, policy=save_matmuls),
}


def _quartiles(samples: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return q1, median, q3


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq_len=args.seq,
                    vocab_size=512, dropout=0.1)
    tokens, targets = synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(1))
    models, steps, results = {}, {}, {}
    for name in args.variants:
        torch.manual_seed(0)
        model = GPT(cfg)
        WRAPS[name](model)
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        models[name] = model
        steps[name] = functools.partial(_loss, compiled, tokens, targets)
        start = time.perf_counter()
        steps[name]().backward()  # compile forward and backward
        results[name] = {"compile_s": time.perf_counter() - start}
    rounds = interleaved_rounds({name: functools.partial(_step, models[name], steps[name]) for name in args.variants},
                                args.repeats, args.warmup)
    times = {name: [r[name] for r in rounds] for name in args.variants}
    for name in args.variants:
        q1, median, q3 = _quartiles(times[name])
        models[name].zero_grad(set_to_none=True)
        results[name].update(median_ms=median * 1e3, iqr_ms=(q3 - q1) * 1e3,
                             saved_bytes=saved_bytes(steps[name], list(models[name].parameters())))
    ratios = {}
    for ours, theirs in (("remat", "torch"), ("remat-sac", "torch-sac")):
        if ours in times and theirs in times:
            per_round = [a / b for a, b in zip(times[ours], times[theirs])]
            ratios[f"{ours}/{theirs}"] = dict(zip(("q1", "median", "q3"), _quartiles(per_round)))
    machine = f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), " \
              f"python {platform.python_version()}"
    return {"machine": machine, "config": vars(args), "variants": results, "ratios": ratios}


def _step(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    loss().backward()


def _loss(compiled: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)
    logits = compiled(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def format_table(report: dict) -> str:
    lines = ["| variant | step ms (median ± IQR) | saved MiB | compile s |", "|---|---|---|---|"]
    for name, r in report["variants"].items():
        lines.append(f"| {name} | {r['median_ms']:.1f} ± {r['iqr_ms']:.1f} | {r['saved_bytes'] / 2**20:.2f} "
                     f"| {r['compile_s']:.0f} |")
    for pair, q in report["ratios"].items():
        lines.append(f"\nper-round ratio {pair}: median {q['median']:.3f} (IQR {q['q1']:.3f}–{q['q3']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="*", default=list(WRAPS), choices=list(WRAPS))
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="bench_compiled.json")
    args = parser.parse_args(argv)
    report = run(args)
    print(f"machine: {report['machine']}; median of {args.repeats} interleaved rounds")
    print(format_table(report))
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
