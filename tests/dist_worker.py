"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): train two steps of a checkpointed model
under DDP / FSDP2.

Every rank checks its gathered gradients against single-process plain autograd on the global batch and
rank 0 writes a JSON report to the path :func:`run` is given.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import remat

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 1, generator=g)  # 2 steps x global batch 8


def _mse(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _reference(state):
    model = Net()
    model.load_state_dict(state)
    return train(model, 0, 1, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()}, _data(), _mse)


def train(model, rank, world, gather, batches, loss):
    """SGD over ``batches`` (inputs, targets: steps x global batch), this rank's slice of each;
    ``gather(model)`` after each backward (the gradients, whole), ``loss(model, x, y)`` the step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = batches
    per_rank = xs.shape[1] // world
    grads = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        loss(model, x[local], y[local]).backward()
        grads.append(gather(model))
        opt.step()
    return grads


def unwrapped_names(model):
    """Parameters by the names of the plain model: DDP's ``module.`` and checkpoint wrappers' levels left out."""
    names = {}
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")  # DDP's own level
        names[name.replace("_checkpoint_wrapped_module.", "")] = param
    return names


def checkpointed(model, state):
    """``model`` with weights ``state`` and its blocks checkpointed."""
    model.load_state_dict(state)
    remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def run(report_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    state = Net().state_dict()
    expected = _reference(state)
    results = {}

    def ddp_gather(model):
        return {n: p.grad.clone() for n, p in unwrapped_names(model).items()}

    for label, kwargs in (("ddp", {}), ("ddp_static_graph", {"static_graph": True}),
                          ("ddp_find_unused", {"find_unused_parameters": True})):
        model = DDP(checkpointed(Net(), state), **kwargs)  # checkpoint first, then wrap with DDP
        results[label] = train(model, rank, world, ddp_gather, _data(), _mse)

    def fsdp_gather(model):
        return {n: p.grad.full_tensor().clone() for n, p in unwrapped_names(model).items()}

    # On the CPU by name: FSDP2's default mesh takes the accelerator where there is one (rank 1 of one GPU fails).
    mesh = init_device_mesh("cpu", (world,))
    model = checkpointed(Net(), state)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # checkpoint wrapper first, then shard each block, then the root
    fully_shard(model, mesh=mesh)
    results["fsdp2"] = train(model, rank, world, fsdp_gather, _data(), _mse)

    write_report(report_path, rank, expected, results)


def write_report(report_path: str, rank: int, expected: list[dict], results: dict[str, list[dict]]) -> None:
    """Rank 0 writes, per run, the largest difference from ``expected`` over its steps."""
    report = {}
    for label, steps in results.items():
        worst = 0.0
        for want, got in zip(expected, steps):
            assert set(want) == set(got), (label, sorted(set(want) ^ set(got)))
            worst = max(worst, max((want[n] - got[n]).abs().max().item() for n in want))
        report[label] = worst
    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(report, f)
