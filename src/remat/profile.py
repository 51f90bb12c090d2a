"""Where activation memory goes: a per-module profile of one training step.

``remat.profile(model, *inputs)`` runs one forward + backward with no
checkpointing and records, for each candidate module (by default the repeated
blocks: children of a ModuleList/Sequential that share one class):

* the bytes of activations it keeps for backward (storages de-duplicated,
  parameters excluded), its input and output bytes, and the bytes a
  ``save_matmuls`` policy would keep;
* its forward time (measured), which is what recomputing it costs, and the
  part of that spent in matmul-like ops;
* a memory *timeline*: the peak of live bytes in every segment of the step
  (each block's forward, each block's backward, and the stretches between).

The planner predicts the peak of any keep/checkpoint assignment from that
timeline: checkpointing block ``j`` lowers every later segment by what ``j``
no longer keeps, and raises ``j``'s own backward by its recomputation's
temporaries.  With no checkpointing the prediction is the measured peak.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .memory import format_bytes
from .policies import MATMUL_OPS
from .state import tensor_leaves

__all__ = ["ModuleProfile", "Profile", "Segment", "candidate_modules", "live_bytes_timeline", "profile"]


@dataclass
class ModuleProfile:
    """One candidate module's row of the profile (bytes and seconds)."""

    name: str
    cls: str
    act_bytes: int
    input_bytes: int
    output_bytes: int
    forward_time: float
    matmul_time: float
    matmul_bytes: int
    kept_if_checkpointed: int
    recompute_extra: int
    matmul_unsaved_bytes: int = 0

    @property
    def recompute_time(self) -> float:
        """Estimated cost of rerunning the module in backward: its forward time."""
        return self.forward_time


@dataclass
class Segment:
    """The peak of live bytes in one stretch of the step.

    ``prefix`` blocks come before it (their decisions lower it); ``block`` is
    set for a block's own backward (its recomputation raises it).
    """

    label: str
    peak: int
    prefix: int
    block: int | None = None


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

    @property
    def peak_above_params(self) -> int:
        return self.peak_bytes - self.param_bytes - self.buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        out = asdict(self)
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


