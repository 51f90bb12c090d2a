"""The memory timeline of one training step: live bytes per segment, and who holds each storage.

A dispatch mode counts every storage as ops allocate it and weak references see it die; hooks on the
candidate blocks mark the segments (each block's forward and backward, the stretches between), record the
blocks' inputs and outputs, and a saved-tensor hook records which block saves what for backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ...engine.replay import tensor_leaves
from ...policies.rules import MATMUL_OPS, is_collective
from ..basics.ranks import gathers_parameters, local, settle_collective, storage_resizes
from .opgraph import _op_info

__all__ = ["PARTS", "Segment", "live_bytes_timeline"]

# What a rank's live bytes are made of, in the user's terms: "states", its parameters, gradients and buffers (its
# shards of them where sharded; DDP's gradient buckets; no optimizer state, which a step's peak leaves out);
# "gathered", the parameters FSDP2 gathers and frees again; "head", what the code after the last block makes
# (the output layer's logits, the loss, their gradients) that no block holds; "activations", the rest: what the
# blocks keep, their recomputations and backward's working tensors.
PARTS = ("states", "gathered", "activations", "head")


@dataclass
class Segment:
    """The peak of live bytes in one stretch of the step.

    ``prefix`` blocks come before it (their decisions change it); ``block`` is set for a block's own
    backward (its recomputation raises it); ``start`` is the live bytes when the stretch began;
    ``backward`` says whether the stretch comes after the model's forward.  ``parts`` / ``start_parts``: what the
    live bytes at the peak / at the start are made of (:data:`PARTS`; they sum to ``peak`` / ``start``), empty where
    not measured.
    """

    label: str
    peak: int
    prefix: int
    block: int | None = None
    start: int = 0
    backward: bool = False
    parts: dict[str, int] = field(default_factory=dict)
    start_parts: dict[str, int] = field(default_factory=dict)


class _Storage:
    """What the profile learns about one storage: size, life in raw segments, who saves and takes it."""

    __slots__ = ("nbytes", "birth", "death", "savers", "inputs", "existing", "counted", "born_event", "died_event",
                 "part")

    def __init__(self, nbytes: int, birth: int, existing: bool, counted: bool, event: int) -> None:
        self.nbytes, self.birth, self.death, self.existing, self.counted = nbytes, birth, None, existing, counted
        self.born_event, self.died_event = event, None  # when it came and went among all allocations and frees
        self.savers: set[int | None] = set()  # block indices; None for code outside the blocks
        self.inputs: set[int] = set()
        self.part = ""  # one of PARTS where known when it is made; "" to be told from its life (see parts_at)


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
        self.refilled: set[_Storage] = set()  # storages a wrapper fills in place (FSDP2's gathered parameters)
        self.events = 0  # allocations and frees so far
        self.peak_events: list[int] = []  # per segment: the last event at which its peak was reached
        self.start_events: list[int] = []  # per segment: the event count when it started
        for t in existing:
            self.track(t, existing=True)
        for t in uncounted:
            self.track(t, existing=True, counted=False)
        self.segment_peak = self.segment_start = self.live
        self.segment_peak_event = self.segment_start_event = self.events

    def track(self, t: torch.Tensor, existing: bool = False, counted: bool = True) -> _Storage:
        """The record of ``t``'s storage, created (and counted live) on first sight."""
        storage = local(t).untyped_storage()  # a sharded tensor: the shard this rank holds
        found = self.storages.get(storage)
        if found is not None:
            return found
        self.events += 1
        record = _Storage(storage.nbytes(), len(self.segments), existing, counted, self.events)
        self.storages[storage] = record
        self.records.append(record)
        if counted:
            self._add(record)
        # A storage's Python object lives as long as the storage: its death frees the bytes.
        weakref.finalize(storage, self._free, record)
        return record

    def _add(self, record: _Storage) -> None:
        self.live += record.nbytes
        if self.live >= self.segment_peak:  # at a tie, the later moment: a storage alive then was at both
            self.segment_peak, self.segment_peak_event = self.live, self.events

    def _returned(self, t: torch.Tensor) -> _Storage:
        """The record of a storage an op returned.  An uncounted one (an example input) is counted from here on:
        MemTracker counts every storage an op returns, one made before the step included, so a view of an input
        (tensor parallel's ``DTensor.from_local`` of the token ids) brings the input's bytes into the step's."""
        record = self.track(t)
        if not record.counted:
            self.events += 1
            record.counted, record.birth, record.born_event = True, len(self.segments), self.events
            self._add(record)
        return record

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size in place (FSDP2's gathered parameters): the old bytes die, the new are born."""
        record = self.storages.get(storage)
        if record is not None and record.nbytes == storage.nbytes():
            return
        if record is not None:
            self._free(record)
            del self.storages[storage]
        if storage.nbytes():
            refilled = self.track(torch.empty(0, device=storage.device).set_(storage))
            refilled.part = "gathered"
            self.refilled.add(refilled)

    def _free(self, record: _Storage) -> None:
        if record.death is not None:  # freed by a resize already: the storage's own death frees nothing more
            return
        self.events += 1
        self.live -= record.nbytes if record.counted else 0
        record.death, record.died_event = len(self.segments), self.events

    def mark(self, label: str) -> None:
        """Close the current segment under ``label`` and start the next one."""
        self.segments.append((label, self.segment_peak, self.ops, self.segment_start))
        self.peak_events.append(self.segment_peak_event)
        self.start_events.append(self.segment_start_event)
        self.segment_peak = self.segment_start = self.live
        self.segment_peak_event = self.segment_start_event = self.events
        self.ops = 0

    def alive_at_peak(self, record: _Storage, segment: int) -> bool:
        """Whether ``record``'s storage was alive when raw segment ``segment`` reached its peak.

        Example:
            >>> timeline.alive_at_peak(record, 3)
        """
        moment = self.peak_events[segment]
        return _alive_at(record, moment)

    def parts_at(self, moments: Sequence[int]) -> list[dict[str, int]]:
        """What the live bytes were made of after each event of ``moments`` (:data:`PARTS`, summing to them).

        A storage made after the last block's forward, in the loss's stretch or before the first block's backward,
        that no block saves or takes is the head's; any other not known when made is an activation.

        Example:
            >>> timeline.parts_at([timeline.peak_events[3]])
            [{'states': 4096, 'gathered': 0, 'activations': 1024, 'head': 0}]
        """
        head = {k for k, (label, *_) in enumerate(self.segments) if label in ("loss", "after loss")}
        changes = []  # (event, bytes, part): every counted storage's birth and death, swept once in event order
        for record in self.records:
            if not record.counted:
                continue
            part = record.part or ("head" if record.birth in head and not record.inputs
                                   and not record.savers - {None} else "activations")
            changes.append((record.born_event, record.nbytes, part))
            if record.died_event is not None:
                changes.append((record.died_event, -record.nbytes, part))
        changes.sort(key=lambda change: change[0])
        live, found, k = dict.fromkeys(PARTS, 0), {}, 0
        for moment in sorted(set(moments)):
            while k < len(changes) and changes[k][0] <= moment:  # alive: born at or before it, not dead by then
                live[changes[k][2]] += changes[k][1]
                k += 1
            found[moment] = dict(live)
        return [found[moment] for moment in moments]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = settle_collective(func, func(*args, **(kwargs or {})))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                record = self._returned(t)
                record.part = "gathered" if gathers_parameters(func) else record.part
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
        self.forward_mark = [0] * n  # the raw segment each block's forward runs in
        self.last_save_peak = [0] * n  # the forward's peak when it saved its last tensor (where early stop ends)
        self.last_save_event = [0] * n  # and the timeline's event count then: storages born later are not rerun
        self.outputs: list[set[_Storage]] = [set() for _ in range(n)]
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
        self.forward_mark[i] = len(self.timeline.segments)
        self.forward_start[i] = self.last_save_peak[i] = self.timeline.live
        seen = set()
        for t in tensor_leaves((args, kwargs)):
            record = self.timeline.track(t)
            record.inputs.add(i)
            if id(record) not in seen:
                seen.add(id(record))
                self.input_bytes[i] += record.nbytes

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        i = self.index[id(module)]
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
                self.last_save_event[self.current] = self.timeline.events
        return t


class _MatmulMeter(TorchDispatchMode):
    """Per block: the outputs ``save_matmuls`` keeps (matmul-like ops' and collectives'), which of them a later op
    writes in place, and whether one is written after the block's forward.

    ``save_matmuls`` keeps those outputs; one modified after forward would make its recomputation fail
    (the kept value is no longer what the gradients need), so that block cannot take the option.
    """

    def __init__(self, probe: _Probe) -> None:
        super().__init__()
        self.probe = probe
        n = len(probe.blocks)
        self.outputs: list[set[_Storage]] = [set() for _ in range(n)]
        self.mutated_later = [False] * n
        self.overwritten: set[_Storage] = set()  # matmul outputs a later op writes in place: save_matmuls drops them
        self._owner: dict[_Storage, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = self.probe.current
        written = _op_info(func)[2]
        if written and self._owner:
            storages = self.probe.timeline.storages
            for position, name in written:
                target = args[position] if position < len(args) else kwargs.get(name)
                for t in tensor_leaves(target):
                    record = storages.get(t.untyped_storage())
                    owner = self._owner.get(record)
                    if owner is not None:
                        self.overwritten.add(record)
                        self.mutated_later[owner] |= owner != i
        if i is not None and (func in MATMUL_OPS or is_collective(func)):  # what save_matmuls keeps
            for t in tensor_leaves(out):
                record = self.probe.timeline.track(t)
                self.outputs[i].add(record)
                self._owner[record] = i
        return out


def _trace(model: nn.Module, forward: Callable[[], Any], loss_fn: Callable[[Any], torch.Tensor],
           inputs: list[torch.Tensor], blocks: list[tuple[str, nn.Module]], *modes: Any, hold_output: bool = True
           ) -> tuple[_Timeline, _Probe, _MatmulMeter, int]:
    """One instrumented step: the memory timeline, who saves and takes which storage, matmul outputs.

    ``forward()`` returns the model's output and ``loss_fn`` its loss; ``hold_output``: the output stays alive
    until backward ends, as in ``out = model(x); loss = out.loss; loss.backward()`` (else it dies once the loss
    is computed).  Nothing is timed here: the dispatch modes slow every op (times come from the op graphs).
    """
    params = list(model.parameters())
    # The example inputs exist before the step and are not counted, as MemTracker does not see them (until an op
    # returns a view of one).
    timeline = _Timeline([*params, *model.buffers()], uncounted=inputs)
    for t in (*params, *model.buffers()):
        timeline.track(t).part = "states"
    probe = _Probe(blocks, timeline)
    meter = _MatmulMeter(probe)
    probe.install()
    try:
        with ExitStack() as contexts:
            for context in (torch.autograd.graph.saved_tensors_hooks(probe.pack, _unpack_identity), timeline, meter,
                            storage_resizes(timeline.resized), *modes):
                contexts.enter_context(context)
            output = forward()
            loss = loss_fn(output)
            if hold_output:
                for t in tensor_leaves(output):
                    # the training loop holds it through backward whatever the plan: as code outside the blocks
                    timeline.track(t).savers.add(None)
            else:
                output = None
            timeline.mark("loss")
            probe.in_forward = False
            loss.backward()
            del loss, output
        probe.close_backward()
    finally:
        probe.remove()
    # each storage once: FSDP2's gradient shards of one unit are views of one reduce-scatter output
    grad_storages = {id(s): s for s in (local(p.grad).untyped_storage() for p in params if p.grad is not None)}
    for storage in grad_storages.values():
        if storage in timeline.storages:  # a gradient shard: a state from the moment it is made
            timeline.storages[storage].part = "states"
    grad_bytes = sum(s.nbytes() for s in grad_storages.values())
    return timeline, probe, meter, grad_bytes


def live_bytes_timeline(step: Callable[[], Any], *existing: torch.Tensor) -> list[int]:
    """Live storage bytes after every operator of ``step()``; pass the tensors that exist before it.

    Example:
        >>> series = live_bytes_timeline(lambda: model(x).sum().backward(), *model.parameters(), x)
    """
    timeline = _Timeline(existing, record=True)
    with timeline:
        step()
    return timeline.series


def _alive_at(record: _Storage, moment: int) -> bool:
    return record.born_event <= moment and (record.died_event is None or record.died_event > moment)


def _unpack_identity(t: torch.Tensor) -> torch.Tensor:
    return t


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
