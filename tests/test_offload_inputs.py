"""Checkpoint with offloaded inputs ("offloaded gradient checkpointing"): a region's inputs go to host memory through
the copy engine in forward and come back one region ahead in backward.

On the CPU the copies run synchronously through the engine's host buffers; the fake accelerator
(tests/fake_device.py) runs them on simulated streams, where the order of copies and waits is asserted.
"""

import copy

import pytest
import torch
from fake_device import FakeDevice
from loops import OPTIMIZERS, Mode, _calls, _wrapper, check
from test_training_loops import CASES
from torch import nn

import remat
from remat.policies.hostcopy import HostDevice, use_device_model

MODES = [Mode("offload_inputs", _calls(offload_inputs=0)),
         Mode("wrapper_offload_inputs", _wrapper(offload_inputs=0), calls=False)]


@pytest.fixture(params=["host", "fake"])
def engine(request):
    """A fresh copy engine for CPU tensors: synchronous host copies, or a fake accelerator's streams."""
    device = HostDevice() if request.param == "host" else FakeDevice(d2h_bytes_per_s=float("inf"))
    with use_device_model("cpu", device) as engine:
        engine.device = device
        yield engine


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", MODES, ids=repr)
@pytest.mark.parametrize("case", ["scale", "dropout_p", "argument_keyword", "accumulation"])
def test_training_loops_are_bitwise_plain_autograd(engine, case, mode, optimizer):
    before = engine.pool(True).allocations + engine.pool(False).allocations
    check(CASES[case](), mode, optimizer)
    if mode.calls:  # the wrapper mode leaves the last region's inputs in place: two regions, one moves
        assert engine.pool(True).allocations + engine.pool(False).allocations > before