def candidate_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``: children of ModuleLists/Sequentials that all share one class.

    Example:
        >>> [name for name, _ in candidate_modules(remat.models.GPT())]
        ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    """
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
                found.extend((f"{name}.{child}" if name else child, c) for child, c in children)
                taken.append(f"{name}." if name else "")
    return found


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Timeline(TorchDispatchMode):
    """Counts live storage bytes as ops allocate and tensors die; keeps the peak of each segment."""

    def __init__(self, existing: Sequence[torch.Tensor], record: bool = False) -> None:
        super().__init__()
        self.series: list[int] | None = [] if record else None  # live bytes after every op
        self.live = 0
        self.segment_peak = 0
        self.segments: list[tuple[str, int, int, int]] = []  # (label, peak, ops in it, live at its start)
        self.ops = 0
        self.segment_start = 0
        self._tracked = WeakIdKeyDictionary()
        for t in existing:
            self._track(t)
        self.segment_peak = self.segment_start = self.live

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._tracked:
            return
        nbytes = storage.nbytes()
        self._tracked[storage] = nbytes
        self.live += nbytes
        self.segment_peak = max(self.segment_peak, self.live)
        # A storage's Python object lives as long as the storage: its death frees the bytes.
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

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
                self._track(t)
        if self.series is not None:
            self.series.append(self.live)
        return out


class _Probe:
    """Hooks on the candidate modules: forward windows, backward windows, saved and matmul bytes."""

    def __init__(self, blocks: list[tuple[str, nn.Module]], param_storages: set, timeline: _Timeline | None) -> None:
        self.blocks = blocks
        self.index = {id(m): i for i, (_, m) in enumerate(blocks)}
        self.param_storages = param_storages
        self.timeline = timeline
        n = len(blocks)
        self.saved: list[dict[StorageWeakRef, int]] = [{} for _ in range(n)]
        self.owner: dict[StorageWeakRef, int] = {}
        self.inputs: list[dict[StorageWeakRef, int]] = [{} for _ in range(n)]
        self.output_bytes = [0] * n
        self.forward_time = [0.0] * n
        self.current: int | None = None
        self.started = 0.0
        self.handles: list[Any] = []

    def install(self) -> None:
        for _, module in self.blocks:
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _mark(self, label: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(label)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = self.index[id(module)]
        self._mark(f"before forward {i}")
        self.current = i
        for t in tensor_leaves((args, kwargs)):
            self.inputs[i][StorageWeakRef(t.untyped_storage())] = _storage_bytes(t)
            if t.requires_grad:
                t.register_hook(lambda g, i=i: self._mark(f"backward {i}"))
        self.started = time.perf_counter()

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = self.index[id(module)]
        self.forward_time[i] += time.perf_counter() - self.started
        self.current = None
        self._mark(f"forward {i}")
        outs = list(tensor_leaves(output))
        self.output_bytes[i] = sum(_storage_bytes(t) for t in outs)
        for t in outs:
            if t.requires_grad:
                t.register_hook(lambda g, i=i: self._mark(f"until backward {i}"))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        i = self.current
        if i is not None:
            key = StorageWeakRef(t.untyped_storage())
            if key not in self.param_storages and key not in self.owner:
                self.owner[key] = i
                self.saved[i][key] = _storage_bytes(t)
        return t


class _MatmulMeter(TorchDispatchMode):
    """Bytes of matmul-like outputs and the time spent in matmul-like ops, per block."""

    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe
        n = len(probe.blocks)
        self.bytes = [0] * n
        self.time = [0.0] * n
        self.outputs: list[dict[StorageWeakRef, int]] = [{} for _ in range(n)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i = self.probe.current
        if i is None or func not in MATMUL_OPS:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.time[i] += time.perf_counter() - start
        for t in tensor_leaves(out):
            self.bytes[i] += _storage_bytes(t)
            self.outputs[i][StorageWeakRef(t.untyped_storage())] = _storage_bytes(t)
        return out


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return sum(t.float().sum() for t in tensor_leaves(output) if t.is_floating_point())


def _resolve(model: nn.Module, modules: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    if modules is None:
        blocks = candidate_modules(model)
        if not blocks:
            raise ValueError(
                "remat.profile: found no repeated blocks (children of a ModuleList/Sequential sharing one "
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
) -> Profile:
    """Profile one training step of ``model`` on ``example_inputs`` (no checkpointing).

    ``loss_fn(output)`` turns the output into a scalar (default: the
    output's ``.loss`` or the sum of its floating tensors).  Gradients are
    left as they were before the call.

    ``device="meta"`` profiles without allocating: build the model and the
    inputs on the meta device (``with torch.device("meta"): model = ...``);
    bytes are exact, times are FLOPs (``torch.utils.flop_counter``) divided by
    ``throughput`` (FLOP/s of the target accelerator).

    Example:
        >>> model = remat.models.GPT()
        >>> tokens, targets = remat.models.synthetic_batch(model.cfg, 8)
        >>> prof = remat.profile(model, tokens, targets, loss_fn=lambda logits: ...)
        >>> print(prof)
    """
    if device not in (None, "meta"):
        raise ValueError(f"remat.profile: device must be None (the model's own) or 'meta', got {device!r}.")
    blocks = _resolve(model, modules)
    if device == "meta":
        return _profile_on_meta(model, example_inputs, loss_fn or _default_loss, blocks, throughput)
    params = list(model.parameters())
    buffers = list(model.buffers())
    param_storages = {StorageWeakRef(t.untyped_storage()) for t in (*params, *buffers)}
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    loss_fn = loss_fn or _default_loss
    try:
        # Pass 1, timing only: no instruments between the ops (after one warm-up step).
        loss_fn(model(*example_inputs)).backward()
        for p in params:
            p.grad = None
        probe = _Probe(blocks, param_storages, None)
        probe.install()
        start = time.perf_counter()
        loss_fn(model(*example_inputs)).backward()
        step_time = time.perf_counter() - start
        probe.remove()
        forward_time = probe.forward_time
        for p in params:
            p.grad = None
        # Pass 2: memory timeline, saved tensors and matmul outputs.
        timeline = _Timeline([*params, *buffers, *tensor_leaves(example_inputs)])
        probe = _Probe(blocks, param_storages, timeline)
        probe.install()
        meter = _MatmulMeter(probe)
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack_identity), timeline, meter:
            loss = loss_fn(model(*example_inputs))
            timeline.mark("loss")
            loss.backward()
        timeline.mark("end")
        probe.remove()
        grad_bytes = sum(_storage_bytes(p.grad) for p in params if p.grad is not None)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    # The instrumented pass slows every op; only the matmul *share* of its time is trusted.
    matmul_share = [m / t if t > 0 else 0.0 for m, t in zip(meter.time, probe.forward_time)]
    rows = _rows(blocks, probe, meter, forward_time, matmul_share, timeline.segments)
    segments = _segments(timeline.segments, len(blocks))
    return Profile(
        rows=rows,
        segments=segments,
        param_bytes=sum(_storage_bytes(p) for p in params),
        buffer_bytes=sum(_storage_bytes(b) for b in buffers),
        grad_bytes=grad_bytes,
        peak_bytes=max(s.peak for s in segments),
        device=str(params[0].device) if params else "cpu",
        step_time=step_time,
    )


def _profile_on_meta(model, example_inputs, loss_fn, blocks, throughput: float) -> Profile:
    from torch.utils.flop_counter import FlopCounterMode

    params = list(model.parameters())
    buffers = list(model.buffers())
    if any(t.device.type != "meta" for t in (*params, *buffers, *tensor_leaves(example_inputs))):
        raise ValueError(
            "remat.profile(device='meta'): put the model and the inputs on the meta device first, e.g. build "
            "the model under `with torch.device('meta'):` and create inputs with device='meta'."
        )
    param_storages = {StorageWeakRef(t.untyped_storage()) for t in (*params, *buffers)}
    timeline = _Timeline([*params, *buffers, *tensor_leaves(example_inputs)])
    probe = _Probe(blocks, param_storages, timeline)
    probe.install()
    meter = _MatmulMeter(probe)
    flops = FlopCounterMode(display=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack_identity), timeline, meter, flops:
            loss = loss_fn(model(*example_inputs))
            timeline.mark("loss")
            loss.backward()
        timeline.mark("end")
    finally:
        probe.remove()
    grad_bytes = sum(_storage_bytes(p.grad) for p in params if p.grad is not None)
    for p in params:
        p.grad = None
    counts = flops.get_flop_counts()
    forward_time = []
    for name, _ in blocks:
        # FlopCounterMode names modules "<RootClass>.<path>"; it counts forward + backward (~1 + 2 parts)
        block_flops = sum(counts.get(f"{type(model).__name__}.{name}", {}).values()) / 3
        forward_time.append(block_flops / throughput)
    matmul_share = [1.0] * len(blocks)  # FLOPs are counted for matmul-like ops only
    rows = _rows(blocks, probe, meter, forward_time, matmul_share, timeline.segments)
    segments = _segments(timeline.segments, len(blocks))
    total = sum(counts.get("Global", {}).values())
    return Profile(
        rows=rows, segments=segments, param_bytes=sum(_storage_bytes(p) for p in params),
        buffer_bytes=sum(_storage_bytes(b) for b in buffers), grad_bytes=grad_bytes,
        peak_bytes=max(s.peak for s in segments), device="meta", step_time=total / throughput,
        estimated_time=True, notes=[f"times estimated from FLOPs at {throughput:.3g} FLOP/s"],
    )


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


def _rows(blocks, probe: _Probe, meter: _MatmulMeter, forward_time: list[float], matmul_share: list[float],
          marks) -> list[ModuleProfile]:
    # What a block's forward allocates beyond what it saves (temporaries, its output): a
    # recomputation in backward needs that much on top of the activations it rebuilds.
    transient = {label: peak - start for label, peak, _, start in marks if label.startswith("forward ")}
    rows = []
    for i, (name, module) in enumerate(blocks):
        act = sum(probe.saved[i].values())
        # A checkpointed block keeps its inputs (unless an earlier block keeps them anyway).
        kept = sum(b for key, b in probe.inputs[i].items() if probe.owner.get(key, i) >= i)
        rows.append(
            ModuleProfile(
                name=name, cls=type(module).__name__, act_bytes=act,
                input_bytes=sum(probe.inputs[i].values()), output_bytes=probe.output_bytes[i],
                forward_time=forward_time[i], matmul_time=min(matmul_share[i], 1.0) * forward_time[i],
                matmul_bytes=meter.bytes[i], kept_if_checkpointed=kept,
                recompute_extra=max(transient.get(f"forward {i}", 0) - act, 0),
                # kept by save_matmuls although autograd does not save them (released once recomputation used them)
                matmul_unsaved_bytes=sum(b for key, b in meter.outputs[i].items() if key not in probe.saved[i]),
            )
        )
    return rows


def _segments(marks: list[tuple[str, int, int, int]], n: int) -> list[Segment]:
    """Turn the marks into segments that know how many blocks precede them.

    Marks with no op between them fired at the same instant (block ``i``'s
    output gradient is block ``i + 1``'s input gradient): they close one
    segment, named after the end of a block's backward when one is among them.
    """
    groups: list[list[tuple[str, int]]] = []
    for label, peak, ops, _ in marks:
        if groups and ops == 0:
            groups[-1].append((label, peak))
        else:
            groups.append([(label, peak)])
    segments = []
    for group in groups:
        labels = [label for label, _ in group]
        label = next((x for x in labels if x.startswith("backward ")), labels[0])
        peak = group[0][1]
        head, _, number = label.rpartition(" ")
        if head == "backward":
            segments.append(Segment(label, peak, prefix=int(number), block=int(number)))
        elif head in ("forward", "before forward"):
            segments.append(Segment(label, peak, prefix=int(number)))
        elif head == "until backward":
            segments.append(Segment(label, peak, prefix=int(number) + 1))
        elif label == "loss":
            segments.append(Segment(label, peak, prefix=n))
        else:  # "end": every block's backward is over
            segments.append(Segment(label, peak, prefix=0))
    return segments
