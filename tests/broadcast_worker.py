"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): every rank makes its own plan, then takes
rank 0's with remat.broadcast_plan.

Rank 0 writes what each rank ended with (gathered) to the JSON path :func:`run` is given.
"""

import json

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.planning.solve.broadcast import broadcast_plan


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)))


def _own_plan(rank):
    """A plan that differs from rank to rank, as plans timed on different ranks can."""
    model = _model()
    prof = remat.profile(model, torch.randn(4, 8), loss_fn=lambda out: out.sum(), modules=["0", "1", "2"],
                         repeats=1)
    plan = prof.plan(1.0)
    plan.decisions = {"0": ("checkpoint", "keep")[rank], "1": ("keep", "save_matmuls")[rank], "2": "selective"}
    plan.policies = {"2": {"mode": "selective",
                           "ops": [{"op": "aten.addmm.default", "call": 0, "bytes": 128,
                                    "decision": ("keep", "recompute")[rank]}]}}
    return plan


def run(report_path):
    rank = dist.get_rank()
    plan = broadcast_plan(_own_plan(0) if rank == 0 else None)  # only rank 0 plans
    again = broadcast_plan(_own_plan(rank))  # every rank plans, and takes rank 0's
    model = plan.apply(_model())
    wrapped = [name for name, m in model.named_children() if isinstance(m, remat.ActivationWrapper)]
    mine = {"decisions": plan.decisions, "policies": plan.policies, "again": again.decisions, "wrapped": wrapped}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
