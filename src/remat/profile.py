"""Where activation memory goes: a per-module profile of one training step.

``remat.profile(model, *args, **kwargs)`` runs training steps with no checkpointing and records, for each
candidate block (by default the model's natural repeated blocks, see :mod:`remat.discovery`):

* the bytes of activations it keeps for backward, its input and output bytes, and the bytes a
  ``save_matmuls`` policy would keep;
* its forward time (median of repeated, interleaved timings; blocks of identical shape share one figure
  so that equal blocks tie exactly), and the measured extra time of checkpointing it and of checkpointing
  it with ``save_matmuls`` (each option's own dispatch overhead included);
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
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .discovery import candidate_modules
from .memory import format_bytes
from .policies import MATMUL_OPS
from .state import tensor_leaves

if TYPE_CHECKING:
    from .opgraph import OpProfile
    from .planner import Plan

__all__ = [
    "ModuleProfile", "Profile", "Segment", "SharedTensor", "candidate_modules", "live_bytes_timeline", "profile",
]


@dataclass
class ModuleProfile:
    """One candidate module's row of the profile (bytes and seconds).

    ``own_bytes`` are the saved bytes only this block holds: what recomputing it frees.
    ``held_bytes`` are inputs only this block takes that recomputing it keeps alive until its backward.
    ``recompute_bytes`` is the peak its recomputation adds above the live bytes at the start of its
    backward.  ``checkpoint_time`` / ``save_matmuls_time`` are the extra step time of each option.
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

    @property
    def recompute_time(self) -> float:
        """Estimated cost of rerunning the module in backward: its forward time."""
        return self.forward_time


@dataclass
class Segment:
    """The peak of live bytes in one stretch of the step.

    ``prefix`` blocks come before it (their decisions change it); ``block`` is set for a block's own
    backward (its recomputation raises it); ``start`` is the live bytes when the stretch began;
    ``backward`` says whether the stretch comes after the model's forward.
    """

    label: str
    peak: int
    prefix: int
    block: int | None = None
    start: int = 0
    backward: bool = False


@dataclass
class SharedTensor:
    """A storage whose lifetime depends on more than one block's decision (or on non-block code too).

    ``saved_by``: blocks that save it for backward; ``input_of``: blocks that take it as an input (a
    recomputing block keeps its inputs until its backward); ``outside``: also saved by code outside the
    blocks; ``alive``: per segment, whether it outlives that segment in the step without checkpointing.
    """

    nbytes: int
    saved_by: list[int]
    input_of: list[int]
    outside: bool
    alive: list[bool]


@dataclass
class Profile:
    """The result of :func:`profile`: rows, totals and the memory timeline of one step."""

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

    @property
    def peak_above_params(self) -> int:
        return self.peak_bytes - self.param_bytes - self.buffer_bytes

    def plan(self, budget: int | float | str, allow: Sequence[str] | None = None) -> Plan:
        """The cheapest plan for ``budget`` from this profile: no new measurement, milliseconds.

        ``allow``: the options a block may take besides ``keep`` (default: all of them, see :func:`remat.plan`).

        Example:
            >>> prof = remat.profile(model, input_ids=ids, labels=ids)
            >>> plans = {b: prof.plan(b) for b in (0.3, 0.5, 0.7)}
        """
        from .planner import plan_from_profile

        return plan_from_profile(self, budget) if allow is None else plan_from_profile(self, budget, allow)

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


class _Storage:
    """What the profile learns about one storage: size, life in raw segments, who saves and takes it."""

    __slots__ = ("nbytes", "birth", "death", "savers", "inputs", "existing", "counted")

    def __init__(self, nbytes: int, birth: int, existing: bool, counted: bool) -> None:
        self.nbytes, self.birth, self.death, self.existing, self.counted = nbytes, birth, None, existing, counted
        self.savers: set[int | None] = set()  # block indices; None for code outside the blocks
        self.inputs: set[int] = set()


