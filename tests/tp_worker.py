"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): tensor parallel blocks, checkpointed.

The built-in GPT with each block's MLP split over the ranks (``ColwiseParallel`` up projection,
``RowwiseParallel`` down projection: the down projection's output is all-reduced, and dropout after it makes
backward need that output). Each mode trains two SGD steps from the same weights and seeds; every rank
counts the collectives its backward runs (a dispatch mode outside the checkpoint's own sees only the ops
that really run) and compares its loss and local gradient shards with the uncheckpointed TP model's,
bitwise; the forward's peak (MemTracker, the loss held) is measured per step. Rank 0 writes
``{mode: {"all_reduce": [per step], "bitwise": bool, "forward_peaks": [per step]}}``, and for the
partitioned inputs the bytes one rank kept of them, their whole size and the all-gathers backward ran.
"""

import copy
import json

import torch
import torch.distributed as dist
from helpers import CountOps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.memory import measure_step
from remat.policies.partition import PartitionInputs

CFG = GPTConfig(n_layers=3, d_model=32, seq_len=64, vocab_size=16)
MODES = {
    "plain": None,
    "checkpoint": "all",
    "save_matmuls": remat.policies.save_matmuls,
    "save_collectives": remat.policies.save_collectives,
    "save_collectives_and_names": remat.policies.save_collectives | remat.policies.save_names("unused"),
    "partitioned": "partitioned",  # save_collectives, each block's input kept as a half per rank
}


def _parallel(model, mesh, policy):
    for i, block in enumerate(model.blocks):
        parallelize_module(block.mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if policy == "all":
            model.blocks[i] = remat.checkpoint_wrapper(block)
        elif policy == "partitioned":
            hooks = PartitionInputs(mesh, min_bytes=0)
            model.blocks[i] = remat.checkpoint_wrapper(block, policy=remat.policies.save_collectives,
                                                       partition_inputs=hooks)
            model.blocks[i].partition = hooks
        elif policy is not None:
            model.blocks[i] = remat.checkpoint_wrapper(block, policy=policy)
    return model


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _train(model):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts, steps, peaks = [], [], []
    for step in range(2):
        tokens, targets = synthetic_batch(CFG, 2, generator=torch.Generator().manual_seed(step))
        losses = []  # the forward's bytes at its end are what checkpointing frees: measured with the loss held
        peaks.append(measure_step(lambda: losses.append(model.loss(tokens, targets)), model).peak_above_params)  # noqa: B023
        loss = losses[0]
        with CountOps({torch.ops._c10d_functional.all_reduce.default}) as counter:
            loss.backward()
        counts.append(counter.count)
        steps.append([loss.detach().clone()] + [_local(p.grad).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return counts, steps, peaks


def _inplace_refused(mesh) -> bool:
    """An input changed in place after the region saved it as a shard: backward must refuse it, as autograd does
    without hooks (the unpack raises before its all-gather, on every rank alike)."""
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True) * 2
    y = remat.checkpoint(lambda t: (t @ weight).sin(), x, partition_inputs=PartitionInputs(mesh, min_bytes=0))
    x.add_(1)
    try:
        y.sum().backward()
    except RuntimeError as error:
        return "modified in place" in str(error)
    return False


def run(report: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = GPT(CFG)
    results, reference = {}, None
    for mode, policy in MODES.items():
        model = _parallel(copy.deepcopy(base), mesh, policy)
        counts, steps, peaks = _train(model)
        reference = reference or steps
        bitwise = all(torch.equal(a, b) for ref, got in zip(reference, steps) for a, b in zip(ref, got))
        results[mode] = {"all_reduce": counts, "bitwise": bitwise, "forward_peaks": peaks}
        if policy == "partitioned":
            stats = [block.partition.stats for block in model.blocks]
            results[mode].update(kept=sum(s.kept_bytes for s in stats), whole=sum(s.whole_bytes for s in stats),
                                 gathers=sum(s.gathers for s in stats))
    results["partitioned"]["inplace_refused"] = _inplace_refused(mesh)
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(results, f)
