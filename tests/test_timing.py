"""Device time on a fake accelerator: events read after one synchronize, host time apart, combined right.

A scripted device (``FakeDevice``) has its own timeline: a custom op advances it by the seconds it is told
(a "kernel"), and fake events record it and may be read only after a synchronize.  Host work takes real
microseconds and the kernels none, so a measurement that took device time from the host clock, or read
an event before synchronizing, fails.
"""

import contextlib
import dataclasses
import time

import pytest
import torch
from torch import nn

from remat.planning.measure import opgraph, timing
from remat.planning.measure.opgraph import profile_ops
from remat.planning.measure.overheads import Overheads
from remat.planning.measure.prices import BlockPrices
from remat.planning.measure.timing import Clock, _cpu_clock, op_cost, time_ops
from remat.tools.bench import interleaved_rounds


class FakeDevice:
    """A device timeline that only the scripted kernels advance; ``synchronize`` counts its calls."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.syncs += 1


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None
        self.epoch = -1

    def record(self) -> None:
        self.at, self.epoch = self.device.now, self.device.syncs

    def elapsed_time(self, other: "FakeEvent") -> float:
        for event in (self, other):
            assert event.at is not None and self.device.syncs > event.epoch, "event read before a synchronize"
        return (other.at - self.at) * 1e3


DEVICE = FakeDevice()


@torch.library.custom_op("remat_test::fake_kernel", mutates_args=())
def fake_kernel(x: torch.Tensor, seconds: float) -> torch.Tensor:
    DEVICE.now += seconds
    return x.clone()


class Scripted(nn.Module):
    """Three kernels of 5, 1 and 2 ms on the fake device, and a view (no kernel)."""

    SECONDS = (5e-3, 1e-3, 2e-3)

    def forward(self, x):
        for seconds in self.SECONDS:
            x = fake_kernel(x, seconds)
        return x.view(-1)


@pytest.fixture
def device(monkeypatch):
    fake = FakeDevice()
    monkeypatch.setitem(globals(), "DEVICE", fake)
    monkeypatch.setattr(timing, "_events", lambda device_type: (fake.event, fake.synchronize))
    return fake


def test_clock_reads_events_once_after_one_synchronize(device):
    clock = Clock("cuda")
    assert clock.asynchronous and clock.host_now is time.perf_counter
    marks = [clock.mark()]
    for seconds in (3e-3, 4e-3):
        fake_kernel(torch.ones(2), seconds)
        marks.append(clock.mark())
    assert clock.read() == pytest.approx([0.0, 3e-3, 7e-3], abs=1e-12)
    assert device.syncs == 1


def test_time_ops_takes_kernels_from_the_device_and_host_work_apart(device):
    x = torch.ones(4)
    block = Scripted()
    n = 4  # three kernels and the view
    repeats = 3
    times = time_ops(lambda: block(x), n, Clock("cuda"), repeats, lambda: (contextlib.nullcontext(),) * 2)
    assert times.asynchronous
    assert times.device == pytest.approx([*Scripted.SECONDS, 0.0], abs=1e-12)
    assert times.forward == pytest.approx(sum(Scripted.SECONDS), abs=1e-12)
    # Host work is real and small: microseconds, whatever the kernels take on the device.
    assert all(0 <= h < 1e-3 for h in times.host)
    # One synchronize per measured run (the plain run and three watched ones per round), not one per op.
    assert device.syncs == 4 * (repeats + 1)
    # The host ran ahead: each op costs the larger of the two.
    assert times.wall == [max(h, d) for h, d in zip(times.host, times.device)]


def test_launch_gaps_the_stopwatch_opens_are_taken_out_of_kernel_times(device, monkeypatch):
    # Each recorded event leaves the device idle for `gap` (the host's Python work before the next launch):
    # watched, every op's events bracket its kernel and one gap; the unwatched run has one gap in all.
    gap = 1e-4
    record = FakeEvent.record

    def record_then_idle(event):
        record(event)
        device.now += gap

    monkeypatch.setattr(FakeEvent, "record", record_then_idle)
    block, n, x = Scripted(), 4, torch.ones(4)
    times = time_ops(lambda: block(x), n, Clock("cuda"), 2, lambda: (contextlib.nullcontext(),) * 2)
    assert times.forward == pytest.approx(sum(Scripted.SECONDS) + gap, abs=1e-12)
    assert sum(times.device) == pytest.approx(times.forward, rel=1e-9)
    # Three quarters of each op's gap comes out (the unwatched run's one gap is shared among the four ops).
    assert times.device == pytest.approx([s + gap / 4 for s in (*Scripted.SECONDS, 0.0)], abs=1e-9)


SLOWED: list[float] = []  # seconds every mode_slowed kernel takes longer, while a stand-in policy mode is on


@torch.library.custom_op("remat_test::mode_slowed_kernel", mutates_args=())
def mode_slowed_kernel(x: torch.Tensor, seconds: float) -> torch.Tensor:
    DEVICE.now += seconds + sum(SLOWED)
    return x.clone()


class Slowing:
    """Stands in for a policy's recording or replay mode: kernels run 1 ms longer under it (under a Python
    dispatch mode composite ops take their out-of-place paths, which the mode's own Python does not show)."""

    def __enter__(self) -> None:
        SLOWED.append(1e-3)

    def __exit__(self, *exc) -> None:
        SLOWED.pop()