class _Timeline(TorchDispatchMode):
    """Counts live storage bytes as ops allocate and tensors die; keeps the peak of each segment."""

    def __init__(self, existing: Sequence[torch.Tensor], record: bool = False,
                 uncounted: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.series: list[int] | None = [] if record else None  # live bytes after every op
        self.live = 0
        self.segment_peak = 0
        self.segments: list[tuple[str, int, int, int]] = []  # (label, peak, ops in it, live at its start)
        self.ops = 0
        self.segment_start = 0
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.records: list[_Storage] = []
        for t in existing:
            self.track(t, existing=True)
        for t in uncounted:
            self.track(t, existing=True, counted=False)
        self.segment_peak = self.segment_start = self.live

    def track(self, t: torch.Tensor, existing: bool = False, counted: bool = True) -> _Storage:
        """The record of ``t``'s storage, created (and counted live) on first sight."""
        storage = t.untyped_storage()
        found = self.storages.get(storage)
        if found is not None:
            return found
        record = _Storage(storage.nbytes(), len(self.segments), existing, counted)
        self.storages[storage] = record
        self.records.append(record)
        self.live += record.nbytes if counted else 0
        self.segment_peak = max(self.segment_peak, self.live)
        # A storage's Python object lives as long as the storage: its death frees the bytes.
        weakref.finalize(storage, self._free, record)
        return record

    def _free(self, record: _Storage) -> None:
        self.live -= record.nbytes if record.counted else 0
        record.death = len(self.segments)

    def mark(self, label: str) -> None:
        """Close the current segment under ``label`` and start the next one."""
        self.segments.append((label, self.segment_peak, self.ops, self.segment_start))
        self.segment_peak = self.segment_start = self.live
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.track(t)
        if self.series is not None:
            self.series.append(self.live)
        return out


class _Probe:
    """Hooks on the candidate modules: forward and backward windows, inputs, saved tensors."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], timeline: _Timeline) -> None:
        self.blocks = blocks
        self.index = {id(m): i for i, (_, m) in enumerate(blocks)}
        self.timeline = timeline
        n = len(blocks)
        self.input_bytes = [0] * n
        self.output_bytes = [0] * n
        self.forward_start = [0] * n
        self.last_save_peak = [0] * n  # the forward's peak when it saved its last tensor (where early stop ends)
        self.seconds = [0.0] * n
        self.outputs: list[set[_Storage]] = [set() for _ in range(n)]
        self.started = 0.0
        self.current: int | None = None
        self.last_backward: int | None = None
        self.in_forward = True
        self.handles: list[Any] = []

    def install(self) -> None:
        for _, module in self.blocks:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = self.index[id(module)]
        self.timeline.mark(f"before forward {i}")
        self.current = i
        self.forward_start[i] = self.last_save_peak[i] = self.timeline.live
        seen = set()
        for t in tensor_leaves((args, kwargs)):
            record = self.timeline.track(t)
            record.inputs.add(i)
            if id(record) not in seen:
                seen.add(id(record))
                self.input_bytes[i] += record.nbytes
        self.started = time.perf_counter()

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = self.index[id(module)]
        self.seconds[i] += time.perf_counter() - self.started
        self.current = None
        self.timeline.mark(f"forward {i}")
        outs = list(tensor_leaves(output))
        self.outputs[i] = {self.timeline.track(t) for t in outs}
        self.output_bytes[i] = sum(r.nbytes for r in self.outputs[i])
        for t in outs:
            if t.requires_grad:
                t.register_hook(lambda g, i=i: self._backward_starts(i))

    def _backward_starts(self, i: int) -> None:
        """Block i's backward starts when the gradient of one of its outputs is complete.

        It ends when the next block's starts: whatever runs between is counted with it (a safe side, as
        its saved tensors may still be alive there).  Later outputs of the same block, and blocks out of
        chain order, change nothing.
        """
        if self.last_backward is not None and i >= self.last_backward:
            return
        self.close_backward()
        self.last_backward = i

    def close_backward(self) -> None:
        """Close the current backward stretch (after the loss, or a block's backward)."""
        last = self.last_backward
        self.timeline.mark("after loss" if last is None else f"backward {last}")

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.in_forward:
            record = self.timeline.track(t)
            record.savers.add(self.current)
            if self.current is not None:
                self.last_save_peak[self.current] = self.timeline.segment_peak
        return t


class _MatmulMeter(TorchDispatchMode):
    """Bytes of matmul-like outputs and the time spent in matmul-like ops, per block."""

    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe
        n = len(probe.blocks)
        self.time = [0.0] * n
        self.outputs: list[set[_Storage]] = [set() for _ in range(n)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i = self.probe.current
        if i is None or func not in MATMUL_OPS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.time[i] += time.perf_counter() - start
        for t in tensor_leaves(out):
            self.outputs[i].add(self.probe.timeline.track(t))
        return out


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return sum(t.float().sum() for t in tensor_leaves(output) if t.is_floating_point())


def _refuse_kv_cache(output: Any) -> None:
    """Raise if a Hugging Face model filled a KV cache: every recomputation would extend it again."""
    if getattr(output, "past_key_values", None) is not None:
        raise ValueError(
            "remat.profile: the model returned past_key_values, so each forward appends to a KV cache and a "
            "checkpointed layer would see a longer cache when it is recomputed. Train without it: "
            "model.config.use_cache = False (transformers does the same when gradient checkpointing is on)."
        )


def _resolve(model: nn.Module, modules: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    if modules is None:
        blocks = candidate_modules(model)
        if not blocks:
            raise ValueError(
                "remat.profile: found no repeated blocks (children of a ModuleList/Sequential mostly of one "
                "class); name the candidate modules with modules=[...]."
            )
        return blocks
    named = dict(model.named_modules())
    missing = [m for m in modules if m not in named]
    if missing:
        raise ValueError(f"remat.profile: no module named {missing} in {type(model).__name__}.")
    return [(m, named[m]) for m in modules]


def profile(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    modules: Sequence[str] | None = None,
    device: str | None = None,
    throughput: float = 100e12,
    repeats: int = 5,
    ops: bool = True,
    **example_kwargs: Any,
) -> Profile:
    """Profile training steps of ``model(*example_inputs, **example_kwargs)`` (no checkpointing).

    ``loss_fn(output)`` turns the output into a scalar (default: the output's ``.loss``, as Hugging Face
    models return when given ``labels=``, or the sum of its floating tensors).  Gradients are left as they
    were before the call.  Forward times are the median of ``repeats`` interleaved timings.  ``ops=True``
    also records each block's op graph (:func:`remat.profile_ops`, one more forward) into ``.ops``, from
    which plans draw their op-level ``selective`` options.

    ``device="meta"`` profiles without allocating: build the model and the inputs on the meta device
    (``with torch.device("meta"): model = ...``); bytes are exact, times are FLOPs
    (``torch.utils.flop_counter``) divided by ``throughput`` (FLOP/s of the target accelerator).

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)       # a Hugging Face model
        >>> prof = remat.profile(gpt, tokens, loss_fn=lambda logits: ...)
        >>> print(prof); plan = prof.plan(0.5)
    """
    if device not in (None, "meta"):
        raise ValueError(f"remat.profile: device must be None (the model's own) or 'meta', got {device!r}.")
    if repeats < 1:
        raise ValueError(f"remat.profile: repeats must be at least 1, got {repeats}.")
    blocks = _resolve(model, modules)
    loss_fn = loss_fn or _default_loss

    def step() -> torch.Tensor:
        return loss_fn(model(*example_inputs, **example_kwargs))

    inputs = list(tensor_leaves((example_inputs, example_kwargs)))
    if device == "meta":
        result = _profile_on_meta(model, step, inputs, blocks, throughput)
    else:
        result = _profile_measured(model, example_inputs, example_kwargs, blocks, step, loss_fn, inputs, repeats)
    if ops:
        from .opgraph import profile_ops

        result.ops = profile_ops(model, *example_inputs, modules=[name for name, _ in blocks], repeats=repeats,
                                 throughput=throughput, **example_kwargs)
    return result


def _profile_measured(model: nn.Module, example_inputs: tuple, example_kwargs: dict,
                      blocks: list[tuple[str, nn.Module]], step: Callable[[], torch.Tensor],
                      loss_fn: Callable[[Any], torch.Tensor], inputs: list[torch.Tensor], repeats: int) -> Profile:
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        output = model(*example_inputs, **example_kwargs)
        _refuse_kv_cache(output)
        loss_fn(output).backward()
        del output
        for p in params:
            p.grad = None
        times, step_time = _time_options(model, blocks, step, repeats)
        traced = _trace(model, step, inputs, blocks)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    timeline, probe, meter, grad_bytes = traced
    forward_time = [plain for plain, _, _ in times]
    # The instrumented pass slows every op; only the matmul *share* of its time is trusted.
    matmul_time = [min(meter.time[i] / probe.seconds[i], 1.0) * forward_time[i] if probe.seconds[i] > 0 else 0.0
                   for i in range(len(blocks))]
    # On a busy machine a variant's step can time no slower than the plain one: a rerun still costs at least
    # the forward it repeats (without the matmuls, for save_matmuls).
    checkpoint_time = [max(checkpointed, forward_time[i]) for i, (_, checkpointed, _) in enumerate(times)]
    selective_time = [max(selective, forward_time[i] - matmul_time[i]) for i, (_, _, selective) in enumerate(times)]
    return _assemble(model, blocks, timeline, probe, meter, grad_bytes, forward_time, matmul_time,
                     checkpoint_time, selective_time, step_time, str(params[0].device) if params else "cpu")


def _signature(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Blocks with equal signatures compute the same thing on the same shapes: their timings are pooled."""
    shapes = tuple((tuple(t.shape), t.dtype) for t in tensor_leaves((args, kwargs)))
    return type(module), shapes, tuple(tuple(p.shape) for p in module.parameters())


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _time_options(model: nn.Module, blocks: list[tuple[str, nn.Module]], step: Callable[[], torch.Tensor],
                  repeats: int) -> tuple[list[tuple[float, float, float]], float]:
    """Per block: its forward seconds, and the extra step seconds of checkpointing it, plain or save_matmuls.
    Also the median step time without checkpointing.

    Whole training steps with no block wrapped, every block checkpointed, and every block checkpointed with
    ``save_matmuls``, interleaved round by round after a warm-up round; medians.  A variant's extra step
    time (its recomputations and every overhead it brings: the wrapper, the policy's dispatch) is shared
    among the blocks in proportion to their forward time under it.  Blocks with one signature share the
    median of their pooled timings, so equal blocks tie exactly.  A variant that fails on this model (a
    policy meeting an output mutated in place) is priced at infinity.
    """
    from .modules import checkpoint_wrapper
    from .policies import save_matmuls

    wrappers: dict[str, Callable[[nn.Module], nn.Module] | None] = {
        "plain": None,
        "checkpoint": checkpoint_wrapper,
        "save_matmuls": lambda m: checkpoint_wrapper(m, policy=save_matmuls),
    }
    n = len(blocks)
    forward = {variant: [[] for _ in range(n)] for variant in wrappers}
    steps: dict[str, list[float]] = {variant: [] for variant in wrappers}
    signatures: list[Any] = [None] * n
    failed: set[str] = set()
    for round_index in range(repeats + 1):
        for variant, wrap in wrappers.items():
            if variant in failed:
                continue
            timed = [m if wrap is None else wrap(m) for _, m in blocks]
            started = [0.0] * n
            elapsed = [0.0] * n
            handles = []
            for i, module in enumerate(timed):
                def pre(module, args, kwargs, i=i, started=started):
                    if signatures[i] is None:
                        signatures[i] = _signature(module, args, kwargs)
                    started[i] = time.perf_counter()

                def post(module, args, kwargs, output, i=i, started=started, elapsed=elapsed):
                    elapsed[i] += time.perf_counter() - started[i]

                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True))
                if wrap is not None:
                    _swap(model, blocks[i][0], module)
            try:
                begin = time.perf_counter()
                step().backward()
                took = time.perf_counter() - begin
            except Exception:
                if wrap is None:
                    raise
                failed.add(variant)
                continue
            finally:
                model.zero_grad(set_to_none=True)
                for h in handles:
                    h.remove()
                if wrap is not None:
                    for name, module in blocks:
                        _swap(model, name, module)
            if round_index:  # the first round warms up
                steps[variant].append(took)
                for i in range(n):
                    forward[variant][i].append(elapsed[i])
    groups: dict[Any, list[int]] = {}
    for i, signature in enumerate(signatures):
        groups.setdefault(signature if signature is not None else i, []).append(i)
    medians = {variant: [0.0] * n for variant in wrappers}
    for variant in set(wrappers) - failed:
        for members in groups.values():
            value = statistics.median(x for i in members for x in forward[variant][i])
            for i in members:
                medians[variant][i] = value
    base = statistics.median(steps["plain"])
    extra: dict[str, list[float]] = {}
    for variant in ("checkpoint", "save_matmuls"):
        if variant in failed:
            extra[variant] = [float("inf")] * n
            continue
        # differences within a round (the variants ran back to back) cancel the machine's slow drifts
        total = max(statistics.median(v - p for v, p in zip(steps[variant], steps["plain"])), 0.0)
        weight = sum(medians[variant]) or 1.0
        extra[variant] = [total * t / weight for t in medians[variant]]
    return [(medians["plain"][i], extra["checkpoint"][i], extra["save_matmuls"][i]) for i in range(n)], base


def _trace(model: nn.Module, step: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
           blocks: list[tuple[str, nn.Module]], *modes: Any) -> tuple[_Timeline, _Probe, _MatmulMeter, int]:
    """One instrumented step: the memory timeline, who saves and takes which storage, matmul outputs."""
    params = list(model.parameters())
    # The example inputs exist before the step and are not counted, as MemTracker does not see them.
    timeline = _Timeline([*params, *model.buffers()], uncounted=inputs)
    probe = _Probe(blocks, timeline)
    meter = _MatmulMeter(probe)
    probe.install()
    try:
        with ExitStack() as contexts:
            for context in (torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack_identity), timeline, meter,
                            *modes):
                contexts.enter_context(context)
            loss = step()
            timeline.mark("loss")
            probe.in_forward = False
            loss.backward()
            del loss
        probe.close_backward()
    finally:
        probe.remove()
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
    return timeline, probe, meter, grad_bytes


def _profile_on_meta(model: nn.Module, step: Callable[[], torch.Tensor], inputs: list[torch.Tensor],
                     blocks: list[tuple[str, nn.Module]], throughput: float) -> Profile:
    from torch.utils.flop_counter import FlopCounterMode

    params = list(model.parameters())
    if any(t.device.type != "meta" for t in (*params, *model.buffers(), *inputs)):
        raise ValueError(
            "remat.profile(device='meta'): put the model and the inputs on the meta device first, e.g. build "
            "the model under `with torch.device('meta'):` and create inputs with device='meta'."
        )
    flops = FlopCounterMode(display=False)
    timeline, probe, meter, grad_bytes = _trace(model, step, inputs, blocks, flops)
    for p in params:
        p.grad = None
    counts = flops.get_flop_counts()
    forward_time = []
    for name, _ in blocks:
        # FlopCounterMode names modules "<RootClass>.<path>"; it counts forward + backward (~1 + 2 parts)
        block_flops = sum(counts.get(f"{type(model).__name__}.{name}", {}).values()) / 3
        forward_time.append(block_flops / throughput)
    total = sum(counts.get("Global", {}).values())
    # FLOPs are counted for matmul-like ops only: all of a block's time is matmul time
    prof = _assemble(model, blocks, timeline, probe, meter, grad_bytes, forward_time, forward_time, forward_time,
                     [0.0] * len(blocks), total / throughput, "meta")
    prof.estimated_time = True
    prof.notes.append(f"times estimated from FLOPs at {throughput:.3g} FLOP/s")
    return prof


def live_bytes_timeline(step: Callable[[], Any], *existing: torch.Tensor) -> list[int]:
    """Live storage bytes after every operator of ``step()``; pass the tensors that exist before it.

    Example:
        >>> series = live_bytes_timeline(lambda: model(x).sum().backward(), *model.parameters(), x)
    """
    timeline = _Timeline(existing, record=True)
    with timeline:
        step()
    return timeline.series


def _unpack_identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _assemble(model: nn.Module, blocks: list[tuple[str, nn.Module]], timeline: _Timeline, probe: _Probe,
              meter: _MatmulMeter, grad_bytes: int, forward_time: list[float], matmul_time: list[float],
              checkpoint_time: list[float], selective_time: list[float], step_time: float, device: str) -> Profile:
    n = len(blocks)
    segments, last_raw = _segments(timeline.segments, n)
    own, held, first_saved = [0] * n, [0] * n, [0] * n
    shared: list[SharedTensor] = []
    for record in timeline.records:
        if record.existing:
            continue
        saving = sorted(j for j in record.savers if j is not None)
        if saving:
            first_saved[saving[0]] += record.nbytes
        holders = set(saving) | record.inputs
        if not holders:
            continue  # no decision changes its life
        alive = [record.birth <= k and (record.death is None or record.death > k) for k in last_raw]
        if _is_own(record, saving, holders, alive, segments, probe):
            (j,) = holders
            own[j] += record.nbytes if saving else 0
            held[j] += record.nbytes if j in record.inputs else 0
        else:
            shared.append(SharedTensor(record.nbytes, saving, sorted(record.inputs), None in record.savers, alive))
    rows = []
    for i, (name, module) in enumerate(blocks):
        matmul = meter.outputs[i]
        rows.append(ModuleProfile(
            name=name, cls=type(module).__name__, act_bytes=first_saved[i], input_bytes=probe.input_bytes[i],
            output_bytes=probe.output_bytes[i], forward_time=forward_time[i], matmul_time=matmul_time[i],
            matmul_bytes=sum(r.nbytes for r in matmul), own_bytes=own[i], held_bytes=held[i],
            recompute_bytes=probe.last_save_peak[i] - probe.forward_start[i],
            checkpoint_time=checkpoint_time[i], save_matmuls_time=selective_time[i],
        ))
    params = list(model.parameters())
    return Profile(
        rows=rows, segments=segments, shared=shared,
        param_bytes=sum(p.untyped_storage().nbytes() for p in params),
        buffer_bytes=sum(b.untyped_storage().nbytes() for b in model.buffers()),
        grad_bytes=grad_bytes, peak_bytes=max(s.peak for s in segments), device=device, step_time=step_time,
    )


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


def _segments(marks: list[tuple[str, int, int, int]], n: int) -> tuple[list[Segment], list[int]]:
    """Turn the marks into segments that know how many blocks precede them; also each one's last raw mark.

    Marks with no op between them fired at the same instant: they close one segment, named after a
    block's backward when one is among them.
    """
    groups: list[list[tuple[int, str, int, int]]] = []
    for k, (label, peak, ops, start) in enumerate(marks):
        if groups and ops == 0:
            groups[-1].append((k, label, peak, start))
        else:
            groups.append([(k, label, peak, start)])
    segments, last_raw = [], []
    for group in groups:
        labels = [label for _, label, _, _ in group]
        label = next((x for x in labels if x.startswith("backward ")), labels[0])
        peak, start = group[0][2], group[0][3]
        last_raw.append(group[-1][0])
        head, _, number = label.rpartition(" ")
        if head == "backward":
            segments.append(Segment(label, peak, int(number), int(number), start, backward=True))
        elif head in ("forward", "before forward"):
            segments.append(Segment(label, peak, int(number), start=start))
        elif label == "loss":
            segments.append(Segment(label, peak, n, start=start))
        else:  # "after loss": every block's backward is still to come
            segments.append(Segment(label, peak, n, start=start, backward=True))
    return segments, last_raw
