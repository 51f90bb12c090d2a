"""Ranks and wrappers: everything the planner asks about a model trained by several processes.

Under ``torchrun`` every rank calls :func:`remat.profile` / :func:`remat.plan` on its own copy of the model,
wrapped in DDP or sharded by FSDP2 (``fully_shard`` per block, then the root).  The stages of the planner
never test for ranks or wrappers themselves; they ask this module:

* :func:`unwrapped` / :func:`original_class`: the model as it was written (DDP's ``.module``; FSDP2's
  ``FSDP<Name>`` classes, made when a module is sharded, read as ``<Name>``), so a plan made before wrapping
  applies after it and the other way round;
* :class:`Ranks`: who profiles a model: every rank together where it is trained by several (DDP, FSDP2), this
  process alone otherwise; together, every rank describes what it profiles (model, inputs, budget) and each
  one raises the same one-line error naming the first rank that differs from rank 0 and how, instead of
  waiting forever in a collective the other ranks never reach, and rank 0's profile is handed to every rank,
  so all ranks plan alike;
* :func:`gathered`: a block's FSDP2 parameters all-gathered once, by every rank together, for the block's timed
  runs, which then run as a recomputation does under FSDP2 (its hooks see a backward in progress and gather
  nothing), so no collective runs while a rank holds the timings file's lock;
* :func:`gradient_buckets` / :meth:`Ranks.per_rank`: what DDP holds through every step (its gradient buckets),
  added to the profile of the module it wraps;
* :func:`mesh_of`: the device mesh a tensor-parallel model's parameters are spread over (DTensor parameters
  that ``parallelize_module`` made), recorded by a plan, which refuses a model on another mesh;
  :func:`tensor_parallel_group`: its process group, over which a plan shards a block's inputs;
* :func:`local`: the bytes a rank holds of a sharded tensor (its shard); :func:`storage_resizes`: FSDP2 frees
  and refills its gathered parameters by resizing their storages, which a count of live bytes must follow;
  :func:`gathers_parameters`: the op that makes FSDP2's all-gather buffer, counted as gathered parameters too;
* :func:`settle_collective`: a pause after each collective's wait, so gloo's thread lets go of its buffers
  before a count of live bytes goes on (their deaths would otherwise come at moments that vary);
* :func:`unverified_settings`: the FSDP2 settings no measured run has held a plan's per-rank peak to
  (``CPUOffloadPolicy`` off the CPU), one line each, for the profile to warn about;
* :func:`reshard`: a model left sharded after a profile's forwards without backward; :func:`copy_of`: a copy of
  a model with its weights, FSDP2's by its factory and state dict (a plan's check trains two).

A tensor-parallel model's blocks run collectives in their forward (a row-wise layer's all-reduce), so every timed
run of a block must run on every rank in the same order: its ranks profile together, and the timings file is
read by rank 0 alone and its entries handed to every rank (:func:`~remat.planning.measure.timecache.timings_cache`),
so that every rank decides alike what to time, with no lock held across a collective.

On a model with neither DDP, FSDP2 nor DTensor parameters every answer is the plain one: the model itself, its own
class, this process alone, nothing gathered or added.

Example:
    >>> Ranks.of(model).agree("remat.profile", {"inputs": {"arg 0": "8x128"}})  # a collective for a DDP model
    >>> with gathered([model.blocks[0]]):
    ...     model.blocks[0](x)                                                    # no all-gather
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["Ranks", "copy_of", "distributed", "gathered", "gathers_parameters", "gradient_buckets", "local", "mesh_of",
           "on_mesh", "original_class", "reshard", "settle_collective", "sharded_units", "storage_resizes",
           "tensor_parallel_group", "unverified_settings", "unwrapped"]

T = TypeVar("T")
P = TypeVar("P")
_WAIT = torch.ops._c10d_functional.wait_tensor.default if hasattr(torch.ops, "_c10d_functional") else None
_SETTLE_SECONDS = 0.001


def distributed() -> bool:
    """Whether this process is one of several ranks of an initialized ``torch.distributed`` group (a fake
    group, :func:`remat.fake_world`, is this process alone).

    Example:
        >>> distributed()
        False
    """
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and dist.get_backend() != "fake")


def unwrapped(model: nn.Module) -> nn.Module:
    """The module DDP wraps (``DistributedDataParallel.module``); any other model as it is (FSDP2 shards a
    model in place: it is its own unwrapped model).

    Example:
        >>> unwrapped(DistributedDataParallel(model)) is model
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _fsdp_module() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed, or before FSDP2's public name
        return None
    return FSDPModule


