"""Per-rank predicted vs measured peaks of plans made on every rank of a distributed job.

Run by hand under torchrun (CPU, gloo):

    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/ranks.py
    ... benchmarks/ranks.py --models gpt2 --wrappers fsdp2 ddp --budgets 90% 70% 50%

For each model (remat's GPT; a 4-layer Hugging Face Llama of hidden size 64; a 4-layer Hugging Face GPT-2 of hidden
size 64, in training mode: its output layer tied to the token embedding, dropout 0.1, Conv1D projections) and each
wrapper (FSDP2 per block then the root, resharded after forward or kept gathered; DDP; on request FSDP2 with
bfloat16 parameters, with CPU offload (``pin_memory=False``), or with blocks resharded to half the world after
forward: on 2 ranks 1, which FSDP2 reads as False), every rank profiles the wrapped model once (``remat.profile``,
on every rank: rank 0's profile on all), plans at each budget, applies the plan to a fresh wrapped model and trains
3 SGD steps, each measured with ``remat.measure_step`` (MemTracker: the model and the optimizer tracked). Rank 0
prints one row per model, wrapper, budget and rank: the plan's predicted peak (whole step) and each step's measured
peak, the largest difference (relative, and in bytes), and whether every step's loss and gradients (this rank's
shards) equal those of the same wrapped model without a plan (``bitwise``; a chunked head's within
``remat.chunked_tolerance``: ``close``), and last, any plan that differs between ranks. A budget no plan fits prints the
refusal's smallest peak, and how far from it the plan that reaches it measured. Every rank has its own batches; each
step seeds dropout alike in both runs. A step holds the model's output until backward ends, as ``remat.profile``
measures by default.
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
    return model, model.model.layers, _labelled_batches(cfg.vocab_size)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2's own traits: the output layer tied to the token embedding, dropout (0.1, the config's default) in
    # the embeddings, attention and residuals, and Conv1D projections
    cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=4, n_head=4, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    return model, model.transformer.h, _labelled_batches(cfg.vocab_size)


def _labelled_batches(vocab_size: int) -> list:
    """This rank's batches for a Hugging Face causal LM (2 x 64 token ids, the loss from ``labels``)."""
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    ids = [torch.randint(0, vocab_size, (2, 64), generator=generator) for _ in range(STEPS)]
    return [((), {"input_ids": batch, "labels": batch}, None) for batch in ids]


MODELS = {"gpt": _gpt, "llama": _llama, "gpt2": _gpt2}


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


def _measured(model, batches) -> dict:
    """Each step's peak, loss and this rank's gradients (local shards under FSDP2)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks, losses, grads = [], [], []
    for step, (args, kwargs, loss_fn) in enumerate(batches):
        torch.manual_seed(step)  # dropout draws alike in every run

        def run(args=args, kwargs=kwargs, loss_fn=loss_fn):
            opt.zero_grad(set_to_none=True)
            output, loss = _loss(model, args, kwargs, loss_fn)
            loss.backward()
            del output
            losses.append(loss.detach())
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
        # copied after the measured step: copies made inside it would count a second set of gradients at its end
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
    return {"peaks": peaks, "losses": losses, "grads": grads}


def _agreement(plain: dict, planned: dict, chunked: bool) -> str:
    """``bitwise`` where every step's loss and gradient equals the unplanned run's; a chunked head's within
    ``remat.chunked_tolerance`` of the largest magnitude (``close``); ``DIFFERS`` otherwise."""
    pairs = list(zip(plain["losses"], planned["losses"])) + [
        (a, b) for want, have in zip(plain["grads"], planned["grads"]) for a, b in zip(want, have)]
    if all(torch.equal(a, b) for a, b in pairs):
        return "bitwise"
    tolerance = remat.chunked_tolerance(torch.float32)
    close = all((a - b).abs().max() <= tolerance * max(a.abs().max(), 1e-30) for a, b in pairs)
    return "close" if chunked and close else "DIFFERS"


def _rows(name: str, wrapper: str, budgets: list[str]) -> list[dict]:
    build = MODELS[name]
    model, batches = _wrapped(build, wrapper)
    args, kwargs, loss_fn = batches[0]
    prof = remat.profile(model, *args, loss_fn=loss_fn, **kwargs)
    fresh, batches = _wrapped(build, wrapper)  # the profiled model's RNG draws and caches stay out of the baseline
    plain = _measured(fresh, batches)
    rows = [{"budget": "none", "predicted": prof.peak_bytes, "measured": plain["peaks"], "grads": "-"}]
    lowest: dict[int, int] = {}
    for budget in budgets:
        try:
            plan = prof.plan(budget)
        except remat.InfeasibleBudget as refused:
            if refused.smallest not in lowest:  # the plan that reaches the smallest peak, measured: is it so?
                fresh, batches = _wrapped(build, wrapper)
                lowest[refused.smallest] = max(_measured(prof.plan(refused.smallest).apply(fresh), batches)["peaks"])
            rows.append({"budget": budget, "refused": refused.smallest, "lowest": lowest[refused.smallest],
                         "parts": refused.parts})
            continue
        fresh, batches = _wrapped(build, wrapper)
        planned = _measured(plan.apply(fresh), batches)
        rows.append({"budget": budget, "predicted": plan.predicted_peak, "measured": planned["peaks"],
                     "checkpointed": sum(d != "keep" for d in plan.decisions.values()),
                     "plan": (plan.decisions, plan.head_chunks),
                     "grads": _agreement(plain, planned, plan.head_chunks > 0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--wrappers", nargs="+", default=["fsdp2", "fsdp2_kept", "ddp"],
                        choices=["fsdp2", "fsdp2_kept", "fsdp2_bf16", "fsdp2_int", "fsdp2_offload", "ddp"])
    parser.add_argument("--budgets", nargs="+", default=["90%", "70%", "50%", "40%", "30%"])
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{'model':<6} {'wrapper':<11} {'budget':<6} {'rank':>4} {'blocks':>6} {'predicted':>11} "
              f"{'measured per step':<36} {'worst':>7} {'(bytes)':>11} grads")
    differing: list[tuple[str, str, str]] = []
    for name in options.models:
        for wrapper in options.wrappers:
            mine = _rows(name, wrapper, options.budgets)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            if rank != 0:
                continue
            differing += [(name, wrapper, row["budget"]) for row, *others in zip(*every)
                          if any(other.get("plan") != row.get("plan") for other in others)]
            for index in range(len(mine)):
                for who, rows in enumerate(every):
                    row = rows[index]
                    if "refused" in row:
                        print(f"{name:<6} {wrapper:<11} {row['budget']:<6} {who:>4} refused: the smallest peak "
                              f"any plan reaches is {format_bytes(row['refused'])} ({row['refused']:,} B; that "
                              f"plan measured {row['lowest'] - row['refused']:+,} B at its worst step): "
                              + ", ".join(f"{format_bytes(n)} {part}" for part, n in
                                          sorted(row["parts"].items(), key=lambda item: -item[1])))
                        continue
                    worst = max((m - row["predicted"] for m in row["measured"]), key=abs)
                    steps = " ".join(format_bytes(m) for m in row["measured"])
                    print(f"{name:<6} {wrapper:<11} {row['budget']:<6} {who:>4} {row.get('checkpointed', 0):>6} "
                          f"{format_bytes(row['predicted']):>11} {steps:<36} {worst / row['predicted']:>+7.1%} "
                          f"{worst:>+9} B {row['grads']}", flush=True)
    if rank == 0:
        print(f"plans that differ between ranks: {differing or 'none'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
