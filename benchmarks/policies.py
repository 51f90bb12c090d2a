"""Selective checkpointing: remat's policies against torch's, and against plain and full checkpointing.

Run by hand (never in CI):

    python benchmarks/policies.py                      # both models, 15 rounds
    python benchmarks/policies.py --models demo --repeats 21
    python benchmarks/policies.py --models tiny --repeats 41   # per-operator dispatch cost

Two policies: keep the outputs of ``remat.policies.MATMUL_OPS``, or keep every op's output (nothing is
recomputed, so what it costs above plain is the machinery alone).  Variants:

* ``plain`` — no checkpointing; ``full`` — ``remat.checkpoint`` on every block;
* ``torch-sac`` — ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with torch's
  ``create_selective_checkpoint_contexts`` and a policy function returning torch's ``CheckpointPolicy``;
* ``remat-ctx`` — ``remat.checkpoint`` with remat's ``create_selective_checkpoint_contexts`` and the *same*
  policy function (``context_fn=``);
* ``remat-policy`` — ``remat.apply_activation_checkpointing(model, policy=save_matmuls)`` (the wrappers,
  with remat's rules policy: asked once per op, no context object per call);
* ``torch-sac-all``, ``remat-all`` — the keep-everything policy, in torch's SAC and in remat.  On models
  with dropout torch's SAC refuses to keep everything: the region changes a kept output in place (dropout's
  mask, divided in place after it is drawn), and torch raises "Tensor cached during selective activation
  checkpoint has been mutated".  A torch variant that torch refuses is listed with its error, not timed.

The table's last column is the host time per forward op above plain: (variant − plain) / the number of
aten ops the plain forward runs — the per-op price of the machinery on the ``tiny`` model.

Models: ``gpt`` (the ``remat bench`` case: 6 GPT blocks, d 256, 4 heads, seq 256, batch 8, dropout 0.1,
random float input), ``demo`` (the ``remat demo`` defaults: ``remat.models.GPT`` with 4 blocks, d 128,
4 heads, seq 256, vocab 512, batch 8, dropout 0.1, cross-entropy loss) and ``tiny`` (8 blocks of 60 ops on
4x16 tensors, a 16x16 matmul every fourth op: launch-bound, so the per-operator cost of the policy's
dispatch modes dominates).

Each round times one training step (zero grads, forward, backward) of every variant, the order rotated
round to round so machine noise hits all alike; warm-up rounds are excluded.  Each variant's own optimizer
(``--optimizer``, AdamW with ``foreach`` by default) steps its parameters after each of its steps, outside
the timed span: the steps timed are those of a training loop, whose optimizer writes every parameter in
place between them, and the optimizer's own time, equal for every variant, stays out of the ratios.  Time
ratios are taken within a round (variant / torch-sac, / full and / plain) and reported as the median with the
interquartile range.
The clock is the process's CPU time by default (``--clock cpu``): with one torch thread it is the step's
own work, and unlike wall time it does not count the time other processes on a shared machine hold the
cores; ``--clock wall`` measures wall time.  Peaks are MemTracker's whole-step peak minus parameters and
buffers (exact bytes), measured once after the timed rounds, with the optimizer's state in place and not
counted.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_ckpt
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import CheckpointPolicy
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.planning.basics.optimizers import make_optimizer
from remat.policies import Policy
from remat.policies.rules import MATMUL_OPS, save_matmuls
from remat.tools.arguments import add_optimizer_argument
from remat.tools.bench import Chain

VARIANTS = ("plain", "full", "torch-sac", "remat-ctx", "remat-policy", "torch-sac-all", "remat-all")


def keep_matmuls(ctx, op, *args, **kwargs):
    """The policy function given to both torch's and remat's ``create_selective_checkpoint_contexts``."""
    return torch_ckpt.CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else torch_ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def keep_everything(ctx, op, *args, **kwargs):
    """torch's policy function that keeps every op's output."""
    return torch_ckpt.CheckpointPolicy.MUST_SAVE


save_everything = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE, name="save everything")


class _Wrapped(nn.Module):
    """Runs ``block`` through ``run(block, x)``; keeps the block's parameters as its own."""

    def __init__(self, block: nn.Module, run: Callable) -> None:
        super().__init__()
        self.block, self.run = block, run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.block, x)


