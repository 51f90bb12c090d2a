"""Deterministic memory measurement of one training step, built on torch's MemTracker.

MemTracker counts the bytes of every tensor storage alive while it runs, on
any device including the CPU, so its figures do not depend on the allocator or
on what else the machine is doing.  It files tensors recomputed in backward
under TEMP rather than ACT, so remat always reports whole figures: the step's
peak ``Total``, and that peak minus parameters and buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .units import Budget, format_bytes

__all__ = ["StepMemory", "budget_on_device", "measure_step", "profiled_peak", "saved_bytes"]


@dataclass(frozen=True)
class StepMemory:
    """Peak memory of one step, in bytes.

    ``peak_total`` is everything MemTracker saw at the step's peak;
    ``peak_above_params`` leaves out parameters, buffers and tensors made before
    the step that it writes (``by_kind["EARLIER"]``: DDP's gradient buckets),
    all fixed through the step (the rest: activations, gradients, temporaries
    and anything else the step allocated).
    """

    peak_total: int
    params: int
    buffers: int
    by_kind: dict[str, int]

    @property
    def peak_above_params(self) -> int:
        # what the step found made and wrote (DDP's gradient buckets) is fixed too, as a plan counts it
        return self.peak_total - self.params - self.buffers - self.by_kind.get("EARLIER", 0)


def measure_step(step: Callable[[], Any], *tracked: torch.nn.Module | torch.optim.Optimizer) -> StepMemory:
    """Run ``step()`` once under MemTracker and return its peak memory.

    Pass the model (and optimizer) so parameters, buffers and gradients are
    attributed; tensors created before the call and not passed are not seen.

    Example:
        >>> model = torch.nn.Linear(64, 64)
        >>> mem = measure_step(lambda: model(torch.randn(8, 64)).sum().backward(), model)
        >>> mem.peak_above_params > 0
        True
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker._mod_tracker = _unhooked_mod_tracker()()
    if tracked:
        tracker.track_external(*tracked)
    with tracker, _WrittenFromBefore(tracker, tracked) as earlier:
        step()
    snapshots = tracker.get_tracker_snapshot("peak")
    # The busiest device decides the peak (one device in every case remat measures).
    device_snapshot = max(snapshots.values(), key=lambda snap: snap["Total"])
    by_kind = {getattr(kind, "name", str(kind)): int(n) for kind, n in device_snapshot.items()}
    if earlier.nbytes:
        by_kind["EARLIER"] = earlier.nbytes
        by_kind["Total"] = max(by_kind["Total"], earlier.peak_before_seen())
    return StepMemory(
        peak_total=by_kind.pop("Total"),
        params=by_kind.get("PARAM", 0),
        buffers=by_kind.get("BUFFER", 0),
        by_kind=by_kind,
    )


class _WrittenFromBefore:
    """Storages made before a step that the step writes without tracking them (DDP's gradient buckets): MemTracker
    counts one from the op that first writes it; it held its bytes from the step's start.

    Entered inside the tracker, its mode sees each op before the tracker does: at an op that writes a storage
    neither made in the step nor tracked, it reads the tracker's peak so far, which lacked that storage and those
    written later.
    """

    def __init__(self, tracker: Any, tracked: tuple) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        self.tracker = tracker
        self.known = WeakIdKeyDictionary()
        for thing in tracked:
            tensors = [*thing.parameters(), *thing.buffers()] if isinstance(thing, torch.nn.Module) else [
                t for state in thing.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
            for t in tensors:
                self.known[t.untyped_storage()] = True
                if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                    self.known[t.grad.untyped_storage()] = True
        self.first_seen: list[tuple[int, int]] = []  # (the tracker's peak before, bytes) per storage, in order
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                written = [kwargs[name] for name in ("out",) if isinstance(kwargs.get(name), torch.Tensor)]
                if func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
                    written.append(args[0])
                for t in written:
                    outer._note(t)
                out = func(*args, **kwargs)
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        outer.known[t.untyped_storage()] = True
                return out

        self.mode = _Mode()

    def _note(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.known or storage.nbytes() == 0:
            return
        self.known[storage] = True
        before = max(snap["Total"] for snap in self.tracker.get_tracker_snapshot("peak").values())
        self.first_seen.append((int(before), storage.nbytes()))

    @property
    def nbytes(self) -> int:
        return sum(nbytes for _, nbytes in self.first_seen)

    def peak_before_seen(self) -> int:
        """The step's peak before the last of these storages was first written, each counted from the start."""
        unseen, peak = self.nbytes, 0
        for before, nbytes in self.first_seen:
            peak = max(peak, before + unseen)
            unseen -= nbytes
        return peak

    def __enter__(self) -> _WrittenFromBefore:
        self.mode.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self.mode.__exit__(*args)


@functools.cache
def _unhooked_mod_tracker() -> type:
    from torch.distributed._tools.mod_tracker import ModTracker

    # Built on first use, as MemTracker is imported: torch.distributed is not imported with remat.
    class _Unhooked(ModTracker):
        """ModTracker's state (``is_bw``, ``parents``) without the module hooks that hold input gradients."""

        def __enter__(self) -> _Unhooked:
            return self

        def __exit__(self, *args: object) -> None:
            return None

    return _Unhooked


def profiled_peak(step: Callable[[], Any]) -> int:
    """Peak CPU bytes allocated by ``step()`` above what was live before it, from the profiler's events.

    MemTracker is a dispatch mode, and code compiled by torch.compile runs its frames eagerly under one, so
    compiled steps are measured here instead: from every allocation and free the profiler records (tensors
    that existed before the call — parameters, inputs — are not counted). On eager code it gives the same
    bytes as ``measure_step(...).peak_above_params`` when gradients start as None.

    Example:
        >>> model = torch.compile(torch.nn.Linear(64, 64))
        >>> profiled_peak(lambda: model(torch.randn(8, 64)).sum().backward()) > 0
        True
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def saved_bytes(step: Callable[[], torch.Tensor], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while ``step()`` runs; then backward.

    Measured by an outer ``saved_tensors_hooks``, which also sees what compiled graphs save, so it compares
    checkpointing under torch.compile with eager. ``step()`` returns the loss.

    Example:
        >>> model = torch.nn.Linear(64, 64)
        >>> saved_bytes(lambda: model(torch.randn(8, 64)).relu().sum(), model.parameters()) > 0
        True
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def budget_on_device(budget: Budget, device: str, resident: int) -> Budget:
    """A ``"free"`` budget (:func:`~remat.planning.basics.units.parse_budget`) as the whole-step bytes the CUDA
    ``device`` can give a step now; any other budget as it is.

    What the step may hold: the device's free memory (``torch.cuda.mem_get_info``), what PyTorch's allocator
    keeps reserved but unused (it serves the step first), and ``resident``, the bytes of the model's parameters
    and buffers already on the device (a plan's peak counts them), less the budget's margin.  The result's text
    says so, for the plan to state.

    Example:
        >>> budget_on_device(parse_budget("free-4GiB"), "cuda:0", resident=2 << 30).nbytes   # on a 80 GB GPU
        77846282240
    """
    if not budget.free:
        return budget
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(f"remat.plan: budget {budget.text!r} is what a CUDA device has free, and this profile ran "
                         f"on {device}: give a size (8GiB) or a fraction of the unplanned peak (50%).")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    free, total = torch.cuda.mem_get_info(index)
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    margin = budget.margin_bytes if budget.margin_bytes is not None else int(budget.margin_fraction * total)
    nbytes = free + cached + resident - margin
    if nbytes <= resident:
        raise ValueError(f"remat.plan: budget {budget.text!r}: {device} has {format_bytes(free + cached)} free, "
                         f"no more than the {format_bytes(margin)} margin; free memory on it or lower the margin "
                         f"({budget.text.split('-')[0]}-1GiB).")
    text = (f"{budget.text}: {format_bytes(free + cached)} free on {device} with {format_bytes(resident)} of "
            f"parameters and buffers, less a {format_bytes(margin)} margin")
    return Budget(nbytes=nbytes, text=text)
