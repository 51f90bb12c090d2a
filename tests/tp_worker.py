"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): tensor parallel blocks, checkpointed.

The built-in GPT with each block's MLP split over the ranks (``ColwiseParallel`` up projection,
``RowwiseParallel`` down projection: the down projection's output is all-reduced, and dropout after it makes
backward need that output). Each mode trains two SGD steps from the same weights and seeds; every rank
counts the collectives its backward runs (a dispatch mode outside the checkpoint's own sees only the ops
that really run) and compares its loss and local gradient shards with the uncheckpointed TP model's,
bitwise. Rank 0 writes ``{mode: {"all_reduce": [per step], "bitwise": bool}}``.
"""

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(n_layers=2, d_model=32, seq_len=16, vocab_size=64)
MODES = {
    "plain": None,
    "checkpoint": "all",
    "save_matmuls": remat.policies.save_matmuls,
    "save_collectives": remat.policies.save_collectives,
    "save_collectives_and_names": remat.policies.save_collectives | remat.policies.save_names("unused"),
}


class _CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.all_reduce = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.all_reduce += 1
        return func(*args, **(kwargs or {}))


def _parallel(model, mesh, policy):
    for i, block in enumerate(model.blocks):
        parallelize_module(block.mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if policy == "all":
            model.blocks[i] = remat.checkpoint_wrapper(block)
        elif policy is not None:
            model.blocks[i] = remat.checkpoint_wrapper(block, policy=policy)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _train(model):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts, steps = [], []
    for step in range(2):
        tokens, targets = synthetic_batch(CFG, 2, generator=torch.Generator().manual_seed(step))
        loss = model.loss(tokens, targets)
        with _CountCollectives() as counter:
            loss.backward()
        counts.append(counter.all_reduce)
        steps.append([loss.detach().clone()] + [_local(p.grad).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return counts, steps


def run(report: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = GPT(CFG)
    results, reference = {}, None
    for mode, policy in MODES.items():
        counts, steps = _train(_parallel(copy.deepcopy(base), mesh, policy))
        reference = reference or steps
        bitwise = all(torch.equal(a, b) for ref, got in zip(reference, steps) for a, b in zip(ref, got))
        results[mode] = {"all_reduce": counts, "bitwise": bitwise}
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(results, f)
