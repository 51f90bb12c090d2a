"""What a block's forward does, op by op: the graph op-level checkpointing plans choose from.

:func:`profile_ops` runs one forward of a model (grad enabled, no backward) and records the first call of every
candidate block with its real inputs.  For each operator the block dispatches, an :class:`OpNode` holds:

* the op overload and its *call index* among that op's calls in the block — how a
  :class:`~remat.planning.basics.blockpolicy.BlockPolicy` names it;
* its kind: ``compute`` (a policy may keep its output), ``alias`` (views and in-place ops: they create no
  storage and rerun) or ``ignored`` (detach and metadata queries, never subject to a policy); and whether it is
  random.  A kept random op is served with its generator's state as forward left it, so the random ops rerun
  after it draw as in forward; a random in-place op writing one tensor (dropout's ``bernoulli_``) is the one
  ``alias`` a policy may keep: by value, a copy of what it wrote (see :mod:`remat.policies.selective`);
* ``out_bytes``: the bytes of the storages it creates (views share their base; a multi-output op's storages add
  up) or, for a random in-place op, of the copy keeping it holds (the tensor it writes); and the part of its
  storages autograd saves (storages that reached the pack hook);
* which earlier ops produced its tensor arguments (``needs``), whether it
  reads the block's inputs, and whose storages it writes in place (``writes``);
* whether a later in-place op writes one of its storages: then its output
  cannot be kept (the kept value would change under the policy);
* its time, medians of several runs (:func:`remat.planning.measure.timing.time_ops`): ``kernel_time`` on the device
  (events on an accelerator), ``host_time`` (the Python, autograd and dispatcher work around it) and
  ``wall_time``, what it adds to a run — the sum on the CPU, the larger on an accelerator whose host runs ahead
  (``BlockGraph.asynchronous``); on the meta device, or with ``timing="estimate"``, the larger of FLOPs /
  ``throughput`` and bytes moved / ``bandwidth``, a collective's over the ranks' interconnect
  (:mod:`~remat.planning.measure.interconnect`), all of it kernel time.

``saved_tensors`` counts what autograd saves (parameters included), and ``saved_needing_grad`` those that
require grad: a recomputation detaches each of them, one more op dispatched under a policy.  Per storage a
:class:`StorageLife` says who made it, whether autograd saves it and after how many of the block's ops it died
where autograd held nothing (as in a checkpointed forward); the front's cost model uses that for the
recomputation's peak, the planner for a recomputing forward's.  ``BlockGraph.stop`` is the number of ops a
recomputation runs: remat's early stop ends it at the block's last saved tensor, and autograd saves an op's
inputs before the op runs.

Blocks with the same class, inputs and op graph share one :class:`BlockGraph`; only one of them is timed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from ...api.modules import ActivationWrapper
from ...policies.decisions import SAC_IGNORED_OPS, _is_random_write
from ...policies.selective import create_selective_checkpoint_contexts
from ..basics.blockpolicy import BlockPolicy
from ..basics.discovery import resolve_blocks
from ..basics.ranks import Ranks, gathered, local, settle_collective, sharded_units
from ..basics.units import format_bytes
from ..basics.untouched import left_as_found
from ..basics.userline import user_stacklevel
from .estimates import estimator
from .interconnect import Interconnect
from .overheads import Overheads, cached_overheads
from .saved import Held, SavedTensorGone, Unheld
from .timecache import StepTime, TimingCache, cached_times, model_key, timings_cache, unsteady_limit
from .timing import Clock, OpTimes, device_of, pooled, time_ops

__all__ = ["BlockGraph", "OpNode", "OpProfile", "StorageLife", "UnsteadyTimings", "profile_ops"]

class UnsteadyTimings(UserWarning):
    """A block's timed forwards varied so much between rounds that its prices may move from run to run."""


@dataclass(frozen=True)
class OpNode:
    """One op call of a block's forward (see the module docstring)."""

    index: int
    op: str
    call: int
    kind: str
    random: bool
    shapes: tuple[tuple[int, ...], ...]
    out_bytes: int
    saved_bytes: int
    needs: tuple[int, ...]
    writes: tuple[int, ...]
    reads_input: bool
    mutated: bool
    kernel_time: float = 0.0
    wall_time: float = 0.0
    host_time: float = 0.0