def original_class(module: nn.Module) -> type:
    """The class ``module`` was written as: FSDP2 makes ``FSDP<Name>`` (a subclass of ``FSDPModule`` and of
    ``<Name>``) when it shards a module; that is read as ``<Name>``.

    Example:
        >>> original_class(fully_shard(Block())) is Block
        True
    """
    cls, fsdp = type(module), _fsdp_module()
    if fsdp is None or not issubclass(cls, fsdp):
        return cls
    return next(base for base in cls.__mro__[1:] if not issubclass(base, fsdp))


def settle_collective(op: object, out: T) -> T:
    """``out``, what ``op`` returned; after a collective's wait, first a moment for the process group's threads to
    let go of its buffers.

    Gloo's worker thread marks a collective done before it drops its references to the buffers; when it drops
    them after this process's own, they die later (their deaths wait for the interpreter's lock), at a moment
    that varies from run to run.  A profile counts the bytes alive at each op: without this pause a buffer
    the program lets go of at once is sometimes counted alive for several more ops.

    Example:
        >>> out = settle_collective(func, func(*args, **kwargs))    # in a dispatch mode's __torch_dispatch__
    """
    if op is _WAIT:
        time.sleep(_SETTLE_SECONDS)
    return out


def gathers_parameters(op: object) -> bool:
    """Whether ``op`` makes FSDP2's all-gather buffer (a unit's parameters, gathered into it before they are
    copied out to the parameters' own storages): bytes a count of what a rank holds names gathered parameters.

    Example:
        >>> gathers_parameters(torch.ops.aten.mm.default)
        False
    """
    return str(op) == "fsdp.all_gather_copy_in.default"


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (FSDP2's sharded parameters and
    gradients), a collective's result wrapped for autograd (``AsyncCollectiveTensor``, tensor parallel's row-wise
    layers) the result itself, any other tensor itself.  A wrapper's own storage holds no bytes (a DTensor's reads as
    the whole tensor's), and a view of the wrapper makes another such storage: counted, they would be bytes
    that ``measure_step`` never sees.

    Example:
        >>> local(model.blocks[0].attn.qkv.weight).shape     # FSDP2 on 2 ranks: half the rows
        torch.Size([96, 32])
    """
    tensor = getattr(tensor, "_local_tensor", tensor)
    return tensor.elem if type(tensor).__name__ == "AsyncCollectiveTensor" else tensor  # no torch.distributed import


def mesh_of(model: nn.Module) -> dict[str, Any] | None:
    """The device mesh ``model``'s tensor-parallel parameters are spread over, as plain data (its shape, its
    dimensions' names and the world size), or None where it has none.

    Tensor parallel's parameters are DTensors that ``parallelize_module`` made (FSDP2's sharded parameters are
    DTensors too, but a plan made before ``fully_shard`` applies after it and the other way round: they are left
    out, and of a 2-D model's parameters only the mesh tensor parallel spread them over is read).

    Example:
        >>> mesh_of(model)                 # ColwiseParallel / RowwiseParallel on 2 ranks
        {'shape': [2], 'dims': ['tp'], 'world size': 2}
    """
    mesh = _mesh(model)
    if mesh is None:
        return None
    import torch.distributed as dist

    names = getattr(mesh, "mesh_dim_names", None)
    return {"shape": list(mesh.shape), "dims": list(names) if names else None,
            "world size": dist.get_world_size() if dist.is_initialized() else 1}


def tensor_parallel_group(model: nn.Module) -> Any:
    """The process group of the ranks tensor parallel spreads ``model``'s parameters over (the ranks that all hold
    a block's replicated activations in full), or None where it has no mesh.

    A 1-D mesh is that group; under FSDP2 on a 2-D (dp, tp) mesh, tensor parallel's parameters were spread over the
    mesh's ``tp`` dimension (``parallelize_module`` takes a 1-D mesh), which is the one read.  Parameters
    distributed over a whole N-D mesh that FSDP2 shards over some of its dimensions (``fully_shard(...,
    dp_mesh_dims=...)``, which names the data-parallel ones, whose ranks take different data): the one dimension
    left on which some parameter is sharded.  Any other N-D mesh is refused in one line: which of its dimensions
    hold equal activations is not decidable from the parameters.

    Example:
        >>> tensor_parallel_group(model)           # ColwiseParallel / RowwiseParallel on 2 ranks
        <torch.distributed.distributed_c10d.ProcessGroup object at ...>
    """
    mesh = _mesh(model)
    if mesh is None:
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    dims = _tensor_parallel_dims(model, mesh)
    if len(dims) != 1:
        raise ValueError(f"remat: {original_class(model).__name__}'s tensor-parallel parameters are spread over a "
                         f"{mesh.ndim}-D mesh {tuple(mesh.shape)}; partitioned inputs need tensor parallel on a 1-D "
                         "mesh (parallelize_module(..., mesh['tp'], ...)) or one whose data-parallel dimensions "
                         "fully_shard names (dp_mesh_dims=...), leaving one that shards parameters: plan without "
                         "checkpoint_partitioned.")
    return mesh.get_group(dims[0])


def _tensor_parallel_dims(model: nn.Module, mesh: Any) -> list[int]:
    """The dimensions of the N-D ``mesh`` that FSDP2 was not given as data parallel and some parameter is sharded
    over (by its placements before FSDP2 sharded it); none where no FSDP2 unit names its data-parallel dimensions."""
    data_parallel: set[str] = set()
    fsdp_managed = {id(p) for unit in sharded_units(model) for p in unit.parameters()}
    placements = [p.placements for p in model.parameters()
                  if getattr(p, "device_mesh", None) is mesh and id(p) not in fsdp_managed]
    for unit in sharded_units(model):
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            named = getattr(fsdp_param.mesh_info, "dp_mesh_dims", None)
            spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None) if fsdp_param.is_dtensor else None
            if named is None or spec is None or spec.mesh is not mesh:
                continue
            data_parallel.update((*named.shard_names, *named.replicate_names))
            placements.append(spec.placements)
    if not data_parallel:
        return []
    names = mesh.mesh_dim_names or ()
    return [dim for dim in range(mesh.ndim) if names[dim] not in data_parallel
            and any(not placed[dim].is_replicate() for placed in placements)]


def _mesh(model: nn.Module) -> Any:
    """The device mesh of ``model``'s first tensor-parallel parameter (FSDP2's own shards left out), or None."""
    fsdp_managed = {id(p) for unit in sharded_units(model) for p in unit.parameters()}
    for parameter in model.parameters():
        mesh = getattr(parameter, "device_mesh", None)
        if mesh is not None and id(parameter) in fsdp_managed:  # FSDP2 keeps the tensor-parallel spec it found
            mesh = _tensor_parallel_mesh(parameter, model)
        if mesh is not None:
            return mesh
    return None


def _tensor_parallel_mesh(parameter: nn.Parameter, model: nn.Module) -> Any:
    """The tensor-parallel mesh of a parameter FSDP2 shards (None where it was not a DTensor before)."""
    for unit in sharded_units(model):
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            if fsdp_param.sharded_param is parameter:
                spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None) if fsdp_param.is_dtensor else None
                return None if spec is None else spec.mesh
    return None


def on_mesh(model: nn.Module) -> bool:
    """Whether ``model`` has tensor-parallel (DTensor) parameters: its forward runs collectives.

    Example:
        >>> on_mesh(parallelize_module(model, mesh, {"mlp.up": ColwiseParallel()}))
        True
    """
    return any(hasattr(p, "device_mesh") for p in model.parameters())


@contextlib.contextmanager
def storage_resizes(resized: Callable[[torch.UntypedStorage], None]) -> Iterator[None]:
    """Call ``resized(storage)`` after every ``UntypedStorage.resize_`` in the body.

    FSDP2 gathers a unit's parameters into storages it keeps and frees them by resizing them to nothing
    (and back): storages that never die, so a count of live bytes that waits for a storage to die sees every
    unit's gathered parameters alive at once.  A resize is not an operator a dispatch mode sees.

    Example:
        >>> with storage_resizes(lambda storage: print(storage.nbytes())):
        ...     torch.UntypedStorage(8).resize_(0)
        0
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        result = original(storage, size)
        resized(storage)
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