def _torch_sac(block, x):
    context = functools.partial(torch_ckpt.create_selective_checkpoint_contexts, keep_matmuls)
    return torch_ckpt.checkpoint(block, x, use_reentrant=False, context_fn=context)


def _remat_ctx(block, x):
    return remat.checkpoint(block, x, context_fn=functools.partial(remat.create_selective_checkpoint_contexts,
                                                                   keep_matmuls))


def _torch_sac_all(block, x):
    context = functools.partial(torch_ckpt.create_selective_checkpoint_contexts, keep_everything)
    return torch_ckpt.checkpoint(block, x, use_reentrant=False, context_fn=context)


def _remat_all(block, x):
    return remat.checkpoint(block, x, policy=save_everything)


_TORCH_VARIANTS = ("torch-sac", "torch-sac-all")

_RUNS = {"full": remat.checkpoint, "torch-sac": _torch_sac, "remat-ctx": _remat_ctx, "torch-sac-all": _torch_sac_all,
         "remat-all": _remat_all}


def _prepare(model: nn.Module, blocks_attr: str, variant: str) -> nn.Module:
    """A copy of ``model`` whose blocks run under ``variant``."""
    model = copy.deepcopy(model)
    blocks = getattr(model, blocks_attr)
    if variant == "remat-policy":
        chosen = {id(block) for block in blocks}
        remat.apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen, policy=save_matmuls)
    elif variant != "plain":
        for i, block in enumerate(blocks):
            blocks[i] = _Wrapped(block, _RUNS[variant])
    return model