@dataclass(frozen=True)
class StorageLife:
    """A storage a block's op created: its maker, size, whether autograd saves it, when it died.

    ``dies`` is the number of the block's ops completed when the storage was
    freed in a forward where autograd holds nothing (a checkpointed one: its
    readers and the block's code are done with it), or None if it outlived
    the block's forward (its output; autograd saves it in a plain forward
    when ``saved``).
    """

    producer: int
    nbytes: int
    saved: bool
    dies: int | None


@dataclass
class BlockGraph:
    """The op graph of one block call: nodes, storages, inputs and where a recomputation stops."""

    cls: str
    signature: str
    nodes: list[OpNode]
    storages: list[StorageLife]
    input_bytes: int
    input_saved_bytes: int
    saved_tensors: int
    saved_needing_grad: int
    stop: int
    forward_time: float
    estimated: bool
    overheads: Overheads
    asynchronous: bool = False
    # An op writes in place to one of the block's inputs: a region starting at this block would rerun from
    # the written input (the engine refuses it), so only a region that makes the input itself may hold it.
    writes_input: bool = False

    @property
    def keep_all_bytes(self) -> int:
        """What plain autograd keeps for this block: the storages it saves, inputs included."""
        return self.input_saved_bytes + sum(s.nbytes for s in self.storages if s.saved)

    @property
    def keepable(self) -> list[int]:
        """Nodes a policy can usefully keep: ops that rerun in recomputation and own (or copy) memory.

        Compute ops whose output no later op overwrites, and random in-place ops (kept by value).
        """
        return [n.index for n in self.nodes
                if (n.kind == "compute" or n.kind == "alias" and n.random) and not n.mutated
                and n.index < self.stop and n.out_bytes > 0]

    def copied_bytes(self, index: int) -> int:
        """Bytes keeping node ``index`` copies (forward, and back in recomputation): a random in-place op's value."""
        node = self.nodes[index]
        return node.out_bytes if node.kind == "alias" else 0

    def __str__(self) -> str:
        kind = "estimated" if self.estimated else "measured"
        lines = [f"{self.cls}: {len(self.nodes)} ops, recomputation runs {self.stop}; inputs "
                 f"{format_bytes(self.input_bytes)}, autograd keeps {format_bytes(self.keep_all_bytes)}; "
                 f"forward {self.forward_time * 1e3:.2f} ms ({kind})",
                 f"{'#':>4} {'op':<36} {'kind':<8} {'bytes':>10} {'saved':>10} {'kernel ms':>10}  needs"]
        for n in self.nodes:
            if n.kind == "ignored":
                continue
            tags = n.kind + ("*" if n.random else "") + ("!" if n.mutated else "")
            lines.append(f"{n.index:>4} {n.op + '#' + str(n.call):<36} {tags:<8} {format_bytes(n.out_bytes):>10} "
                         f"{format_bytes(n.saved_bytes):>10} {n.kernel_time * 1e3:>10.3f}  "
                         f"{','.join(map(str, n.needs))}{' +input' if n.reads_input else ''}")
        lines.append("(* random: served with the RNG as forward left it when kept, an in-place one as a copy of what "
                     "it wrote; ! written in place later: cannot be kept)")
        return "\n".join(lines)


@dataclass
class OpProfile:
    """Per-op graphs of a model's candidate blocks; blocks with one signature share one graph."""

    blocks: dict[str, BlockGraph]
    device: str
    notes: list[str] = field(default_factory=list)
    step_time: float | None = None  # the step time the op times go with, when given a reference_step

    @property
    def distinct(self) -> list[BlockGraph]:
        """One graph per signature, in model order."""
        seen: dict[int, BlockGraph] = {}
        for graph in self.blocks.values():
            seen.setdefault(id(graph), graph)
        return list(seen.values())


# A functional collective's result wrapped for autograd (tensor parallel's row-wise layers): it returns the tensor it
# is given (an AsyncCollectiveTensor around it; on the meta device a new empty tensor), so it holds no bytes of its
# own, though its schema says nothing of aliasing.
_WRAPS_COLLECTIVE = "_c10d_functional._wrap_tensor_autograd.default"  # registered where collectives are imported


@functools.cache
def _op_info(op: Any) -> tuple[str, bool, tuple[tuple[int, str], ...], bool]:
    """(kind, random, arguments it writes in place as (position, name), kept by value if kept)."""
    if op in SAC_IGNORED_OPS:
        return "ignored", False, (), False
    schema = op._schema
    # Same rule as the selective-checkpoint recorder: an aliasing return makes an op a view or in-place op.
    aliases = any(r.alias_info is not None for r in schema.returns) or str(op) == _WRAPS_COLLECTIVE
    kind = "alias" if aliases else "compute"
    random = torch.Tag.nondeterministic_seeded in op.tags
    written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
    return kind, random, written, _is_random_write(op)


