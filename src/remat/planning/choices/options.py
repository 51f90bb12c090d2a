"""What each block may become in a plan: keep, checkpoint, save_matmuls, selective points, offload, kept with
its largest saved tensors offloaded (``keep_offload``, built by :mod:`remat.planning.choices.keptoffload`), and on a
tensor-parallel model checkpointed with its inputs kept as one shard per rank (``checkpoint_partitioned``,
:mod:`remat.planning.choices.partitioned`).

Each option is a :class:`BlockOption`: the bytes of the block's own it keeps from forward to backward, the
extra step time it costs, the transient its recomputation adds in backward, and how to install it.
Built-in options come from the measured profile.

``selective`` options are points of each block's op-level front (:mod:`remat.planning.choices.fronts`).
A front point (:class:`~remat.planning.choices.fronts.FrontPoint`) is stated in the op graph's terms: bytes
the block keeps (its inputs plus the kept op outputs) and extra seconds predicted from per-op kernel times.  The solver
(:mod:`remat.planning.solve.solver`) works in the whole-step profile's terms.  The translation, per block:

* kept bytes: what the block holds when checkpointed (``row.held_bytes``) plus the kept op outputs —
  exact, both are storage bytes;
* transient: the recomputation's measured peak (``row.recompute_bytes``) less what the kept outputs
  spare it (the front's ``recompute_peak`` of plain checkpointing minus the point's);
* extra time: the point's predicted time scaled by the profile's price of checkpointing the block over
  the front's (one figure when both come from the op graph's prices; on the meta device the profile's
  FLOP estimate), so every option of a block is priced on one scale.

Only the front's interior points become options: its two ends are the planner's own ``checkpoint`` and
``keep``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ...api.checkpoint import OFFLOAD_INPUTS_MIN_BYTES
from ...policies.hostcopy import engine_for
from ...policies.offload import PREFETCH_DEPTH
from ..basics.blockpolicy import BlockPolicy
from ..measure.copies import link_for, prefetch_wait
from ..measure.copyline import Copy, Timeline, simulate
from ..measure.opgraph import BlockGraph, OpProfile
from ..measure.prices import forward_spared, sent_again, wire_nodes
from ..measure.profile import ModuleProfile, StepProfile
from .fronts import FrontPoint, evaluate, fronts, offload_twins, policy_for, thin_front
from .partitioned import PARTITIONED, keep_collectives, partitioned_option

__all__ = ["BlockOption", "CopySchedule", "block_options", "copy_schedule", "offloads_note", "selective_option",
           "selective_options", "step_extra_time", "unavailable_offloads"]

OPTIONS = ("keep", "checkpoint", "save_matmuls", "selective", "offload", "checkpoint_offload", "keep_offload",
           PARTITIONED)
ALLOWED = OPTIONS[1:]
# Offloading op outputs is asked for by name: on an H100 a Llama layer that offloaded 32 MiB of op outputs
# measured ~4 ms of extra time, priced ~2 ms, and no plan measured faster with offloads than without.
DEFAULT_ALLOW = ("checkpoint", "save_matmuls", "selective", "checkpoint_offload", "keep_offload", PARTITIONED)
OFFLOADS = ("offload", "checkpoint_offload", "keep_offload")
_OFFLOAD_BYTES_PER_SECOND = 12e9  # a PCIe 4 x16 link, one direction, in practice: where none was measured
_GRID = 2.0**32  # prices per second


@dataclass(frozen=True)
class BlockOption:
    """One way to run a block in the plan.

    ``kept``: bytes of the block's own storages (see :class:`~remat.planning.measure.profile.ModuleProfile`)
    alive from its forward to its backward.  ``recomputes``: the block is checkpointed, so it holds its inputs until its
    backward and reruns there, raising that backward by ``transient`` bytes above the live bytes at its
    start.  ``extra_time``: seconds added to the step.  ``wrap`` installs the option on the module (None for
    the built-in options, installed by name).  ``policy``: the op-level decisions of a ``selective`` option
    (what a saved plan records); ``recomputed_ops``: how many ops its recomputation reruns, when known;
    ``copy_time``: the part of ``extra_time`` its offload copies leave unhidden.  ``in_flight``: bytes of the
    block the offload hooks' copies may hold on the device at once (the copy engine's window, plus one entry):
    counted once in the step's peak, whichever blocks offload.  ``span``: how many consecutive blocks, from
    this one, the option runs as one region (a ``segment``, :mod:`remat.planning.choices.chain`); ``kept`` and
    ``transient`` are then the region's.  ``moved``: bytes of the block's inputs that go to host memory until
    its backward (``checkpoint_offload``), whose copies :func:`step_extra_time` prices on the step's timeline.
    ``copies``: the saved tensors a kept block moves to host memory (``keep_offload``), priced there too.
    ``spared``: how much less than the plain forward's peak the block's forward holds under the option (negative:
    more, outputs a policy keeps that the plain forward had freed).  ``resends``: the collectives its recomputation
    sends again (a tensor-parallel block's all-reduce), which the planner spends only where keeping what crossed
    the wire does not fit (:func:`~remat.planning.solve.solver.plan_from_profile`).  ``backward_held``: bytes the
    block's own backward holds under the option beyond what it held without a plan (``checkpoint_partitioned``: the
    shard beside the gathered input, and the gather's padding).

    Example:
        >>> BlockOption("checkpoint", kept=row.held_bytes, extra_time=row.checkpoint_time,
        ...             transient=row.recompute_bytes, recomputes=True)
    """

    name: str
    kept: int
    extra_time: float = 0.0
    transient: int = 0
    recomputes: bool = False
    wrap: Callable[[nn.Module], nn.Module] | None = field(default=None, compare=False)
    policy: BlockPolicy | None = field(default=None, compare=False)
    recomputed_ops: int | None = field(default=None, compare=False)
    copy_time: float = field(default=0.0, compare=False)  # of extra_time: offload copies left unhidden
    in_flight: int = field(default=0, compare=False)
    span: int = 1
    moved: int = field(default=0, compare=False)
    copies: tuple[Copy, ...] = field(default=(), compare=False)
    spared: int = field(default=0, compare=False)
    resends: int = field(default=0, compare=False)
    backward_held: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        # On a grid of 2**-32 s (a quarter nanosecond) the solver's sums of prices are exact: plans that
        # take the same options in another order (identical blocks) tie exactly instead of by rounding.
        if self.extra_time != float("inf"):
            object.__setattr__(self, "extra_time", round(self.extra_time * _GRID) / _GRID)


def block_options(prof: StepProfile, allow: Sequence[str] = DEFAULT_ALLOW) -> list[list[BlockOption]]:
    """The options of every block (``keep`` first), as the planner sees them.

    ``selective`` options come from the profile's op graphs (``prof.ops``, recorded by
    ``remat.profile(..., ops=True)``); without them a plan chooses among the other options.

    Example:
        >>> [o.name for o in block_options(prof)[0]]
        ['keep', 'checkpoint', 'save_matmuls', 'selective', 'selective', ...]
    """
    unknown = set(allow) - set(ALLOWED)
    if unknown:
        raise ValueError(f"remat.plan: unknown options {sorted(unknown)}; choose from {list(ALLOWED)}.")
    missing = unavailable_offloads(prof, allow)
    others = _listed([o for o in ALLOWED if o not in OFFLOADS and (o != PARTITIONED or prof.partitioned)], "or")
    if PARTITIONED in allow and not prof.partitioned and set(allow) <= {PARTITIONED, *missing}:
        raise ValueError(f"remat.plan: {PARTITIONED} needs a tensor-parallel model profiled on every rank under "
                         "torchrun (or on the meta device in remat.fake_world), whose blocks take inputs of 1 MiB or "
                         f"more that every rank holds in full; this profile has none: allow {others}.")
    if allow and set(allow) <= set(missing):  # a plan could only keep every block: not what was asked
        raise ValueError(f"remat.plan: {_unavailable_phrase(prof.device, missing)}: allow {others}, or profile the "
                         "model on a CUDA device.")
    on_accelerator = not prof.device.startswith(("cpu", "meta"))
    measured = [g.overheads.link_bytes_per_s for g in prof.ops.blocks.values()] if prof.ops is not None else []
    link = max(measured, default=0.0) or _OFFLOAD_BYTES_PER_SECOND
    engine = engine_for(prof.device.split(":")[0]) if on_accelerator else None
    # only an engine whose copies run on their own stream holds tensors in flight
    window = engine.in_flight_limit if engine is not None and engine.model.asynchronous else 0
    selective = {}
    if "selective" in allow and prof.ops is not None:
        from .options import selective_options

        selective = selective_options(prof, prof.ops, offload="offload" in allow)
    per_block = []
    for row in prof.rows:
        choices = [BlockOption("keep", row.own_bytes)]
        if row.writes_input:  # a region starting here would rerun from its written input
            per_block.append(choices)
            continue
        if "checkpoint" in allow and row.checkpoint_time != float("inf"):
            choices.append(BlockOption("checkpoint", row.held_bytes, row.checkpoint_time, row.recompute_bytes, True,
                                       spared=row.forward_spared, resends=row.collectives))
        if "save_matmuls" in allow and row.matmul_bytes and row.save_matmuls_time != float("inf"):
            # Its recomputation is served the kept matmul outputs it reruns to instead of making them again.
            choices.append(BlockOption("save_matmuls", row.held_bytes + row.matmul_bytes, row.save_matmuls_time,
                                       max(0, row.recompute_bytes - row.matmul_spared_bytes), True,
                                       spared=row.matmul_forward_spared))
        choices += [o for o in selective.get(row.name, ()) if o.kept < row.own_bytes]
        graph = prof.ops.blocks.get(row.name) if prof.ops is not None else None
        kept = (keep_collectives(graph) if PARTITIONED in allow and row.name in prof.partitioned and graph is not None
                else None)
        if kept is not None and row.checkpoint_time != float("inf"):
            base = selective_option(row, graph, kept) if kept else BlockOption(
                "checkpoint", row.held_bytes, row.checkpoint_time, row.recompute_bytes, True, spared=row.forward_spared)
            choices += partitioned_option(row, graph, base, prof.partitioned[row.name])
        if "checkpoint_offload" in allow and on_accelerator and row is not prof.rows[-1]:
            choices += _checkpoint_offload(prof, row, prof.rows[prof.rows.index(row) + 1])
        if "offload" in allow and on_accelerator:
            copy_time = 2 * row.own_bytes / link
            # Copies run behind the compute stream by up to the engine's window, plus one entry (a tensor going
            # out, or one fetch and its prefetch coming back early).
            graph = prof.ops.blocks.get(row.name) if prof.ops is not None else None
            largest = max((s.nbytes for s in graph.storages if s.saved), default=0) if graph is not None else 0
            in_flight = min(row.own_bytes - row.held_bytes, window + (PREFETCH_DEPTH + 1) * largest)
            choices.append(BlockOption("offload", row.held_bytes, copy_time, 0, True, copy_time=copy_time,
                                       in_flight=in_flight))
        per_block.append(choices)
    return per_block


def unavailable_offloads(prof: StepProfile, allow: Sequence[str]) -> list[str]:
    """The options of ``allow`` that move bytes to host memory and that no block of ``prof`` gets: on the CPU and
    the meta device all of them (a CPU tensor is in host memory already) but ``offload``'s moved op outputs of
    ``selective`` blocks where the op graphs were timed as on an accelerator; on an accelerator whose copy engine
    runs copies in line with the compute, ``keep_offload``.

    Example:
        >>> unavailable_offloads(prof, ("checkpoint", "checkpoint_offload"))  # prof.device == "cpu"
        ['checkpoint_offload']
    """
    if prof.device.startswith(("cpu", "meta")):
        graphs = prof.ops.blocks.values() if prof.ops is not None and "selective" in allow else ()
        twins = any(graph.asynchronous for graph in graphs)  # offload_twins: what a host link would hide
        return [o for o in allow if o in OFFLOADS and not (o == "offload" and twins)]
    engine = engine_for(prof.device.split(":")[0])
    asynchronous = engine is not None and engine.model.asynchronous
    return [] if asynchronous or "keep_offload" not in allow else ["keep_offload"]


def offloads_note(prof: StepProfile, allow: Sequence[str]) -> str:
    """One sentence saying which options of ``allow`` no block of ``prof`` gets and why ('' if none).

    Example:
        >>> offloads_note(prof, ("checkpoint", "offload"))  # prof.device == "cpu"
        'offload needs an accelerator whose copies run on their own stream (CUDA); on cpu it is not available.'
    """
    missing = unavailable_offloads(prof, allow)
    return f"{_unavailable_phrase(prof.device, missing)}." if missing else ""


def _unavailable_phrase(device: str, missing: Sequence[str]) -> str:
    names = _listed(missing, "and")
    one = len(missing) == 1
    return (f"{names} {'needs' if one else 'need'} an accelerator whose copies run on their own stream (CUDA); on "
            f"{device} {'it is' if one else 'they are'} not available")


def _listed(names: Sequence[str], conjunction: str) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def _checkpoint_offload(prof: StepProfile, row: ModuleProfile, after: ModuleProfile) -> list[BlockOption]:
    """Checkpoint with the block's inputs in host memory until its backward (``checkpoint(offload_inputs=True)``).

    Never for the chain's last block: backward starts with it, so its inputs' copy back would have no other
    block's backward to run behind.  Their copy back starts when backward reaches the next block; it costs the
    time it outlasts that block's backward (twice its forward; its recomputation, if any, not counted).  In
    flight: the inputs of two blocks at once (the block's own in its backward, the previous block's on their
    way back; in forward, one copy out the allocator cannot reuse before it completes), one window for the step.
    """
    moved = row.held_bytes
    if moved < OFFLOAD_INPUTS_MIN_BYTES or row.checkpoint_time == float("inf"):
        return []
    wait = prefetch_wait(moved, 2 * after.forward_time, link_for(prof.device))
    return [BlockOption("checkpoint_offload", row.held_bytes - moved, row.checkpoint_time + wait,
                        row.recompute_bytes, True, copy_time=wait, in_flight=2 * moved, moved=moved,
                        spared=row.forward_spared, resends=row.collectives)]


def step_extra_time(prof: StepProfile, chosen: Sequence[BlockOption]) -> float:
    """Extra seconds of ``chosen`` (one option per run of blocks, in order): the options' prices, and where blocks move
    bytes to host memory (``checkpoint_offload``'s inputs, ``keep_offload``'s largest saved tensors), what the compute
    stream waits for every copy of the plan, tensor by tensor, as the copy engine runs them under the plan's schedule
    (:func:`copy_schedule`) instead of each option's copy price alone.

    Example:
        >>> step_extra_time(prof, [keep, checkpoint_offload, checkpoint])
    """
    total = sum(o.extra_time for o in chosen)
    schedule = copy_schedule(prof, chosen)
    if schedule is None:
        return total
    alone = sum(o.copy_time for o in chosen if o.copies or o.moved)
    return total - alone + schedule.line.wait


@dataclass(frozen=True)
class CopySchedule:
    """How a plan whose blocks move bytes to host memory runs its copies, and their timeline.

    Its ``checkpoint_offload`` inputs go out under the engine's window and come back by its prefetch depth; its
    ``keep_offload`` tensors are scheduled (no window limit, brought back by bytes).
    ``drains[p]``: the bytes of copies out the engine may hold when block ``p`` starts (None: no bound); the host
    waits for the oldest beyond them (:meth:`~remat.policies.hostcopy.HostCopies.drain`), so what the plan's peak
    counts holds however the link keeps up.  Each is what the copies left in flight there on the timeline; when
    the last block's forward ends the bound is 0: every copy is complete before the loss.  ``ahead``: at each
    fetch, the copies back of the moved tensors before it start as far as this many bytes reach: twice the most a
    block moves, so a block's tensors start back up to two blocks before backward needs them.  ``line``: the step's
    copies under it (:func:`~remat.planning.measure.copyline.simulate`).

    Example:
        >>> copy_schedule(prof, chosen).drains
        (None, 0, 92274688, ..., 46137344)
    """

    ahead: int | None
    drains: tuple[int | None, ...]
    line: Timeline


_UNBOUNDED = 1 << 62
_SCHEDULES_KEPT = 1024  # per profile: the plans a search prices and sizes more than once


def copy_schedule(prof: StepProfile, chosen: Sequence[BlockOption]) -> CopySchedule | None:
    """The schedule of ``chosen``'s copies (see :class:`CopySchedule`); None if no block moves bytes.

    Example:
        >>> schedule = copy_schedule(prof, chosen)
        >>> schedule.line.wait  # seconds the compute stream waits for copies
    """
    if not any(o.copies or o.moved for o in chosen):
        return None
    window = _window(prof.device)
    key = (window, *map(id, chosen))
    # kept with the profile, so they go with it; each entry holds the options its key names
    schedules = prof.__dict__.setdefault("_copy_schedules", {})
    if key in schedules:
        return schedules[key][-1]
    n = len(prof.rows)
    recompute, copies = [0.0] * n, [()] * n
    p = 0
    for o in chosen:
        recompute[p + o.span - 1] = o.extra_time - o.copy_time
        copies[p] = o.copies or ((Copy(0.0, 0.0, o.moved),) if o.moved else ())
        p += o.span
    forward = [row.forward_time for row in prof.rows]
    head = max(0.0, prof.step_time - 3 * sum(forward))
    ahead = 2 * max(sum(c.nbytes for c in block if c.scheduled) for block in copies) or None
    # the drains bound what the copies leave in flight at each block's start: probing with no bound gives it
    probe = (None, *[_UNBOUNDED] * (n - 1))
    line = simulate(forward, recompute, copies, link_for(prof.device), window, head, ahead=ahead,
                    drains=probe, turn=0)
    schedule = CopySchedule(ahead, (None, *line.after[1:]), line)
    schedules[key] = (tuple(chosen), schedule)
    while len(schedules) > _SCHEDULES_KEPT:
        schedules.pop(next(iter(schedules)))
    return schedule


def _window(device: str) -> int:
    """The copy engine's in-flight limit for ``device``'s tensors."""
    engine = engine_for(device.split(":")[0])
    return engine.in_flight_limit if engine is not None else 0


def selective_options(prof: StepProfile, ops: OpProfile, points: int = 12, offload: bool = False
                      ) -> dict[str, list[BlockOption]]:
    """Per block of ``prof`` with an op graph in ``ops``: up to ``points`` selective options from its front,
    and with ``offload`` (on an accelerator) their twins that move op outputs to host memory.

    Example:
        >>> extra = selective_options(prof, remat.profile_ops(model, tokens))
        >>> [o.name for o in extra["blocks.0"]]
        ['selective', 'selective', ...]
    """
    per_block = fronts(ops)
    options: dict[str, list[BlockOption]] = {}
    for row in prof.rows:
        front = per_block.get(row.name)
        if not front or front[0].mode != "checkpoint" or row.checkpoint_time == float("inf"):
            continue
        graph = ops.blocks[row.name]
        interior = [p for p in thin_front(front, points + 2) if p.mode == "selective"]
        twins = offload_twins(graph, [front[0], *interior]) if offload else []  # what the host link hides
        options[row.name] = [_option(row, graph, front[0], p) for p in (*interior, *twins, *_wire(graph, interior))]
    return options


def selective_option(row: ModuleProfile, graph: BlockGraph, kept: Sequence[int]) -> BlockOption:
    """The ``selective`` option of ``row``'s block that keeps the outputs of the ``kept`` nodes of its op graph
    (any of ``graph.keepable``, not only a front's point), priced and sized as the planner's own.

    Example:
        >>> option = selective_option(prof.rows[0], prof.ops.blocks[prof.rows[0].name], graph.keepable[:2])
    """
    return _option(row, graph, evaluate(graph, "checkpoint"), evaluate(graph, "selective", kept))


def _wire(graph: BlockGraph, interior: Sequence[FrontPoint]) -> list[FrontPoint]:
    """The point that keeps what crossed the wire and reruns the rest (``remat.policies.save_collectives``), where
    the block sends collectives and the front's thinned points do not have it: the cheapest bytes that spare a
    recomputation its communication, which the planner takes before any option that sends them again."""
    wire = set(wire_nodes(graph))
    if not sent_again(graph) or any(set(p.kept) == wire for p in interior):
        return []
    return [evaluate(graph, "selective", wire)]


def _option(row: ModuleProfile, graph: BlockGraph, checkpoint: FrontPoint, point: FrontPoint) -> BlockOption:
    scale = row.checkpoint_time / checkpoint.extra_time if checkpoint.extra_time > 0 else 1.0
    policy = policy_for(graph, point)
    return BlockOption(
        "selective",
        kept=row.held_bytes + point.kept_bytes - point.input_bytes,
        extra_time=point.extra_time * scale,
        transient=max(0, row.recompute_bytes - (checkpoint.recompute_peak - point.recompute_peak)),
        recomputes=True,
        wrap=policy.wrap,
        policy=policy,
        recomputed_ops=point.recomputed_ops,
        copy_time=point.copy_time * scale,
        spared=forward_spared(graph, {*point.kept, *point.offloaded}),  # offloaded: on the device until copied
        resends=len(set(sent_again(graph)) - {*point.kept, *point.offloaded}),
    )
