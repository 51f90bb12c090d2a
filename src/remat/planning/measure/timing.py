"""Time on the device: one clock for every measurement, read once at its end.

On an accelerator the host only *enqueues* kernels and runs ahead, so a host clock around an op measures
its launch, not its kernel.  A :class:`Clock` for an accelerator records events on the current stream
(``mark``) and reads them all after one synchronize (``read``), so a measurement of a thousand ops costs
one synchronize, not one per op.  On the CPU the device is the host and the same code runs: a mark is a
reading of the CPU's clock — this thread's CPU time when torch computes on one thread (so other processes
on a shared machine do not count), else ``time.perf_counter()``.

Host time is measured apart (``Clock.host_now``: ``time.perf_counter()`` beside an accelerator, the CPU's
clock on the CPU): what the Python machinery (a policy's dispatch, autograd, the dispatcher) costs the
host.  Whether the device waits for it depends on the clock:

* on the CPU (``asynchronous`` False) host work and kernels run one after the other: an op costs
  ``host + device``;
* on an accelerator (``asynchronous`` True) the host runs ahead while kernels execute: an op costs
  ``max(host, device)`` — the device waits only for host work longer than the kernel before it.

The per-op ``max`` is additive over ops (so the op-level fronts stay exact knapsacks) and is the
pipeline's finishing time up to one op: a host that ran ahead over many short kernels is not credited
with its slack, which errs on the side of predicting a little more time.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Clock", "OpTimes", "device_of", "op_cost", "pooled", "spread", "time_ops"]


def device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The accelerator the tensors live on (the first one found, with its index), else the CPU.

    Example:
        >>> device_of([torch.ones(1)])
        device(type='cpu')
    """
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    return torch.device("cpu")


def op_cost(host: float, device: float, asynchronous: bool) -> float:
    """Seconds one op adds to a run: ``max`` where the device runs behind the host, else the sum.

    Example:
        >>> op_cost(2e-6, 5e-6, asynchronous=True), op_cost(2e-6, 5e-6, asynchronous=False)
        (5e-06, 7e-06)
    """
    return max(host, device) if asynchronous else host + device


def _cpu_clock() -> Callable[[], float]:
    """The CPU's clock: this thread's CPU time when torch computes on this thread alone, else the wall clock.

    With one intra-op thread every kernel, backward's included, runs on the calling thread, so its CPU time
    is the device's time spent on the work — and, unlike the wall clock, it does not count the time the
    operating system gives the core to other processes.  With several threads a kernel's work is spread
    over them and only the wall clock measures it.
    """
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _events(device: torch.device) -> tuple[Callable[[], Any], Callable[[], None]] | None:
    """(new timing event, synchronize) for an accelerator, or None where it has no events."""
    module = getattr(torch, device.type, None)
    synchronize = getattr(module, "synchronize", None)
    if synchronize is None:
        return None
    event = getattr(module, "Event", None)
    if event is None:
        generic = getattr(torch, "Event", None)  # torch >= 2.5: one event class for every accelerator
        if generic is None:
            return None
        event = functools.partial(generic, device=device.type)
    return (lambda: event(enable_timing=True)), (lambda: synchronize(device))


class Clock:
    """Marks on one device's timeline, read together after one synchronize.

    ``mark()`` records a point (an event on the current stream, or the host time on the CPU) and returns
    its number; ``read()`` waits for the device once and returns the seconds from the first mark to every
    mark, then starts afresh.  Tests inject fake events with ``Clock(device, events=(factory, sync))``.

    Example:
        >>> clock = Clock("cpu")
        >>> start = clock.mark(); y = x @ x; end = clock.mark()
        >>> times = clock.read(); seconds = times[end] - times[start]
    """

    def __init__(self, device: str | torch.device = "cpu",
                 events: tuple[Callable[[], Any], Callable[[], None]] | None = None) -> None:
        self.device = torch.device(device)
        if events is None and self.device.type not in ("cpu", "meta"):
            events = _events(self.device)
            if events is None:  # an accelerator without events: synchronize at every mark instead
                synchronize = getattr(torch, self.device.type).synchronize
                events = (lambda: _SynchronizedMark(lambda: synchronize(self.device))), (lambda: None)
        self._new_event, self._synchronize = events if events is not None else (None, None)
        self.asynchronous = self._new_event is not None
        self.host_now = _cpu_clock() if self._new_event is None else time.perf_counter
        current_stream = getattr(getattr(torch, self.device.type, None), "current_stream", None)
        # On the current stream of the model's own device (not the process's current device), when named.
        self._stream = (lambda: current_stream(self.device)) if current_stream and self.device.index is not None \
            else None
        self._marks: list[Any] = []

    def mark(self) -> int:
        """Record a point on the device's timeline; returns its number for :meth:`read`."""
        if self._new_event is None:
            self._marks.append(self.host_now())
        else:
            event = self._new_event()
            event.record() if self._stream is None else event.record(self._stream())
            self._marks.append(event)
        return len(self._marks) - 1

    def read(self) -> list[float]:
        """Seconds from the first mark to each mark (one synchronize); the clock then starts afresh."""
        marks, self._marks = self._marks, []
        if not marks:
            return []
        if self._new_event is None:
            return [m - marks[0] for m in marks]
        self._synchronize()
        first = marks[0]
        return [first.elapsed_time(m) / 1e3 for m in marks]  # events count milliseconds

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """Run ``fn()`` once: its result, device seconds and host seconds (one synchronize).

        Example:
            >>> _, device_s, host_s = Clock("cpu").time(lambda: model(x))
        """
        start = self.mark()
        host = self.host_now()
        result = fn()
        host = self.host_now() - host
        end = self.mark()
        marks = self.read()
        return result, marks[end] - marks[start], host