class _Life:
    __slots__ = ("producer", "nbytes", "saved", "dies")

    def __init__(self, producer: int, nbytes: int) -> None:
        self.producer, self.nbytes, self.saved, self.dies = producer, nbytes, False, None


class _BlockRecord:
    """The growing record of one block call."""

    def __init__(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.name, self.module = name, module
        # Detached aliases of the real inputs, for the timing runs (no copy; autograd flags kept).
        self.args, self.kwargs = tree_map(_detached, (args, kwargs))
        self.owner = WeakIdKeyDictionary()  # storage -> _Life index, or -1 for an input storage
        self.lives: list[_Life] = []
        self.nodes: list[dict[str, Any]] = []
        self.work: list[tuple] = []  # per node: what its cost depends on (op, arguments' metadata and values)
        self.calls: dict[Any, int] = {}
        self.ops = 0
        self.packs = 0
        self.packs_needing_grad = 0
        self.last_pack = 0
        self.input_saved: set[int] = set()
        self.input_sizes: dict[int, int] = {}
        self.writes_input = False
        self.done = False
        for t in _tensors((args, kwargs)):
            storage = t.untyped_storage()
            if storage not in self.owner:
                self.owner[storage] = -1 - len(self.input_sizes)
                self.input_sizes[-1 - len(self.input_sizes)] = storage.nbytes()
        self.input_bytes = sum(self.input_sizes.values())


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _tensors(tree: Any) -> list[torch.Tensor]:
    # A DTensor (sequence parallel's activations) as the part this rank holds: its own storage reads as the whole's.
    return [local(t) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recorder(TorchDispatchMode):
    """Records the ops of the block being run (``current``), with packs and storage deaths."""

    def __init__(self, estimate: Callable[[Any, tuple, dict, Any], float] | None) -> None:
        super().__init__()
        self.current: _BlockRecord | None = None
        self.estimate = estimate
        self.finalizers: list[weakref.finalize] = []

    def forget(self) -> None:
        """Back to before the forward: no block current, no storage watched."""
        for finalizer in self.finalizers:
            finalizer.detach()
        self.finalizers.clear()
        self.current = None

    def pack(self, t: torch.Tensor) -> None:
        """Notes a save of the current block (what is kept of ``t`` is the hooks' holder's business)."""
        record = self.current
        if record is not None:
            record.packs += 1
            record.packs_needing_grad += t.requires_grad
            record.last_pack = record.ops
            where = record.owner.get(local(t).untyped_storage())
            if where is not None and where >= 0:
                record.lives[where].saved = True
            elif where is not None:
                record.input_saved.add(where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        record = self.current
        if record is None or func.namespace == "profiler":  # a wrapper's record_function marks (FSDP2's): no work
            return func(*args, **kwargs)
        kind, random, written, by_value = _op_info(func)
        out = settle_collective(func, func(*args, **kwargs))
        index, record.ops = record.ops, record.ops + 1
        call = record.calls.get(func, 0)
        record.calls[func] = call + 1
        needs, reads_input = set(), False
        for t in _tensors((args, kwargs)):
            where = record.owner.get(t.untyped_storage())
            if where is not None and where >= 0:
                needs.add(record.lives[where].producer)
            elif where is not None:
                reads_input = True
        writes = set()
        created = 0
        for position, name in written:
            target = args[position] if position < len(args) else kwargs.get(name)
            for t in _tensors(target):
                if by_value:
                    created += _nbytes(t)  # what a kept copy of the written value holds
                where = record.owner.get(t.untyped_storage())
                if where is not None and where >= 0:
                    writes.add(record.lives[where].producer)
                    record.nodes[record.lives[where].producer]["mutated"] = True
                elif where is not None:
                    record.writes_input = True
        outputs = _tensors(out)
        if str(func) == _WRAPS_COLLECTIVE:  # the collective's result itself, though its storage reads as another's
            source = record.owner.get(_tensors(args)[0].untyped_storage())
            for t in outputs if source is not None else ():
                record.owner.setdefault(t.untyped_storage(), source)
        if kind == "compute":
            for t in outputs:
                storage = t.untyped_storage()
                if storage in record.owner:
                    continue
                life = _Life(index, storage.nbytes())
                record.owner[storage] = len(record.lives)
                record.lives.append(life)
                created += life.nbytes
                self.finalizers.append(weakref.finalize(storage, _died, record, life))
        record.work.append(_work(func, args, kwargs))
        record.nodes.append({
            "index": index, "op": str(func), "call": call, "kind": kind, "random": random,
            "shapes": tuple(tuple(t.shape) for t in outputs), "out_bytes": created,
            "needs": tuple(sorted(needs)), "writes": tuple(sorted(writes)), "reads_input": reads_input,
            "mutated": False,
            # Views cost nothing; in-place ops move the memory they write.
            "kernel_time": self.estimate(func, args, kwargs, out) if self.estimate and (kind == "compute" or written)
            else 0.0,
        })
        return out


def _work(func: Any, args: tuple, kwargs: dict) -> tuple:
    """What an op call's cost depends on: the op, its tensors' shapes, dtypes and strides, its other values."""
    leaves = tree_flatten((args, kwargs))[0]
    return func, tuple((tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else repr(x)
                       for x in leaves)


def _died(record: _BlockRecord, life: _Life) -> None:
    if not record.done:
        life.dies = record.ops


def _time_block(record: _BlockRecord, n: int, repeats: int) -> OpTimes:
    """Per-op device and host times of the block's forward on its own device, and a selective policy's cost.

    Under saved-tensor hooks, as in checkpointed runs (autograd then saves outputs without a detach op).
    """
    module = record.module
    clock = Clock(device_of(_tensors((record.args, record.kwargs, list(module.parameters())))))

    def keep_nothing() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(BlockPolicy("selective").policy_fn())

    held = Held()
    inputs: list[tuple[tuple, dict]] = []

    def prepare() -> None:  # only a block that writes to its inputs needs them afresh for every run
        inputs[:] = [_fresh_copies((record.args, record.kwargs)) if record.writes_input
                     else (record.args, record.kwargs)]

    def forward() -> None:
        args, kwargs = inputs.pop()
        module(*args, **kwargs)
        held.clear()  # no backward runs here: drop what autograd saved (see saved.Held)

    # Under saved-tensor hooks, as in checkpointed runs (autograd then saves outputs without a detach op).
    with saved_tensors_hooks(held.pack, held.unpack):
        return time_ops(forward, n, clock, repeats, keep_nothing, record.name, prepare)


def _fresh_copies(tree: Any) -> Any:
    """Copies of a block's recorded inputs for one timed run of a block that writes to one in place (a layer
    ``nn.ReLU(inplace=True)``, ``x[:, :4].mul_(2)``): where it needs grad, an autograd result like the activation
    it stands for, not a leaf autograd refuses to let change.  One copy per tensor object (passed twice: one)."""
    copies: dict[int, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if torch._debug_has_internal_overlap(x):  # an expanded mask: nothing writes to it (torch refuses)
            return x
        if id(x) not in copies:  # strides kept: a sliced input stays one, and ops on it stay the same ops
            fresh = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
            with torch.enable_grad():
                copies[id(x)] = fresh.copy_(x.detach().requires_grad_(x.requires_grad))
        return copies[id(x)]

    return tree_map(copy, tree)


def _graph(record: _BlockRecord, estimated: bool, overheads: Overheads) -> BlockGraph:
    saved_by_node: dict[int, int] = {}
    for life in record.lives:
        if life.saved:
            saved_by_node[life.producer] = saved_by_node.get(life.producer, 0) + life.nbytes
    nodes = [OpNode(saved_bytes=saved_by_node.get(n["index"], 0), wall_time=n["kernel_time"], **n)
             for n in record.nodes]
    storages = [StorageLife(life.producer, life.nbytes, life.saved, life.dies) for life in record.lives]
    inputs = [(tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad)
              for t in _tensors((record.args, record.kwargs))]
    structure = repr((type(record.module).__qualname__, inputs, record.input_saved,
                      [(n.op, n.kind, n.shapes, n.out_bytes, n.saved_bytes, n.needs, n.writes, n.reads_input, n.mutated)
                       for n in nodes],
                      storages, record.packs, record.packs_needing_grad, record.last_pack, record.writes_input))
    signature = hashlib.sha1(structure.encode()).hexdigest()[:16]
    return BlockGraph(
        cls=type(record.module).__name__, signature=signature, nodes=nodes, storages=storages,
        input_bytes=record.input_bytes, input_saved_bytes=sum(record.input_sizes[i] for i in record.input_saved),
        saved_tensors=record.packs, saved_needing_grad=record.packs_needing_grad, stop=record.last_pack,
        forward_time=sum(n.wall_time for n in nodes), estimated=estimated, overheads=overheads,
        writes_input=record.writes_input,
    )


def profile_ops(
    model: nn.Module,
    *example_inputs: Any,
    modules: Sequence[str] | None = None,
    timing: str = "measure",
    repeats: int = 5,
    throughput: float = 100e12,
    bandwidth: float = 2e12,
    interconnect: Interconnect | None = None,
    overheads: Overheads | None = None,
    reference_step: StepTime | None = None,
    **example_kwargs: Any,
) -> OpProfile:
    """Record the op graph of every candidate block of ``model`` on ``example_inputs`` (one forward).

    ``modules`` names the blocks (default: the repeated blocks,
    :func:`remat.planning.basics.discovery.candidate_modules`).  ``timing="measure"`` times one
    block per signature on its device's clock (``repeats`` rounds, median shares);
    ``"estimate"`` (forced on the meta device) uses FLOPs and bytes moved at
    ``throughput`` FLOP/s and ``bandwidth`` B/s, collectives over ``interconnect``
    (:mod:`~remat.planning.measure.interconnect`).  ``overheads`` fixes the
    checkpoint machinery's costs; by default the per-region and per-saved-tensor
    costs come from :func:`~remat.planning.measure.overheads.measure_overheads` and a selective
    policy's cost per op is measured on each timed block (tiny-op figures when
    times are estimated, and copies at ``bandwidth``, read plus write).  The RNG
    state is left as it was.  ``reference_step``: this process's training step
    time, against which cached times are checked (:func:`~remat.planning.measure.timecache.stale`);
    the result's ``step_time`` is then the step time the op times go with.

    Example:
        >>> model = remat.models.GPT()
        >>> tokens, _ = remat.models.synthetic_batch(model.cfg, 8)
        >>> prof = profile_ops(model, tokens)
        >>> print(prof.blocks["blocks.0"])
    """
    if timing not in ("measure", "estimate"):
        raise ValueError(f"remat.profile_ops: timing must be 'measure' or 'estimate', got {timing!r}.")
    if repeats < 1:
        raise ValueError(f"remat.profile_ops: repeats must be >= 1, got {repeats}.")
    if any(isinstance(m, ActivationWrapper) for m in model.modules()):
        raise ValueError("remat.profile_ops: the model already has checkpoint/offload wrappers; remove them first "
                         "so the profile sees the forward without checkpointing.")
    blocks = resolve_blocks(model, modules, "remat.profile_ops")
    tensors = [*model.parameters(), *_tensors((example_inputs, example_kwargs))]
    on_meta = any(t.device.type == "meta" for t in tensors)
    estimated = timing == "estimate" or on_meta
    recorder = _Recorder(estimator(throughput, bandwidth, interconnect) if estimated else None)
    records: dict[str, _BlockRecord] = {}
    names = {id(module): name for name, module in blocks}

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = names[id(module)]
        # Later calls of a block reuse its first call's decisions; one called inside another is the outer's.
        if name not in records and recorder.current is None:
            recorder.current = records[name] = _BlockRecord(name, module, args, kwargs)

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        record = recorder.current
        if record is not None and record.module is module:
            record.done = True
            recorder.current = None

    handles = []
    try:
        for _, module in blocks:  # a record ends before FSDP2's post-forward hook: no recomputation runs its copies
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True, always_call=True,
                                                        prepend=bool(sharded_units(module))))
        with left_as_found(model), torch.enable_grad():
            try:  # a storage dies when the block's code is done with it (StorageLife.dies)
                with left_as_found(model), saved_tensors_hooks(Unheld.after(recorder.pack), Unheld.unpack), recorder:
                    model(*example_inputs, **example_kwargs)
            except SavedTensorGone:  # a backward in the forward: storages live as the graph keeps them
                recorder.forget()
                records.clear()
                with saved_tensors_hooks((held := Held()).after(recorder.pack), held.unpack), recorder:
                    model(*example_inputs, **example_kwargs)
                held.clear()
            for handle in handles:
                handle.remove()
            handles.clear()
            for finalizer in recorder.finalizers:
                finalizer.detach()
            if overheads is None and on_meta:  # planned for another machine: FLOPs and bytes only, alike anywhere
                overheads = Overheads(0.0, 0.0, 0.0, 0.0, 2 / bandwidth)
            measure_policy = overheads is None
            device = str(device_of(tensors))
            ranks = Ranks.of(model)  # FSDP2 blocks gathered by every rank first; all timed alike (timings_cache)
            with gathered(_timed_modules(records, estimated, ranks.same)), timings_cache(ranks) as cache:
                if overheads is None:
                    overheads = cached_overheads(cache, device)
                    if estimated:  # copies at the roofline's bandwidth, like the estimated kernels (read + write)
                        overheads = replace(overheads, copy_per_byte=2 / bandwidth)
                graphs, step_time = _graphs(records, estimated, overheads, repeats, measure_policy, cache, device,
                                            reference_step, model_key(model, tensors))
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name, _ in blocks if name not in graphs]
    notes = [f"{', '.join(missing)} did not run in the forward; no graph"] if missing else []
    device = str(next(iter(tensors)).device) if tensors else "cpu"
    return OpProfile(blocks=graphs, device=device, notes=notes, step_time=step_time)


def _graphs(records: dict[str, _BlockRecord], estimated: bool, overheads: Overheads, repeats: int,
            measure_policy: bool, cache: TimingCache, device: str, step: StepTime | None, key: str
            ) -> tuple[dict[str, BlockGraph], float | None]:
    """Every block's graph (blocks of one signature share one) timed from the cache or measured, and the step
    time those times go with (None without a ``step``)."""
    graphs: dict[str, BlockGraph] = {}
    shared: dict[str, BlockGraph] = {}  # per signature: the graph its blocks share
    for name, record in records.items():
        graph = _graph(record, estimated, overheads)
        graphs[name] = shared.setdefault(graph.signature, graph)
    if estimated:
        return graphs, None
    unsteady: dict[str, float] = {}  # block -> its forwards' spread, where they still varied: one line for them all
    # ranks timing together time what rank 0's signatures pick (a collective's thread may free a storage late)
    agreed = cache.same({name: g.signature for name, g in graphs.items()})
    first = {signature: name for name, signature in reversed(agreed.items())}
    times, step_time = cached_times(cache, device, agreed, step, key, unsteady_limit(),
                                    lambda signature: dataclasses.asdict(_steady_times(
                                        records[first[signature]], len(graphs[first[signature]].nodes), repeats,
                                        unsteady, cache.same)))
    if unsteady:
        first_name, more = next(iter(unsteady)), (f" and {len(unsteady) - 1} more blocks" if len(unsteady) > 1 else "")
        warnings.warn(UnsteadyTimings(
            f"remat.profile: the forward of `{first_name}`{more} varied by up to {max(unsteady.values()):.0%} between "
            "timed rounds (is the machine busy?); plans priced from these times may differ from run to run, and "
            "they are not cached: profile again on a quieter machine."), stacklevel=user_stacklevel())
    for name, graph in {id(g): (n, g) for n, g in graphs.items()}.values():
        timing = OpTimes(**times[agreed[name]])
        graph.nodes = [replace(n, kernel_time=d, host_time=h, wall_time=w)
                       for n, d, h, w in zip(graph.nodes, timing.device, timing.host, timing.wall)]
        graph.forward_time = timing.forward
        graph.asynchronous = timing.asynchronous
        if measure_policy:
            graph.overheads = replace(overheads, policy_forward=timing.policy_forward,
                                      policy_replay=timing.policy_replay)
    return graphs, step_time


def _timed_modules(records: dict[str, _BlockRecord], estimated: bool, same: Callable[[Any], Any]) -> list[nn.Module]:
    """The modules :func:`_graphs` may time: the first block of each signature (none when times are estimated), by
    rank 0's signatures where ranks time together (``same``), as :func:`_graphs` picks them."""
    if estimated:
        return []
    unpriced = Overheads(0.0, 0.0, 0.0, 0.0, 0.0)  # a signature does not depend on the machinery's prices
    first = {_graph(record, estimated, unpriced).signature: name for name, record in reversed(records.items())}
    return [records[name].module for name in same(list(first.values()))]


def _steady_times(record: _BlockRecord, n: int, repeats: int, unsteady: dict[str, float],
                  same: Callable[[float], float]) -> OpTimes:
    """The block's op times, measured again with more rounds where its forwards varied by more than
    :func:`~remat.planning.measure.timecache.unsteady_limit`; its spread in ``unsteady`` where they still did.
    Whether to measure again is rank 0's call (``same``) where ranks time together."""
    timing, limit = _time_block(record, n, repeats), unsteady_limit()
    if same(timing.spread) > limit:
        timing = _time_block(record, n, 2 * repeats + 1)
        if same(timing.spread) > limit:
            unsteady[record.name] = timing.spread
    return pooled(timing, record.work)