class Chain(nn.Module):
    def __init__(self, depth: int = 6, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return h.square().mean()


def _wrapped(model: nn.Module, floor: int = 0) -> list[str]:
    return remat.apply_activation_checkpointing(model, check_fn=lambda m: m in set(model.blocks),
                                                offload_inputs=floor)


def test_every_input_but_the_last_regions_travels_and_is_back_before_backward_needs_it(engine):
    torch.manual_seed(0)
    plain = Chain()
    model = copy.deepcopy(plain)
    assert len(_wrapped(model)) == 6
    # The last region keeps its inputs: backward needs them first, before any copy back could have run.
    assert [b.checkpoint_fn.keywords.get("offload_inputs") for b in model.blocks] == [0] * 5 + [None]
    fetch, ready, coming = engine.fetch, [], []

    def watched(handle, prefetch=0):
        ready.append(handle.on_device is not None or handle.in_flight is not None)
        tensor = fetch(handle, prefetch)
        if isinstance(engine.device, FakeDevice):  # copies back started so far
            coming.append(len([c for c in engine.device.copies if not c.to_host]))
        return tensor

    engine.fetch = watched
    x = torch.randn(8, 32)
    expected = torch.autograd.grad(plain(x), list(plain.parameters()))
    got = torch.autograd.grad(model(x), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert len(ready) == 5
    if isinstance(engine.device, FakeDevice):
        fake = engine.device
        assert len([c for c in fake.copies if c.to_host]) == 5 and not fake.calls("host waits")
        # The last region that moved its inputs is backward's first to need them: still held on the device,
        # they make no round trip; every other one was on its way back when its region's backward began.
        assert all(ready) and len([c for c in fake.copies if not c.to_host]) == 4
        assert coming == [1, 2, 3, 4, 4]  # each fetch starts the previous region's: one region ahead, no more
        back = [c.source_ptr for c in fake.copies if not c.to_host]
        assert back == [c.dst_ptr for c in fake.copies if c.to_host][:4][::-1]  # in backward order


def test_the_inputs_leave_the_device_memory_during_forward():
    """On the CPU, bytes MemTracker sees: the engine's host buffers are outside what a step tracks."""
    torch.manual_seed(0)
    x = torch.randn(4096, 32)  # 512 KiB per block input, against 32 KiB of gradients per block
    peaks = {}
    for floor in (None, 0):
        model = Chain(depth=6, width=32)
        if floor is None:
            remat.apply_activation_checkpointing(model, check_fn=lambda m, b=set(model.blocks): m in b)
        else:
            _wrapped(model, floor)
        with use_device_model("cpu", HostDevice()):
            peaks[floor] = remat.measure_step(lambda m=model: m(x).backward(), model).peak_above_params
    # Five inputs stayed in host memory until their blocks' backwards; the peak, in the last block's backward,
    # holds the gradients and recomputed activations of the blocks before too, so it drops by most of five.
    size = 4096 * 32 * 4
    assert 4 * size < peaks[None] - peaks[0] <= 5 * size


def test_inputs_under_the_floor_stay(engine):
    model = Chain()
    _wrapped(model, floor=1 << 20)  # 8 x 32 floats are far below a MiB
    model(torch.randn(8, 32)).backward()
    assert engine.pool(True).allocations + engine.pool(False).allocations == 0


def test_bad_values_are_refused_in_one_line():
    block, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="offload_inputs must be True, False or the smallest input"):
        remat.checkpoint(block, x, offload_inputs=-1)
    with pytest.raises(ValueError, match="offload_inputs need use_reentrant=False"):
        remat.checkpoint(block, x, use_reentrant=True, offload_inputs=True)
    with pytest.raises(ValueError, match="offload_inputs needs the default checkpoint_wrapper_fn"):
        remat.apply_activation_checkpointing(Chain(), checkpoint_wrapper_fn=lambda m: m, offload_inputs=True)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_plan_that_checkpoints_with_offloaded_inputs_trains_as_plain_autograd(tmp_path, optimizer):
    """The plan option installs checkpoint(offload_inputs=True): inputs of a MiB and more go (here 1 MiB)."""
    torch.manual_seed(0)
    plain = Chain(depth=4, width=64)
    x = torch.randn(4096, 64)
    prof = remat.profile(copy.deepcopy(plain), x, loss_fn=lambda loss: loss, repeats=1, ops=False)
    plan = prof.plan(2 * prof.peak_bytes)
    plan.decisions.update({f"blocks.{i}": "checkpoint_offload" for i in range(3)})
    plan.save(tmp_path / "plan.json")
    model = remat.Plan.load(tmp_path / "plan.json").apply(copy.deepcopy(plain))
    assert [b.checkpoint_fn.keywords.get("offload_inputs") for b in model.blocks[:3]] == [True] * 3
    device = FakeDevice(d2h_bytes_per_s=float("inf"))
    with use_device_model("cpu", device):
        runs = []
        for net in (plain, model):
            opt = OPTIMIZERS[optimizer](net.parameters())
            steps = []
            for _ in range(3):
                loss = net(x)
                loss.backward()
                steps.append((loss.detach(), [p.grad.clone() for p in net.parameters()]))
                opt.step()
                opt.zero_grad(set_to_none=True)
            runs.append(steps)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(*runs):
        assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert len([c for c in device.copies if c.to_host]) == 3 * 3 and not device.calls("host waits")


def test_a_second_backward_brings_the_inputs_back_again(engine):
    torch.manual_seed(0)
    plain = Chain(depth=3)
    model = copy.deepcopy(plain)
    _wrapped(model)
    x = torch.randn(8, 32)
    expected = []
    loss = plain(x)
    for _ in range(2):
        expected.append(torch.autograd.grad(loss, list(plain.parameters()), retain_graph=True))
    loss = model(x)
    for want in expected:
        got = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_an_input_changed_in_place_after_forward_is_refused_as_plain_autograd_refuses_it(engine):
    block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    h = torch.randn(8, 32, requires_grad=True) * 1  # not a leaf: it travels
    y = remat.checkpoint(block, h, offload_inputs=0)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified"):
        y.sum().backward()