def copy_of(model: nn.Module, factory: Callable[[], nn.Module] | None, who: str) -> nn.Module:
    """A copy of ``model`` with its weights: a deep copy, or for an FSDP2 model (which refuses to be deep-copied)
    a new one from ``factory`` loaded with ``model``'s state dict (the same shards on every rank).  Without a
    factory an FSDP2 model is refused in one line naming ``who``.

    Example:
        >>> planned = copy_of(unplanned, build, "remat.check_plan")
    """
    import copy

    if not sharded_units(model):
        return copy.deepcopy(model)
    if factory is None:
        raise ValueError(f"{who}: {original_class(model).__name__} is sharded by FSDP2, which cannot be copied; pass "
                         "a function that builds and shards it instead of the model, e.g. "
                         f"{who}(build_model, plan, ...).")
    made = factory()
    made.load_state_dict(model.state_dict())
    return made


def gradient_buckets(model: nn.Module) -> int:
    """Bytes of the gradient buckets DDP allocates when it wraps a model (about the gradients' bytes: each
    gradient is copied into its bucket, all-reduced there and copied back); 0 for any other model.

    They exist before any step, so a measurement that counts what a step allocates does not see them until the
    step first writes to them (:func:`~remat.planning.basics.memory.measure_step` counts them from its start).

    Example:
        >>> gradient_buckets(DistributedDataParallel(model))
        882176
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(size) for size in sizes.replace(",", " ").split())


def sharded_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 units in ``module``'s subtree, itself included, outermost first.

    Example:
        >>> [type(u).__name__ for u in sharded_units(model.blocks[0])]
        ['FSDPBlock']
    """
    fsdp = _fsdp_module()
    return [] if fsdp is None else [m for m in module.modules() if isinstance(m, fsdp)]


