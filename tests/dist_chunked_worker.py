"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): train two steps of a model whose loss is
remat.chunked_lm_loss under DDP / FSDP2.

The model's layers are checkpointed and its output layer and loss run in three chunks.  Every rank checks its
gathered gradients against single-process plain autograd (the unchunked head and loss) on the global batch;
rank 0 writes the largest differences as JSON to the path :func:`run` is given.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_worker import Block, checkpointed, fully_shard, train, unwrapped_names, write_report
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import remat

VOCAB = 40


class LM(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, chunks: int | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.chunks = chunks

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        if self.chunks is None:
            return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
        return remat.chunked_lm_loss(x, self.head.weight, labels, chunks=self.chunks, shift=False)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, 4, 12), generator=g), torch.randint(0, VOCAB, (2, 4, 12), generator=g)


def _loss(model, ids, labels):
    return model(ids, labels)


def run(report_path: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    state = LM().state_dict()
    reference = LM()
    reference.load_state_dict(state)
    expected = train(reference, 0, 1, lambda m: {n: p.grad.clone() for n, p in m.named_parameters()}, _data(), _loss)
    results = {"ddp": train(DDP(checkpointed(LM(chunks=3), state)), rank, world,
                            lambda m: {n: p.grad.clone() for n, p in unwrapped_names(m).items()}, _data(), _loss)}
    mesh = init_device_mesh("cpu", (world,))
    model = checkpointed(LM(chunks=3), state)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    results["fsdp2"] = train(model, rank, world, lambda m: {n: p.grad.full_tensor().clone()
                                                             for n, p in unwrapped_names(m).items()}, _data(), _loss)
    write_report(report_path, rank, expected, results)