class _TinyBlock(nn.Module):
    """20 × (an op, a square, a shift); every 4th op a matmul then ``tanh``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(20):
            if i % 4 == 0:
                x = x @ self.weight
                x = x.tanh()
            else:
                x = x.sin()
            x = x * x
            x = x + 0.5
        return x


def _models() -> dict[str, Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor], str]]]:
    def gpt():
        torch.manual_seed(0)
        cfg = GPTConfig(d_model=256, n_heads=4, seq_len=256, dropout=0.1)
        model = Chain(nn.ModuleList(Block(cfg) for _ in range(6)))
        x = torch.randn(8, 256, 256)

        def loss(m):
            return m(x.clone().requires_grad_()).float().pow(2).mean()

        return model, loss, "6 GPT blocks, d 256, seq 256, batch 8 (remat bench's gpt)"

    def demo():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_heads=4, n_layers=4, dropout=0.1)
        model = GPT(cfg)
        tokens, targets = synthetic_batch(cfg, 8, torch.Generator().manual_seed(0))

        def loss(m):
            return F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())

        return model, loss, "demo GPT: 4 blocks, d 128, seq 256, batch 8 (remat demo defaults)"

    def tiny():
        torch.manual_seed(0)
        model = Chain(nn.ModuleList(_TinyBlock() for _ in range(8)))
        x = torch.randn(4, 16)

        def loss(m):
            return m(x.clone().requires_grad_()).sum()

        return model, loss, "8 blocks x 60 ops on 4x16, a 16x16 matmul every 4th op (launch-bound)"

    return {"gpt": gpt, "demo": demo, "tiny": tiny}


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _forward_ops(model: nn.Module, loss: Callable) -> int:
    """The number of aten ops one forward of ``model`` (plain) runs."""
    with torch.no_grad(), _CountOps() as counter:
        loss(model)
    return counter.count


def _step(model: nn.Module, loss: Callable, seed: int) -> None:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss(model).backward()


def _quartiles(samples: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(samples, n=4)
    return q1, statistics.median(samples), q3


_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def run_model(name: str, variants: list[str], repeats: int, warmup: int, check: bool, clock: str = "cpu",
              optimizer: str = "adamw") -> dict:
    """Time and measure every variant on one model; optionally check gradients against plain autograd."""
    base, loss, description = _models()[name]()
    models = {v: _prepare(base, "blocks", v) for v in variants}
    refused = {}
    for v in [v for v in variants if v in _TORCH_VARIANTS]:
        try:
            _step(models[v], loss, seed=1)
        except RuntimeError as error:  # torch's SAC refusing this model under this policy: told, not timed
            refused[v] = str(error).strip().splitlines()[0]
            del models[v]
    variants = [v for v in variants if v not in refused]
    optimizers = {v: make_optimizer(optimizer, models[v].parameters()) for v in variants}
    if check:
        reference = None
        for v in variants:
            _step(models[v], loss, seed=1)
            found = [p.grad.clone() for p in models[v].parameters()]
            if reference is None:
                reference = found
            elif not all(torch.equal(a, b) for a, b in zip(reference, found)):
                raise AssertionError(f"{name}: {v}'s gradients differ from {variants[0]}'s")
    now = _CLOCKS[clock]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_index in range(warmup + repeats):
        shift = round_index % len(variants)
        for v in variants[shift:] + variants[:shift]:
            start = now()
            _step(models[v], loss, seed=round_index)
            elapsed = now() - start
            optimizers[v].step()
            if round_index >= warmup:
                times[v].append(elapsed)
    result = {"description": description, "forward_ops": _forward_ops(models[variants[0]], loss), "variants": {},
              "refused": refused}
    for v in variants:
        memory = remat.measure_step(functools.partial(_step, models[v], loss, 0), models[v])
        entry = {"median_ms": statistics.median(times[v]) * 1e3, "peak_above_params": memory.peak_above_params}
        for against in ("torch-sac", "full", "plain"):
            if against in times:
                ratios = [a / b for a, b in zip(times[v], times[against])]
                entry[f"ratio_to_{against}"] = _quartiles(ratios)
        result["variants"][v] = entry
    if "plain" in times:
        for entry in result["variants"].values():
            entry["host_us_per_op"] = (entry["median_ms"] - result["variants"]["plain"]["median_ms"]) * 1e3 \
                / result["forward_ops"]
    return result


def _ratio_cell(entry: dict, key: str) -> str:
    if key not in entry:
        return "-"
    q1, median, q3 = entry[key]
    return f"{median:.3f} [{q1:.3f}–{q3:.3f}]"


def format_table(results: dict) -> str:
    """One markdown row per (model, variant)."""
    lines = [
        "| model | variant | median ms | / torch-sac (IQR) | / full (IQR) | / plain (IQR) | peak above params MiB "
        "| µs per forward op above plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, res in results["models"].items():
        for v, entry in res["variants"].items():
            per_op = f"{entry['host_us_per_op']:.1f}" if "host_us_per_op" in entry else "-"
            lines.append(
                f"| {name} | {v} | {entry['median_ms']:.1f} | {_ratio_cell(entry, 'ratio_to_torch-sac')} | "
                f"{_ratio_cell(entry, 'ratio_to_full')} | {_ratio_cell(entry, 'ratio_to_plain')} | "
                f"{entry['peak_above_params'] / 2**20:.2f} | {per_op} |"
            )
        for v, why in res.get("refused", {}).items():
            lines.append(f"| {name} | {v} | refused by torch: {why} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and write the JSON file."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["gpt", "demo"], choices=list(_models()))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=list(_CLOCKS), default="cpu", help="cpu (process CPU time) or wall")
    add_optimizer_argument(parser)
    parser.add_argument("--no-check", action="store_true", help="skip the gradient equality check")
    parser.add_argument("--json", default="policies_results.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), " \
              f"python {platform.python_version()}"
    results = {"machine": machine, "repeats": args.repeats, "clock": args.clock, "optimizer": args.optimizer,
               "models": {}}
    for name in args.models:
        results["models"][name] = run_model(name, list(args.variants), args.repeats, args.warmup,
                                            check=not args.no_check, clock=args.clock, optimizer=args.optimizer)
    print(f"{machine}; {args.clock} time, {args.repeats} interleaved rounds, {args.optimizer} stepped between; "
          "ratios: median [interquartile range] of per-round ratios")
    print(format_table(results))
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