@contextlib.contextmanager
def gathered(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Run the body with the FSDP2 parameters of ``modules`` all-gathered and FSDP2's forward hooks inert.

    The all-gather is a collective: every rank enters with the same modules, before any lock is taken.  In the
    body a module's forward runs as FSDP2 runs a recomputation (in backward: parameters already gathered, no
    hook gathers or frees them, inputs and outputs cast by its mixed-precision policy), on this rank alone.
    Afterwards the parameters are sharded again.  Modules without FSDP2 units: the body runs as it is.

    Example:
        >>> with gathered([model.blocks[0]]):
        ...     times = time_block(model.blocks[0])
    """
    units = [unit for module in modules for unit in sharded_units(module)]
    if not units:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    states = [unit._get_fsdp_state() for unit in units]
    before = [state._training_state for state in states]
    for unit in units:
        unit.unshard()
    try:
        for state in states:  # what FSDP2 reads as "a recomputation in backward": its hooks do nothing
            state._training_state = TrainingState.PRE_BACKWARD
        yield
    finally:
        for state, training_state in zip(states, before):
            state._training_state = training_state
        for unit in units:
            unit.reshard()


def unverified_settings(model: nn.Module) -> list[str]:
    """One line for each FSDP2 setting of ``model`` under which no measured run has held a step's peak to the
    plan's: what it is and why.

    ``CPUOffloadPolicy`` on a mesh off the CPU: the shards and their gradients live on the host, which the plan
    counts as the device's memory (an upper bound).  On the CPU offloading moves nothing (the shards are on the
    host already): no line.  Mixed precision (``MixedPrecisionPolicy``) and every ``reshard_after_forward`` hold:
    no line.

    Example:
        >>> unverified_settings(model)       # blocks sharded with CPUOffloadPolicy on CUDA devices
        ['CPUOffloadPolicy (blocks.0, blocks.1, ...): the plan counts ...']
    """
    fsdp, offloaded = _fsdp_module(), []
    for name, unit in model.named_modules():
        if fsdp is None or not isinstance(unit, fsdp):
            continue
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        policy = type(getattr(group, "offload_policy", None)).__name__
        if policy == "CPUOffloadPolicy" and group.device.type != "cpu":
            offloaded.append(name or "the root")
    if not offloaded:
        return []
    return [f"CPUOffloadPolicy ({_named(offloaded)}): the plan counts the parameter and gradient shards kept on the "
            "host as device memory, an upper bound of the device's peak"]


def _named(names: Any, shown: int = 2) -> str:
    names = list(names)
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters in ``model`` (no collective; nothing without FSDP2 units).

    A profile's forwards without a backward leave a unit that keeps its parameters gathered after forward
    (``reshard_after_forward=False``, the root) holding them; the next training step would read those copies,
    not the ones its optimizer updates.

    Example:
        >>> reshard(model)
    """
    for unit in sharded_units(model):
        unit.reshard()


