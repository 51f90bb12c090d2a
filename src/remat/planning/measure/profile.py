"""Where activation memory goes: a per-module profile of one training step.

``remat.profile(model, *args, **kwargs)`` runs training steps with no checkpointing and records, for each
candidate block (by default the model's natural repeated blocks, see :mod:`remat.planning.basics.discovery`):

* the bytes of activations it keeps for backward, its input and output bytes, and the bytes a
  ``save_matmuls`` policy would keep;
* its forward time and the extra step time of checkpointing it and of checkpointing it with
  ``save_matmuls``, priced from its op graph (:mod:`remat.planning.measure.prices`: per-op device and host times,
  the machinery's measured overheads); blocks with one graph share one price, so equal blocks tie exactly;
* a memory *timeline*: the peak of live bytes in every segment of the step (each block's forward, each
  block's backward, the stretches between), and the live bytes when each segment starts;
* exact accounting of every tensor storage a plan could change: who saves it for backward, which blocks
  take it as an input, and in which segments it is alive.

The bytes a plan changes come in two kinds.  A block's *own* storages are saved by that block alone (or
are inputs of that block alone): checkpointing the block frees (or holds) them in every later segment, so
they add up per block.  *Shared* storages (an attention mask passed to every layer, rotary tables, an
encoder's output, a block's output that it and the next block both save) are alive while any of their
holders holds them, and are counted once, where they live; the planner tracks them exactly.

A recomputation in backward holds what the block's forward held up to the last tensor it saves (early
stop ends it there), on top of the live bytes at the start of that block's backward.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...engine.replay import tensor_leaves
from ...policies.rules import is_collective
from ..basics.ranks import local
from ..basics.units import format_bytes
from .estimates import rank_flop_formulas
from .gathers import PartitionedInputs
from .interconnect import CollectiveClock, Interconnect
from .opgraph import OpNode, OpProfile, profile_ops
from .prices import BlockPrices, forward_spared, matmuls, recompute_peak, sent_again
from .timecache import StepTime
from .timeline import Segment, _MatmulMeter, _Probe, _segments, _Storage, _Timeline, _trace
from .timing import Clock, device_of, spread

__all__ = ["ModuleProfile", "SharedTensor", "StepProfile", "default_loss", "measure"]


@dataclass
class ModuleProfile:
    """One candidate module's row of the profile (bytes and seconds).

    ``own_bytes`` are the saved bytes only this block holds: what recomputing it frees.
    ``held_bytes`` are inputs only this block takes that recomputing it keeps alive until its backward.
    ``recompute_bytes`` is the peak its recomputation adds above the live bytes at the start of its
    backward.  ``checkpoint_time`` / ``save_matmuls_time`` are the extra step time of each option.

    For regions of several consecutive blocks (:mod:`remat.planning.choices.chain`): ``forward_start``,
    ``forward_peak`` and ``save_peak`` are the step's live bytes when the block's forward starts, at its
    forward's peak and at that peak when it saved its last tensor (absolute, so that a run of blocks reads
    its recomputation's transient from them); ``region_time`` is the part of ``checkpoint_time`` one region
    costs whatever it runs, and ``tail_time`` what rerunning the ops after its last saved tensor costs (a
    block inside a region reruns them for the next one).  ``writes_input``: the block writes in place to an
    input, so no region may start at it (only keep it, or run it inside a region that starts earlier);
    ``in_place_layers``: then the module paths of its layers built to write in place (``nn.ReLU(inplace=True)``).

    A recomputing block keeps its inputs until its backward, where the step without a plan may have freed
    them: ``unsaved_held_bytes`` is the part of ``held_bytes`` the block does not save (a Dropout's input: it
    saves its mask), alive in the block's backward only under a plan; ``released_inputs`` lists ``(k, bytes)``
    for this block's inputs the step without a plan had freed before block ``k``'s forward, which a region
    starting at this block keeps through its rerun of ``k``.  ``matmul_bytes`` are the matmul outputs
    ``save_matmuls`` keeps (those no later op overwrites) that no other block holds (the others are shared
    storages ``kept_by`` it), ``matmul_spared_bytes`` how much less than ``recompute_bytes`` its recomputation
    holds, served the kept outputs it reruns to.  ``forward_spared`` / ``matmul_forward_spared``: how much less
    than the plain forward's peak the block's forward holds checkpointed / under save_matmuls (autograd keeps
    nothing there; save_matmuls keeps every matmul output, which may hold more: negative).
    ``collectives``: the collectives (a tensor-parallel block's all-reduce) its recomputation sends again when
    checkpointed, and ``tail_collectives`` those after its last saved tensor, which a block inside a region also
    sends again for the next.
    """

    name: str
    cls: str
    act_bytes: int
    input_bytes: int
    output_bytes: int
    forward_time: float
    matmul_time: float
    matmul_bytes: int
    own_bytes: int
    held_bytes: int
    recompute_bytes: int
    checkpoint_time: float
    save_matmuls_time: float
    forward_start: int = 0
    forward_peak: int = 0
    save_peak: int = 0
    region_time: float = 0.0
    tail_time: float = 0.0
    writes_input: bool = False
    in_place_layers: tuple[str, ...] = ()
    unsaved_held_bytes: int = 0
    released_inputs: list[tuple[int, int]] = field(default_factory=list)
    matmul_spared_bytes: int = 0
    forward_spared: int = 0
    matmul_forward_spared: int = 0
    collectives: int = 0
    tail_collectives: int = 0

    @property
    def recompute_time(self) -> float:
        """Estimated cost of rerunning the module in backward: its forward time."""
        return self.forward_time


@dataclass
class SharedTensor:
    """A storage whose lifetime depends on more than one block's decision (or on non-block code too).

    ``saved_by``: blocks that save it for backward; ``input_of``: blocks that take it as an input (a
    recomputing block keeps its inputs until its backward); ``outside``: also saved by code outside the
    blocks; ``alive``: per segment, whether it outlives that segment in the step without checkpointing;
    ``output_of``: blocks that returned it (their caller holds it after their forward); ``kept_by``: blocks
    whose ``save_matmuls`` would keep it (a matmul output of theirs) until their recomputation starts, and
    ``served_to`` those whose recomputation is served it (made before their last saved tensor), which hold it
    on through their backward; ``at_peak``: per segment, whether it was alive at that segment's peak (it may
    die later in the segment).
    """

    nbytes: int
    saved_by: list[int]
    input_of: list[int]
    outside: bool
    alive: list[bool]
    output_of: list[int] = field(default_factory=list)
    kept_by: list[int] = field(default_factory=list)
    served_to: list[int] = field(default_factory=list)
    at_peak: list[bool] = field(default_factory=list)

    @property
    def holders(self) -> set[int]:
        """The blocks whose decisions may hold it: savers, takers, and those save_matmuls keeps it for."""
        return set(self.saved_by) | set(self.input_of) | set(self.kept_by)


@dataclass
class StepProfile:
    """What one training step keeps, per candidate block: rows, totals and the memory timeline."""

    rows: list[ModuleProfile]
    segments: list[Segment]
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    peak_bytes: int
    device: str
    step_time: float
    estimated_time: bool = False
    notes: list[str] = field(default_factory=list)
    shared: list[SharedTensor] = field(default_factory=list)
    ops: OpProfile | None = field(default=None, repr=False)
    # links[i]: blocks i and i + 1 are consecutive children of one plain nn.Sequential, which a plan may
    # checkpoint as one region (see remat.planning.choices.chain)
    links: list[bool] = field(default_factory=list)
    # the step measured keeps the model's output alive until backward ends (the loop people write), or drops it
    # once the loss is computed: plans from this profile assume the same
    hold_output: bool = True
    # per block of a tensor-parallel model: its inputs kept as one shard per rank (checkpoint_partitioned)
    partitioned: dict[str, PartitionedInputs] = field(default_factory=dict)

    @property
    def peak_above_params(self) -> int:
        return self.peak_bytes - self.param_bytes - self.buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        out = asdict(replace(self, ops=None))
        out.pop("ops")
        out["peak_above_params"] = self.peak_above_params
        return out

    def __str__(self) -> str:
        header = f"{'module':<24} {'class':<16} {'activations':>12} {'input':>10} {'output':>10} {'fwd ms':>8}"
        lines = [header, "-" * len(header)]
        for r in self.rows:
            lines.append(
                f"{r.name:<24} {r.cls:<16} {format_bytes(r.act_bytes):>12} {format_bytes(r.input_bytes):>10} "
                f"{format_bytes(r.output_bytes):>10} {r.forward_time * 1e3:>8.2f}"
            )
        kind = "estimated from FLOPs" if self.estimated_time else "measured"
        lines.append(
            f"parameters {format_bytes(self.param_bytes)}, gradients {format_bytes(self.grad_bytes)}, "
            f"step peak {format_bytes(self.peak_bytes)} ({format_bytes(self.peak_above_params)} above "
            f"parameters) on {self.device}; times {kind}"
        )
        return "\n".join(lines)


def default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return sum(t.float().sum() for t in tensor_leaves(output) if t.is_floating_point())


def _kv_cache(output: Any) -> Any:
    """The KV cache a Hugging Face output carries, or None.  Read from the output's own field (``cache`` since
    transformers 5, ``past_key_values`` before): reading the old name of a new output logs a deprecation."""
    names = getattr(type(output), "__dataclass_fields__", None)
    if names is None or not isinstance(output, Mapping):  # not a ModelOutput (a dataclass and a dict)
        return getattr(output, "past_key_values", None)
    return next((getattr(output, name) for name in ("cache", "past_key_values") if name in names), None)


def _refuse_kv_cache(output: Any) -> None:
    """Raise if a Hugging Face model filled a KV cache: every recomputation would extend it again."""
    if _kv_cache(output) is not None:
        raise ValueError(
            "remat.profile: the model returned past_key_values, so each forward appends to a KV cache and a "
            "checkpointed layer would see a longer cache when it is recomputed. Train without it: "
            "model.config.use_cache = False (transformers does the same when gradient checkpointing is on)."
        )


def measure(model: nn.Module, example_inputs: tuple, example_kwargs: dict, blocks: list[tuple[str, nn.Module]],
            loss_fn: Callable[[Any], torch.Tensor], device: str | None, throughput: float, repeats: int,
            hold_output: bool = True, interconnect: Interconnect | None = None) -> StepProfile:
    """Measure training steps of ``model`` for the ``blocks`` (see :func:`remat.profile` for the arguments).

    The result's ``ops`` holds the blocks' op graphs, from which the options are priced.  On the meta device the
    collectives are priced over ``interconnect`` (default: :class:`~remat.planning.measure.interconnect.Interconnect`'s
    defaults): in the step's time, in each block's forward and in what its recomputation sends again.

    Example:
        >>> measured = measure(model, (tokens,), {}, candidate_modules(model), loss, None, 100e12, 5)
    """
    def forward() -> Any:
        return model(*example_inputs, **example_kwargs)

    step = _Step(forward, loss_fn, hold_output)
    inputs = list(tensor_leaves((example_inputs, example_kwargs)))
    interconnect = interconnect or Interconnect()
    if device == "meta":
        prof = _profile_on_meta(model, step, inputs, blocks, throughput, interconnect)
    else:
        prof = _profile_measured(model, example_inputs, example_kwargs, blocks, step, inputs, repeats)
    prof.hold_output = hold_output
    if prof.ops is None:
        prof.ops = profile_ops(model, *example_inputs, modules=[name for name, _ in blocks], repeats=repeats,
                               throughput=throughput, interconnect=interconnect, **example_kwargs)
    for row in prof.rows:
        graph = prof.ops.blocks.get(row.name)
        row.writes_input = graph is not None and graph.writes_input
        if graph is None:
            continue
        prices = BlockPrices(graph)
        if device == "meta":  # the FLOPs priced its compute; its collectives cross the wire
            rerun, tail = _communication(graph.nodes[:graph.stop]), _communication(graph.nodes[graph.stop:])
            row.forward_time += rerun + tail
            row.checkpoint_time += rerun
            row.tail_time += tail  # a block inside a region reruns its tail, collectives included
            # save_matmuls reruns what is not a matmul: priced on the checkpoint's scale, as the selective points are
            if prices.checkpoint_time > 0 and row.save_matmuls_time != float("inf"):
                row.save_matmuls_time = row.checkpoint_time * (prices.time("selective", prices.matmul_nodes())
                                                               / prices.checkpoint_time)
        # save_matmuls serves its recomputation the kept matmul outputs it reruns to
        served = set(prices.matmul_nodes())
        row.matmul_spared_bytes = recompute_peak(graph) - recompute_peak(graph, served)
        row.forward_spared, row.matmul_forward_spared = forward_spared(graph), forward_spared(graph, matmuls(graph))
        row.collectives = len(sent_again(graph))
        row.tail_collectives = len(sent_again(graph, whole=True)) - row.collectives
    return prof


@dataclass(frozen=True)
class _Step:
    """The training step a profile measures: ``forward()``, its output's loss, backward; ``hold_output``: the
    output stays alive until backward ends (``out = model(x); out.loss.backward()``), else it dies once the loss
    is computed."""

    forward: Callable[[], Any]
    loss_fn: Callable[[Any], torch.Tensor]
    hold_output: bool

    def __call__(self) -> None:
        output = self.forward()
        loss = self.loss_fn(output)
        if not self.hold_output:
            del output
        loss.backward()

    def trace(self, model: nn.Module, inputs: list[torch.Tensor], blocks: list[tuple[str, nn.Module]]
              ) -> tuple[_Timeline, _Probe, _MatmulMeter, int]:
        """The step instrumented (:func:`~remat.planning.measure.timeline._trace`)."""
        return _trace(model, self.forward, self.loss_fn, inputs, blocks, hold_output=self.hold_output)


_STEP_ROUNDS = 2  # timed plain steps for the step time; per-op times come from the op graphs' rounds


def _profile_measured(model: nn.Module, example_inputs: tuple, example_kwargs: dict,
                      blocks: list[tuple[str, nn.Module]], step: _Step, inputs: list[torch.Tensor], repeats: int
                      ) -> StepProfile:
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        output = model(*example_inputs, **example_kwargs)  # also warms up the timed steps
        _refuse_kv_cache(output)
        step_loss = step.loss_fn(output)
        del output
        step_loss.backward()
        del step_loss
        step_time = _time_steps(model, step, min(repeats, _STEP_ROUNDS), params)
        traced = step.trace(model, inputs, blocks)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    ops = profile_ops(model, *example_inputs, modules=[name for name, _ in blocks], repeats=repeats,
                      reference_step=step_time, **example_kwargs)
    # the step the op times were measured with (cached with them): a plan's "+N%" reads alike in every process
    step_time = ops.step_time or step_time.seconds
    timeline, probe, meter, grad_bytes = traced
    n = len(blocks)
    forward_time, matmul_time, checkpoint_time, selective_time = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    region_time, tail_time = [0.0] * n, [0.0] * n
    for i, (name, _) in enumerate(blocks):
        graph = ops.blocks.get(name)
        if graph is None:  # the block did not run: nothing to recompute
            continue
        prices = BlockPrices(graph)
        forward_time[i], matmul_time[i] = graph.forward_time, prices.matmul_time
        checkpoint_time[i] = prices.time("checkpoint")
        # On an accelerator a rerun is priced as the larger of its kernels and its host work: one region less
        # in a run of blocks may spare nothing there, so only the CPU's price counts it out.
        region_time[i] = 0.0 if graph.asynchronous else graph.overheads.region
        tail_time[i] = sum(node.wall_time for node in graph.nodes[graph.stop:])
        # A matmul output modified after the block's forward cannot be kept: save_matmuls fails on it.
        selective_time[i] = float("inf") if meter.mutated_later[i] else prices.time("selective",
                                                                                   prices.matmul_nodes())
    prof = _assemble(model, blocks, timeline, probe, meter, grad_bytes, forward_time, matmul_time,
                     checkpoint_time, selective_time, step_time, str(params[0].device) if params else "cpu")
    for row, region, tail in zip(prof.rows, region_time, tail_time):
        row.region_time, row.tail_time = region, tail
    prof.ops = ops
    return prof


def _time_steps(model: nn.Module, step: _Step, rounds: int, params: list[nn.Parameter]) -> StepTime:
    """The device seconds of ``rounds`` training steps without checkpointing (one synchronize each): their
    median and spread."""
    clock = Clock(device_of(params))
    times = []
    for _ in range(rounds):
        times.append(clock.time(step)[1])
        for p in params:
            p.grad = None
    return StepTime(statistics.median(times), spread(times))


def _communication(nodes: list[OpNode]) -> float:
    """The seconds the collectives among ``nodes`` take (their estimated times)."""
    return sum(node.kernel_time for node in nodes if is_collective(node.op))


def _profile_on_meta(model: nn.Module, step: _Step, inputs: list[torch.Tensor],
                     blocks: list[tuple[str, nn.Module]], throughput: float, interconnect: Interconnect
                     ) -> StepProfile:
    from torch.utils.flop_counter import FlopCounterMode

    params = list(model.parameters())
    if any(t.device.type != "meta" for t in (*params, *model.buffers(), *inputs)):
        raise ValueError(
            "remat.profile(device='meta'): put the model and the inputs on the meta device first, e.g. build "
            "the model under `with torch.device('meta'):` and create inputs with device='meta'."
        )
    timeline, probe, meter, grad_bytes = step.trace(model, inputs, blocks)
    for p in params:
        p.grad = None
    # FLOPs in a step of their own: the counter's module hooks pass tensors through autograd functions of
    # their own, which keep some alive longer in backward (a SiLU layer's backward held 20 MiB more).
    flops, wire = FlopCounterMode(display=False, custom_mapping=rank_flop_formulas()), CollectiveClock(interconnect)
    with flops, wire:
        step()
    for p in params:
        p.grad = None
    counts = flops.get_flop_counts()
    forward_time = []
    for name, _ in blocks:
        # FlopCounterMode names modules "<RootClass>.<path>"; it counts forward + backward (~1 + 2 parts)
        block_flops = sum(counts.get(f"{type(model).__name__}.{name}", {}).values()) / 3
        forward_time.append(block_flops / throughput)
    total = sum(counts.get("Global", {}).values())
    # FLOPs are counted for matmul-like ops only: all of a block's time is matmul time (save_matmuls is priced
    # from the op graphs, below)
    prof = _assemble(model, blocks, timeline, probe, meter, grad_bytes, forward_time, forward_time, forward_time,
                     [0.0] * len(blocks), total / throughput + wire.seconds, "meta")
    prof.estimated_time = True
    prof.notes.append(f"times estimated from FLOPs at {throughput:.3g} FLOP/s")
    if wire.count:
        prof.notes.append(f"{wire.count} collectives in the step priced over an interconnect of "
                          f"{interconnect.bandwidth:.3g} B/s per rank and {interconnect.latency:.3g} s latency")
    return prof


def _assemble(model: nn.Module, blocks: list[tuple[str, nn.Module]], timeline: _Timeline, probe: _Probe,
              meter: _MatmulMeter, grad_bytes: int, forward_time: list[float], matmul_time: list[float],
              checkpoint_time: list[float], selective_time: list[float], step_time: float, device: str) -> StepProfile:
    n = len(blocks)
    segments, last_raw = _segments(timeline.segments, n)
    first_raw = [0] + [k + 1 for k in last_raw[:-1]]  # a segment's peak is its first raw segment's
    # what a refusal says its smallest peak is made of
    at_peaks = timeline.parts_at([timeline.peak_events[k] for k in first_raw])
    at_starts = timeline.parts_at([timeline.start_events[k] for k in first_raw])
    for segment, at_peak, at_start in zip(segments, at_peaks, at_starts):
        segment.parts, segment.start_parts = at_peak, at_start
    own, held, unsaved_held, first_saved, matmul = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
    released: list[dict[int, int]] = [{} for _ in range(n)]
    shared: list[SharedTensor] = []
    # the matmul outputs save_matmuls keeps: those no later op writes in place
    kept_matmuls = [meter.outputs[i] - meter.overwritten for i in range(n)]
    for record in timeline.records:
        if record.existing or record in timeline.refilled:  # FSDP2 frees its gathered parameters, not autograd
            continue
        saving = sorted(j for j in record.savers if j is not None)
        if saving:
            first_saved[saving[0]] += record.nbytes
        kept_by = [i for i in range(n) if record in kept_matmuls[i]]
        holders = set(saving) | record.inputs
        if kept_by and not (holders - set(kept_by)) and None not in record.savers:
            # its maker alone may hold it: save_matmuls keeps it among the block's own bytes
            matmul[kept_by[0]] += record.nbytes
            kept_by = []
        holders |= set(kept_by)
        if not holders:
            continue  # no decision changes its life
        for i in record.inputs:
            k = _first_forward_after(probe, i, record.death)
            if k is not None:
                released[i][k] = released[i].get(k, 0) + record.nbytes
        alive = [record.birth <= k and (record.death is None or record.death > k) for k in last_raw]
        if _is_own(record, saving, holders, alive, segments, probe):
            (j,) = holders
            own[j] += record.nbytes if saving else 0
            held[j] += record.nbytes if j in record.inputs else 0
            unsaved_held[j] += record.nbytes if j in record.inputs and not saving else 0
        else:
            returned = [j for j in range(n) if record in probe.outputs[j]]
            served = [i for i in kept_by if record.born_event <= probe.last_save_event[i]]
            at_peak = [timeline.alive_at_peak(record, k) for k in first_raw]
            shared.append(SharedTensor(record.nbytes, saving, sorted(record.inputs), None in record.savers, alive,
                                       returned, kept_by, served, at_peak))
    forward_peak = probe.forward_start.copy()
    for label, peak, _, _ in timeline.segments:
        head, _, number = label.rpartition(" ")
        if head == "forward":
            forward_peak[int(number)] = max(forward_peak[int(number)], peak)
    rows = []
    for i, (name, module) in enumerate(blocks):
        rows.append(ModuleProfile(
            name=name, cls=type(module).__name__, act_bytes=first_saved[i], input_bytes=probe.input_bytes[i],
            output_bytes=probe.output_bytes[i], forward_time=forward_time[i], matmul_time=matmul_time[i],
            matmul_bytes=matmul[i], own_bytes=own[i], held_bytes=held[i],
            recompute_bytes=probe.last_save_peak[i] - probe.forward_start[i],
            checkpoint_time=checkpoint_time[i], save_matmuls_time=selective_time[i],
            forward_start=probe.forward_start[i], forward_peak=forward_peak[i], save_peak=probe.last_save_peak[i],
            unsaved_held_bytes=unsaved_held[i], released_inputs=sorted(released[i].items()),
        ))
    params = list(model.parameters())
    return StepProfile(
        rows=rows, segments=segments, shared=shared,
        param_bytes=sum(local(p).untyped_storage().nbytes() for p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in model.buffers()),
        grad_bytes=grad_bytes, peak_bytes=max(s.peak for s in segments), device=device, step_time=step_time,
    )


def _first_forward_after(probe: _Probe, i: int, death: int | None) -> int | None:
    """The first block after block ``i`` whose forward began after a storage that died in raw segment
    ``death`` was gone (None if it outlived them all)."""
    if death is None:
        return None
    return next((k for k in range(i + 1, len(probe.blocks)) if probe.forward_mark[k] > death), None)


def _is_own(record: _Storage, saving: list[int], holders: set[int], alive: list[bool], segments: list[Segment],
            probe: _Probe) -> bool:
    """Whether one block alone decides this storage's life, the same way in every later segment.

    True when a single block saves or takes it, no code outside the blocks saves it, it is not that
    block's own output (which lives on in the caller), and in the step without checkpointing it is alive
    exactly while that block's backward is still to come.
    """
    if len(holders) != 1 or None in record.savers:
        return False
    (j,) = holders
    if saving and record in probe.outputs[j]:
        return False
    for seg, is_alive in zip(segments, alive):
        # (during the block's own backward it dies part-way: either answer is right there)
        if seg.backward and seg.block != j and is_alive != (bool(saving) and seg.prefix > j):
            return False
    return True

