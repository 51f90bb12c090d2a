"""One plan for every rank: under ``torchrun`` each process would profile and plan for itself, and timing
noise can make the plans differ; :func:`broadcast_plan` hands every rank the plan of one.
"""

from __future__ import annotations

from dataclasses import fields

from .plan import Plan

__all__ = ["broadcast_plan"]


def broadcast_plan(plan: Plan | None, src: int = 0, group: object = None) -> Plan:
    """Every rank's copy of rank ``src``'s plan (collective: call it on every rank of ``group``).

    Without an initialized ``torch.distributed`` process group the plan is returned as it is.  Ranks other
    than ``src`` may pass None; they receive the plan as plain data, as :meth:`Plan.load` reads it (the
    built-in options and op-level policies; options with custom installers exist only on ``src``).

    Example:
        >>> plan = remat.plan(model, input_ids=ids, labels=ids, budget="50%") if rank == 0 else None
        >>> remat.broadcast_plan(plan).apply(model)       # the same plan on every rank
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if plan is None:
            raise ValueError("remat.broadcast_plan: no plan to broadcast: torch.distributed is not initialized, "
                             "so pass the plan this process made.")
        return plan
    mine = dist.get_rank(group) == src if group is not None else dist.get_rank() == src
    if mine and plan is None:
        raise ValueError(f"remat.broadcast_plan: rank {src} is the source but passed no plan; make the plan "
                         "there (remat.plan or profile.plan) and pass it.")
    payload = [{f.name: getattr(plan, f.name) for f in fields(plan)} if mine else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    return plan if mine else Plan(**payload[0])