@dataclass(frozen=True)
class Ranks:
    """The ranks that profile and plan one model together: every rank of the process group when the model is
    trained by several (wrapped in DDP, sharded by FSDP2 or tensor parallel under an initialized group), else this
    process alone (a plain model: a job may profile it on rank 0 only and hand the plan on with
    :func:`remat.broadcast_plan`).

    ``model`` is the model to profile: DDP's ``.module``, whose step a rank runs alone, without collectives.

    Example:
        >>> together = Ranks.of(model)
        >>> together.agree("remat.profile", {"inputs": {"arg 0": "8x128"}})
        >>> prof = together.same(prof)
    """

    model: nn.Module
    together: bool
    wrapper_bytes: int = 0

    def per_rank(self, profile: P) -> P:
        """``profile`` (a profile of :attr:`model`'s step) with what the wrapper holds through every step on this
        rank added as fixed bytes beside the parameters: DDP's gradient buckets (:func:`gradient_buckets`).

        Example:
            >>> prof = Ranks.of(ddp_model).per_rank(prof)    # every peak + the buckets
        """
        if not self.wrapper_bytes:
            return profile
        for step in (profile, getattr(getattr(profile, "head", None), "profile", None)):
            if step is None:
                continue
            step.buffer_bytes += self.wrapper_bytes
            step.peak_bytes += self.wrapper_bytes
            for segment in step.segments:
                segment.peak += self.wrapper_bytes
                segment.start += self.wrapper_bytes
                for parts in (segment.parts, segment.start_parts):  # the buckets are DDP's state: held throughout
                    if parts:
                        parts["states"] += self.wrapper_bytes
            for row in step.rows:  # the live bytes a row reads its regions' transients from
                row.forward_start += self.wrapper_bytes
                row.forward_peak += self.wrapper_bytes
                row.save_peak += self.wrapper_bytes
            step.notes.append(f"DDP's gradient buckets: {self.wrapper_bytes} bytes held through every step, counted "
                              "beside the parameters")
        return profile

    @classmethod
    def of(cls, model: nn.Module) -> Ranks:
        """Who profiles ``model``: every rank where it is trained by several, else this process.

        Example:
            >>> Ranks.of(DistributedDataParallel(model)).together
            True
        """
        wrapped = unwrapped(model) is not model or bool(sharded_units(model)) or on_mesh(model)
        return cls(unwrapped(model), wrapped and distributed(), gradient_buckets(model))

    @property
    def chunked_head(self) -> bool:
        """Whether the output layer and loss may be planned in chunks: not on an FSDP2 model, whose output layer's
        weight the chunked loss would read sharded, outside the root's forward, nor where tensor parallel splits
        the output layer (a DTensor weight, which the chunked loss's plain hidden states cannot meet).

        Example:
            >>> Ranks.of(model).chunked_head
            True
        """
        output_layer = getattr(self.model, "get_output_embeddings", lambda: None)()
        return not sharded_units(self.model) and not (isinstance(output_layer, nn.Module) and on_mesh(output_layer))

    def agree(self, who: str, description: dict[str, Any]) -> None:
        """Raise ValueError on every rank if any rank's ``description`` differs from rank 0's (a collective
        when ranks work together).

        ``description`` is plain data (what the rank is about to profile: the model's class and parameter
        shapes, the inputs' shapes, the budget); the error names the first rank that differs, the first entry
        that does and both values, in one line.

        Example:
            >>> Ranks.of(model).agree("remat.profile", {"inputs": {"arg 0": "8x128"}})
        """
        if not self.together:
            return
        import torch.distributed as dist

        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, description)
        for rank, theirs in enumerate(every[1:], start=1):
            for key in {**every[0], **theirs}:
                ours, their = _first_difference(every[0].get(key), theirs.get(key))
                if ours != their:
                    raise ValueError(
                        f"{who}: rank {rank} differs from rank 0 in {key}: {_shown(their)} there, {_shown(ours)} on "
                        "rank 0; call it on every rank with the same model, inputs of the same shapes and the same "
                        "budget.")

    def same(self, value: T) -> T:
        """Rank 0's ``value`` on every rank when ranks work together (a collective; picklable data), else
        ``value``.

        Example:
            >>> prof = Ranks.of(model).same(prof)     # one profile, so one plan, on every rank
        """
        if not self.together:
            return value
        import torch.distributed as dist

        payload = [value]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]


def _first_difference(ours: Any, theirs: Any) -> tuple[Any, Any]:
    """The first entry two descriptions' dicts differ in, as one-entry dicts; other values as they are."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in {**ours, **theirs}:
            if ours.get(key) != theirs.get(key):
                return {key: ours.get(key, "absent")}, {key: theirs.get(key, "absent")}
    return ours, theirs


def _shown(value: Any, limit: int = 120) -> str:
    if isinstance(value, dict):
        text = ", ".join(f"{k} {v}" for k, v in value.items())
    else:
        text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