class _SynchronizedMark:
    """An event stand-in for accelerators without timing events: the host time after a synchronize."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self.at = 0.0

    def record(self, stream: Any = None) -> None:
        self._synchronize()
        self.at = time.perf_counter()

    def elapsed_time(self, other: _SynchronizedMark) -> float:
        return (other.at - self.at) * 1e3


class _Stopwatch(TorchDispatchMode):
    """Per op: clock marks around the call (device time) and the host time since the previous op returned."""

    def __init__(self, clock: Clock, n: int) -> None:
        super().__init__()
        self.clock = clock
        self.n = n
        self.marks: list[tuple[int, int]] = []
        self.host: list[float] = []
        self.count = 0
        self.last = clock.host_now()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        clock = self.clock
        start = clock.mark()
        out = func(*args, **(kwargs or {}))
        end = clock.mark()
        now = clock.host_now()
        if self.count < self.n:
            self.marks.append((start, end))
            self.host.append(now - self.last)
        self.count += 1
        self.last = now
        return out

    def read(self) -> tuple[list[float], list[float]]:
        """(device seconds, host seconds) per op; on the CPU the host's share leaves the kernel out."""
        times = self.clock.read()
        device = [times[end] - times[start] for start, end in self.marks]
        if self.clock.asynchronous:
            return device, self.host
        return device, [h - d for h, d in zip(self.host, device)]


@dataclass
class OpTimes:
    """Per-op device and host seconds of one forward, scaled to its unwatched run, and a policy's host cost.

    ``forward`` is the device seconds of the unwatched forward; ``policy_forward`` / ``policy_replay`` the
    host seconds per op a selective policy's forward / replay mode adds; ``asynchronous``: the clock's;
    ``spread``: how much the unwatched forward varied between rounds (interquartile range over median).
    """

    device: list[float]
    host: list[float]
    forward: float
    policy_forward: float
    policy_replay: float
    asynchronous: bool
    spread: float = 0.0

    @property
    def wall(self) -> list[float]:
        """What each op adds to a run (:func:`op_cost` of its host and device time)."""
        return [op_cost(h, d, self.asynchronous) for h, d in zip(self.host, self.device)]