def test_a_policy_costs_per_op_what_its_modes_add_to_whole_runs(device, monkeypatch):
    # The CPU's clock, faked: only kernels take time, so the stopwatch's and the modes' Python cost nothing.
    monkeypatch.setattr(timing, "_cpu_clock", lambda: lambda: device.now)

    class Block(nn.Module):
        def forward(self, x):
            for seconds in Scripted.SECONDS:
                x = mode_slowed_kernel(x, seconds)
            return x.view(-1)

    n, x = 4, torch.ones(4)
    times = time_ops(lambda: Block()(x), n, Clock("cpu"), 2, lambda: (Slowing(), Slowing()))
    assert not times.asynchronous and not SLOWED
    assert times.forward == pytest.approx(sum(Scripted.SECONDS), abs=1e-12)
    assert sum(times.wall) == pytest.approx(times.forward, rel=1e-9)
    # Three kernels 1 ms slower under each mode: 3 ms per run, over its 4 ops.
    assert times.policy_forward == pytest.approx(3e-3 / n, abs=1e-12)
    assert times.policy_replay == pytest.approx(3e-3 / n, abs=1e-12)


def test_profile_ops_times_a_block_on_the_accelerator_clock(device, monkeypatch):
    monkeypatch.setattr(opgraph, "device_of", lambda tensors: "cuda")
    fixed = Overheads(region=0.0, per_saved=0.0, policy_forward=0.0, policy_replay=0.0, copy_per_byte=0.0)
    graph = profile_ops(nn.Sequential(Scripted()), torch.ones(4), modules=["0"], repeats=2,
                        overheads=fixed).blocks["0"]
    kernels = [n for n in graph.nodes if n.op == "remat_test.fake_kernel.default"]
    assert graph.asynchronous and [n.kernel_time for n in kernels] == pytest.approx(Scripted.SECONDS, abs=1e-12)
    assert graph.forward_time == pytest.approx(sum(Scripted.SECONDS), abs=1e-12)
    assert all(n.wall_time == max(n.host_time, n.kernel_time) for n in graph.nodes)


def test_interleaved_rounds_time_steps_on_the_device(device):
    steps = {"long": lambda: fake_kernel(torch.ones(2), 4e-3), "short": lambda: fake_kernel(torch.ones(2), 1e-3)}
    rounds = interleaved_rounds(steps, rounds=3, warmup=1, device="cuda")
    assert rounds == [pytest.approx({"long": 4e-3, "short": 1e-3}, abs=1e-12)] * 3
    assert device.syncs == 4  # one per round


def _timed_graph(asynchronous: bool, host: float, kernel: float):
    """The op graph of a small MLP block with every op's host and kernel time set."""
    block = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    overheads = Overheads(region=1e-5, per_saved=1e-6, policy_forward=2e-5, policy_replay=3e-5, copy_per_byte=0.0)
    graph = profile_ops(nn.Sequential(block), torch.randn(4, 8, requires_grad=True), modules=["0"],
                        timing="estimate", overheads=overheads).blocks["0"]
    graph.nodes = [dataclasses.replace(n, host_time=host, kernel_time=kernel if n.kind == "compute" else 0.0,
                                       wall_time=op_cost(host, kernel if n.kind == "compute" else 0.0, asynchronous))
                   for n in graph.nodes]
    graph.asynchronous = asynchronous
    return graph


