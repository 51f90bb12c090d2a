"""Per-rank predicted vs measured peaks of plans made on every rank of a distributed job.

Run by hand under torchrun (CPU, gloo):

    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/ranks.py
    ... benchmarks/ranks.py --models gpt --wrappers fsdp2 ddp --budgets 90% 70% 50%

For each model (remat's GPT, a 4-layer Hugging Face Llama of hidden size 64) and each wrapper (FSDP2 per block
then the root, resharded after forward or kept gathered; DDP; on request FSDP2 with bfloat16 parameters, with
CPU offload (``pin_memory=False``), or with blocks resharded to half the world after forward: on 2 ranks 1, which
FSDP2 reads as False), every rank profiles the wrapped model once
(``remat.profile``, on every rank: rank 0's profile on all), plans at each budget, applies the plan to a fresh
wrapped model and trains 3 SGD steps, each measured with ``remat.measure_step`` (MemTracker: the model
and the optimizer tracked).  Rank 0 prints one row per model, wrapper, budget and rank: the plan's predicted
peak (whole step) and each step's measured peak, and the largest difference (relative, and in bytes).  Every
rank has its own batches.  A step holds the model's output until backward ends, as ``remat.profile`` measures
by default.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.units import format_bytes

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

STEPS = 3


def _gpt():
    cfg = GPTConfig(vocab_size=128, seq_len=64, d_model=64, n_heads=4, n_layers=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = []
    for _ in range(STEPS):
        tokens, targets = synthetic_batch(cfg, 4, generator=generator)
        batches.append(((tokens,), {}, lambda logits, t=targets: F.cross_entropy(logits.flatten(0, 1), t.flatten())))
    return model, model.blocks, batches


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=generator)
        batches.append(((), {"input_ids": ids, "labels": ids}, None))
    return model, model.model.layers, batches


MODELS = {"gpt": _gpt, "llama": _llama}


def _wrapped(build, wrapper: str, plan=None):
    model, blocks, batches = build()
    if plan is not None:
        plan.apply(model)  # before wrapping: the plan's names are the model's own
    if wrapper == "ddp":
        return DDP(model), batches
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    settings = {"reshard_after_forward": wrapper != "fsdp2_kept"}
    if wrapper == "fsdp2_bf16":
        settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if wrapper == "fsdp2_offload":
        settings["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinned memory needs an accelerator
    # fsdp2_int: each block resharded after forward to half the world (on 2 ranks, 1: a whole copy per rank until
    # backward, which FSDP2 reads as False)
    half = max(1, dist.get_world_size() // 2)
    per_block = {**settings, "reshard_after_forward": half} if wrapper == "fsdp2_int" else settings
    for block in blocks:  # a planned block: its checkpoint wrapper, which the ModuleList holds now
        fully_shard(block, mesh=mesh, **per_block)
    return fully_shard(model, mesh=mesh, **settings), batches


def _loss(model, args, kwargs, loss_fn):
    """The model's output and its loss: the step holds the output until backward ends, as remat.profile's
    default ``hold_output`` measures it (``out = model(x); out.loss.backward()``)."""
    output = model(*args, **kwargs)
    return output, output.loss if loss_fn is None else loss_fn(output)


def _measured(model, batches) -> list[int]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks = []
    for step, (args, kwargs, loss_fn) in enumerate(batches):
        torch.manual_seed(step)

        def run(args=args, kwargs=kwargs, loss_fn=loss_fn):
            opt.zero_grad(set_to_none=True)
            output, loss = _loss(model, args, kwargs, loss_fn)
            loss.backward()
            del output
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
    return peaks


def _rows(name: str, wrapper: str, budgets: list[str]) -> list[dict]:
    build = MODELS[name]
    model, batches = _wrapped(build, wrapper)
    args, kwargs, loss_fn = batches[0]
    prof = remat.profile(model, *args, loss_fn=loss_fn, **kwargs)
    rows = [{"budget": "none", "predicted": prof.peak_bytes, "measured": _measured(model, batches)}]
    for budget in budgets:
        try:
            plan = prof.plan(budget)
        except remat.InfeasibleBudget as refused:
            rows.append({"budget": budget, "refused": refused.smallest})
            continue
        fresh, batches = _wrapped(build, wrapper)
        rows.append({"budget": budget, "predicted": plan.predicted_peak,
                     "measured": _measured(plan.apply(fresh), batches),
                     "checkpointed": sum(d != "keep" for d in plan.decisions.values())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--wrappers", nargs="+", default=["fsdp2", "fsdp2_kept", "ddp"],
                        choices=["fsdp2", "fsdp2_kept", "fsdp2_bf16", "fsdp2_int", "fsdp2_offload", "ddp"])
    parser.add_argument("--budgets", nargs="+", default=["90%", "60%", "50%"])
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{'model':<6} {'wrapper':<11} {'budget':<6} {'rank':>4} {'blocks':>6} {'predicted':>11} "
              f"{'measured per step':<36} {'worst':>7} {'(bytes)':>11}")
    for name in options.models:
        for wrapper in options.wrappers:
            mine = _rows(name, wrapper, options.budgets)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            if rank != 0:
                continue
            for index in range(len(mine)):
                for who, rows in enumerate(every):
                    row = rows[index]
                    if "refused" in row:
                        print(f"{name:<6} {wrapper:<11} {row['budget']:<6} {who:>4} refused: the smallest peak "
                              f"any plan reaches is {format_bytes(row['refused'])}")
                        continue
                    worst = max((m - row["predicted"] for m in row["measured"]), key=abs)
                    steps = " ".join(format_bytes(m) for m in row["measured"])
                    print(f"{name:<6} {wrapper:<11} {row['budget']:<6} {who:>4} {row.get('checkpointed', 0):>6} "
                          f"{format_bytes(row['predicted']):>11} {steps:<36} {worst / row['predicted']:>+7.1%} "
                          f"{worst:>+9} B", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
