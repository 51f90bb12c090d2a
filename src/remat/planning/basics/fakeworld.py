"""A fake world: one process plans for a job of N ranks.

FSDP2 shards a model for a process group; torch's ``fake`` process group (no communication: its collectives
return at once and leave their outputs as they are) lets one process shard a model built on the meta device as
rank 0 of N ranks would.  :func:`remat.profile` with ``device="meta"`` then measures that rank's step without
allocating: its parameter and gradient shards, the units FSDP2 gathers (the one running and the one it
prefetches) and keeps gathered, its reduce-scatter outputs, activations.

* :func:`fake_world`: a fake process group of ``world_size`` ranks, this process rank 0, for the body;
* :func:`meta_sharded`: an FSDP2 model whose parameters are on the meta device made to run there for the body
  (FSDP2 refuses meta parameters at its first forward, and places its gathers on the mesh's device);
* :func:`fake_ranks`: how many ranks a fake world has (0 without one), for the profile's notes.

Example:
    >>> with remat.fake_world(8), torch.device("meta"):
    ...     model = GPT(GPTConfig())
    ...     for block in model.blocks:
    ...         fully_shard(block)
    ...     fully_shard(model)
    ...     prof = remat.profile(model, tokens, loss_fn=loss_fn, device="meta")   # rank 0 of 8
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .ranks import sharded_units

__all__ = ["fake_ranks", "fake_world", "meta_sharded"]

_FAKE = "fake"


def fake_ranks() -> int:
    """The world size of this process's fake process group (:func:`fake_world`); 0 where there is none.

    Example:
        >>> with fake_world(8):
        ...     fake_ranks()
        8
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != _FAKE:
        return 0
    return dist.get_world_size()


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """Run the body in a fake process group of ``world_size`` ranks, this process rank 0 (torch's ``fake``
    backend: collectives communicate nothing), then destroy it.

    Shard a model built on the meta device in the body (``fully_shard`` per block, then the root, as the job
    does) and profile it with ``device="meta"``: the profile is one rank's step in a job of ``world_size``
    ranks, and a size budget (``"70GiB"``) is one device's.  Nothing is allocated, so the model may be far larger
    than this machine.  Refused in one line where a process group already exists (under ``torchrun``: there,
    profile the model as it is trained, on every rank).

    Example:
        >>> with remat.fake_world(64), torch.device("meta"):
        ...     model = build_and_shard()
        ...     plan = remat.plan(model, ids, labels=ids, budget="60GiB")   # with device="meta" via profile
    """
    import torch.distributed as dist

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"remat.fake_world: world_size must be a whole number of ranks, 1 or more, got "
                         f"{world_size!r}; e.g. remat.fake_world(8).")
    if not dist.is_available():
        raise RuntimeError("remat.fake_world: this torch was built without torch.distributed; install a build with "
                           "it (the default wheels have it).")
    if dist.is_initialized():
        raise ValueError(f"remat.fake_world: a process group already exists ({dist.get_backend()}, "
                         f"{dist.get_world_size()} ranks); plan for N ranks in a process without one, or under "
                         "torchrun profile the model as it is trained, on every rank.")
    # registers the fake backend with torch.distributed (torch's own FSDP2 memory estimates run on it)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(_FAKE, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def meta_sharded(model: nn.Module) -> Iterator[None]:
    """Run the body with ``model``'s FSDP2 units, whose parameters are on the meta device, gathering and
    reducing on the meta device; a model with no FSDP2 unit on meta: the body as it is.

    FSDP2 initializes a model at its first forward, refusing parameters left on meta (a job materializes them
    first), and allocates its gathered parameters and reduce-scatter outputs on the mesh's device.  Here it is
    initialized with that refusal set aside, its units then allocate on meta (the sizes FSDP2 computes are
    unchanged), and its streams and events on the meta device are the CPU's, which wait for nothing.  Every unit
    gathers and frees its parameters once first, as in a job's first step: from then on FSDP2 refills the same
    storages, as in every later step (the step a profile measures).  The model stays so afterwards: a model on
    meta has no values to train with.

    Example:
        >>> with meta_sharded(model):
        ...     model(tokens).sum().backward()      # FSDP2's gathers and reduce-scatters, on meta
    """
    units = sharded_units(model)
    if not units or not any(param.device.type == "meta" for param in model.parameters()):
        yield
        return
    before = getattr(torch, "meta", None)
    torch.meta = torch.cpu  # FSDP2 looks up a device's streams and events as torch.<device type>
    try:
        _initialized_on_meta(units)
        yield
    finally:
        if before is None:
            del torch.meta
        else:
            torch.meta = before


def _initialized_on_meta(units: list[nn.Module]) -> None:
    """``units``' allocations moved to the meta device, FSDP2's lazy initialization of them (outermost first) with
    meta parameters let through, and one gather and free of each."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    meta = torch.device("meta")
    refusal = FSDPParamGroup._validate_no_meta_params
    FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        for unit in units:  # before initializing: its streams are the meta device's (the CPU's), not a GPU's
            state = unit._get_fsdp_state()
            state._device = meta
            group = state._fsdp_param_group
            if group is not None:
                group.device = meta
                group._all_gather_output = torch.empty(0, device=meta)
                for param in group.fsdp_params:
                    param.device = meta
        for unit in units:  # the root's initializes those below it
            unit._get_fsdp_state()._lazy_init()
        for unit in units:  # as in a job's first step: later gathers refill the storages this one makes
            unit.unshard()
            unit.reshard()
    finally:
        FSDPParamGroup._validate_no_meta_params = refusal