def time_ops(run: Callable[[], Any], n: int, clock: Clock, repeats: int,
             policy_modes: Callable[[], tuple[Any, Any]], name: str = "the block",
             prepare: Callable[[], None] | None = None) -> OpTimes:
    """Time each of the ``n`` ops ``run()`` dispatches, on ``clock``; medians of ``repeats`` rounds.

    Each round (the first warms up) runs ``run()`` unwatched, under the stopwatch, and unwatched under a
    policy's forward mode, then its replay mode (``policy_modes()`` returns a fresh pair; a policy that
    keeps nothing runs every op in both).  The policy's cost per op is how much longer the whole run takes
    under each mode than without one (host time: the CPU's clock on the CPU), the median over rounds of
    that difference within a round, per op.  Whole runs, because running under any Python dispatch mode
    costs more than the mode's own Python: composite ops take their out-of-place paths there (SDPA's math
    path adds its mask out of place, a fresh 8 MiB on the demo GPT's block), which a stopwatch, itself a
    dispatch mode, sees in every run alike (measured so, the demo GPT block's recording mode cost 18 µs per
    op against 40-70 µs in whole runs).  The stopwatch slows what it watches (its own Python work between
    ops): on the CPU device and host times are scaled so they add up to the unwatched run; on an
    accelerator host times are scaled to the unwatched run's host time, and kernels, timed by events, lose
    the launch gap the stopwatch opens before each (:func:`_without_launch_gap`).  ``prepare()``, if given,
    runs before every run of ``run()``, off the clock (fresh inputs for a block that writes to its own).

    Example:
        >>> times = time_ops(lambda: block(x), n, Clock("cpu"), 5, lambda: (nullcontext(), nullcontext()))
    """
    plain_device: list[float] = []
    plain_host: list[float] = []
    device_rows: list[list[float]] = []
    host_rows: list[list[float]] = []
    under_policy: dict[str, list[float]] = {"recorder": [], "replayer": []}  # host seconds of unwatched runs

    def fresh() -> None:
        if prepare is not None:
            prepare()

    def watched(keep: bool) -> None:
        fresh()
        watch = _Stopwatch(clock, n)
        with watch:
            watch.last = clock.host_now()
            run()
        if watch.count != n:
            raise RuntimeError(
                f"remat.profile_ops: `{name}` ran {watch.count} ops when timed but {n} when profiled; its "
                "forward must run the same ops on the same inputs (data-dependent control flow is not supported)."
            )
        device, host = watch.read()
        if keep:
            device_rows.append(device)
            host_rows.append(host)

    for round_index in range(repeats + 1):
        keep = round_index > 0
        fresh()
        _, device, host = clock.time(run)
        if keep:
            plain_device.append(device)
            plain_host.append(host)
        watched(keep)
        recorder, replayer = policy_modes()
        for label, mode in (("recorder", recorder), ("replayer", replayer)):  # the replay follows its recording
            fresh()
            with mode:
                _, _, host = clock.time(run)
            if keep:
                under_policy[label].append(host)
    # Each op's *share* of its run, median over runs: a machine that slows down between runs (other
    # processes, clock speed) moves every op of a run alike, so shares hold where absolute times drift.
    device = _median_shares(device_rows)
    host = _median_shares(host_rows)
    device_total = statistics.median(sum(row) for row in device_rows)
    host_total = statistics.median(sum(row) for row in host_rows)
    forward = statistics.median(plain_device)
    if clock.asynchronous:
        device = _without_launch_gap([d * device_total for d in device], forward)
        device_scale = 1.0
        host_scale = statistics.median(plain_host)
    else:
        watched_total = device_total + host_total
        fraction = forward / watched_total if watched_total > 0 else 0.0
        device_scale, host_scale = device_total * fraction, host_total * fraction

    def per_op(label: str) -> float:
        if n == 0:  # a block that dispatches no op (nn.Identity): no op to pay for
            return 0.0
        growth = statistics.median(mode - plain for mode, plain in zip(under_policy[label], plain_host))
        return max(growth, 0.0) / n

    return OpTimes([d * device_scale for d in device], [h * host_scale for h in host], forward,
                   per_op("recorder"), per_op("replayer"), clock.asynchronous, spread(plain_device))


def spread(samples: list[float]) -> float:
    """Interquartile range over median of ``samples``: 0 for fewer than two, or a zero median.

    Example:
        >>> round(spread([1.0, 1.0, 1.1, 1.2]), 3)
        0.119
    """
    if len(samples) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


def _without_launch_gap(device: list[float], unwatched: float) -> list[float]:
    """Per-op event times less the gap the stopwatch opens before each kernel, so they add up to ``unwatched``.

    Watched, the host spends tens of microseconds in Python between ops, so the device drains its queue and
    each op's start event fires before its kernel is even launched: every op's time gains about the same
    launch latency, a gap the unwatched run (the host ahead of the device) does not have.  The gap ``g`` is
    the one constant for which ``sum(max(d - g, 0))`` equals the unwatched run's device time (found by
    bisection); where the watched times add up to no more than that, they are left as they are.

    Example:
        >>> [round(t * 1e6, 3) for t in _without_launch_gap([3e-5, 1e-3], 1.02e-3)]  # a 5 us gap per op
        [25.0, 995.0]
    """
    if sum(device) <= unwatched or not device:
        return device
    low, high = 0.0, max(device)
    for _ in range(60):
        gap = (low + high) / 2
        if sum(max(d - gap, 0.0) for d in device) > unwatched:
            low = gap
        else:
            high = gap
    return [max(d - high, 0.0) for d in device]


def _median_shares(rows: list[list[float]]) -> list[float]:
    """Per column, the median over rows of its share of the row's sum (normalized to add up to 1)."""
    shares = [[x / total for x in row] for row in rows if (total := sum(row)) > 0]
    if not shares:
        return [0.0] * (len(rows[0]) if rows else 0)
    medians = [statistics.median(column) for column in zip(*shares)]
    total = sum(medians)
    return [m / total for m in medians] if total > 0 else medians


def pooled(times: OpTimes, work: list[Hashable]) -> OpTimes:
    """``times`` with the ops that do the same work (equal keys in ``work``) sharing their mean times.

    Two calls of one op on tensors of one shape cost the same: measured apart they differ by noise, and a
    plan choosing between them would follow it.

    Example:
        >>> pooled(times, [(op, shapes) for op, shapes in calls])
    """
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(work):
        groups.setdefault(key, []).append(i)
    device, host = list(times.device), list(times.host)
    for members in groups.values():
        if len(members) > 1:
            for column in (device, host):
                mean = sum(column[i] for i in members) / len(members)
                for i in members:
                    column[i] = mean
    return replace(times, device=device, host=host)