def test_on_an_accelerator_a_rerun_costs_its_kernels_where_the_host_keeps_ahead():
    host, kernel = 5e-6, 1e-3  # long kernels: the host's work (views, machinery, policy) hides behind them
    graph = _timed_graph(True, host, kernel)
    stop = graph.stop
    prices = BlockPrices(graph)
    kernels = sum(n.kernel_time for n in graph.nodes[:stop])
    # Views cost host time only, and the device is busy with earlier kernels while the host dispatches them.
    assert prices.checkpoint_time == pytest.approx(kernels)
    assert prices.selective_time == pytest.approx(kernels)
    # Keeping an op spares its kernel; the policy's host work is hidden.
    assert all(g == pytest.approx(kernel) for g in prices.gain.values())
    everything = tuple(prices.gain)
    assert prices.time("selective", everything) == pytest.approx(max(kernels - kernel * len(everything),
                                                                       prices.host_floor) + prices.forward_extra)


def test_on_an_accelerator_a_host_bound_rerun_pays_for_the_host():
    host, kernel = 1e-3, 5e-6  # the host is the bottleneck: the device waits for all of its work
    graph = _timed_graph(True, host, kernel)
    o, stop = graph.overheads, graph.stop
    prices = BlockPrices(graph)
    machinery = o.region + o.per_saved * graph.saved_tensors
    assert prices.checkpoint_time == pytest.approx(machinery + host * stop)
    # A selective replay adds its policy's host work per op and per rebuilt tensor needing grad, and its
    # forward's recording mode its work per op (the forward is host-bound too); serving outputs spares kernels
    # the device was not waiting for.
    floor = machinery + host * stop + o.policy_replay * (stop + graph.saved_needing_grad)
    forward = o.policy_forward * len(graph.nodes)
    assert prices.selective_time == pytest.approx(floor + forward)
    assert prices.time("selective", tuple(prices.gain)) == pytest.approx(floor + forward)


class _Catching(nn.Module):
    """Calls its blocks; the second raises inside, and the model carries on without it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        x = self.blocks[0](x)
        try:
            self.blocks[1]("not a tensor")
        except TypeError:
            pass
        return self.blocks[2](x)


def test_profiling_a_block_that_raises_inside_leaves_no_mode_behind():
    x = torch.randn(4, 8, requires_grad=True)
    graphs = profile_ops(_Catching(), x, modules=["blocks.0", "blocks.1", "blocks.2"], timing="estimate").blocks
    assert {"blocks.0", "blocks.2"} <= set(graphs)
    assert torch._C._len_torch_function_stack() == 0 and torch._C._len_torch_dispatch_stack() == 0


def test_on_the_cpu_host_and_kernel_add_up():
    host, kernel = 5e-6, 1e-3
    graph = _timed_graph(False, host, kernel)
    o, stop, n = graph.overheads, graph.stop, len(graph.nodes)
    prices = BlockPrices(graph)
    assert prices.checkpoint_time == pytest.approx(
        o.region + o.per_saved * graph.saved_tensors + sum(host + nd.kernel_time for nd in graph.nodes[:stop]))
    assert prices.selective_time - prices.checkpoint_time == pytest.approx(
        n * o.policy_forward + (stop + graph.saved_needing_grad) * o.policy_replay)
    assert all(g == pytest.approx(kernel) for g in prices.gain.values())


def test_the_cpu_clock_is_thread_time_with_one_thread():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _cpu_clock() is time.thread_time and not Clock("cpu").asynchronous
        torch.set_num_threads(2)
        assert _cpu_clock() is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_an_accelerator_without_events_synchronizes_at_every_mark(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "_events", lambda device_type: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock = Clock("cuda")
    clock.mark()
    clock.mark()
    assert len(clock.read()) == 2 and calls == [torch.device("cuda")] * 2


def test_on_the_cpu_op_costs_add_up_to_the_unwatched_forward():
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with torch.no_grad():
        n = len(profile_ops(nn.Sequential(block), x, modules=["0"], timing="estimate").blocks["0"].nodes)
        times = time_ops(lambda: block(x), n, Clock("cpu"), 2, lambda: (contextlib.nullcontext(),) * 2)
    assert not times.asynchronous and times.forward > 0
    assert sum(times.wall) == pytest.approx(times.forward, rel=1e-9)
    assert times.wall == [h + d for h, d in zip(times.host, times.device)]
