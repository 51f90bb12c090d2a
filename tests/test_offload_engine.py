"""The offload engine on a fake accelerator: real copies on the CPU, simulated streams, events and bandwidths.

Every entry point (``offload``, ``offload_wrapper``, ``save_on_cpu``, a policy's CPU_OFFLOAD) goes through the
engine of its tensors' device type; installing a fake device model for ``"cpu"`` makes CPU tensors travel as an
accelerator's would.
"""

import copy
import functools

import pytest
import torch
from fake_device import FakeDevice, TorchStyleModule
from helpers import MLPStack, assert_bitwise, grads
from offload_cases import (
    OFFLOAD,
    Layouts,
    check_layouts,
    entry_points,
    offload_everything,
    offload_matmuls,
    record_layouts,
)
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.policies.hostcopy import HostDevice, TorchDevice, use_device_model
from remat.policies.hostpool import size_class


@pytest.fixture
def fake():
    device = FakeDevice()
    with use_device_model("cpu", device) as engine:
        device.engine = engine
        yield device


ENTRY_POINTS = entry_points("cpu")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_gives_bitwise_gradients_and_keeps_layouts(fake, entry):
    torch.manual_seed(0)
    model = Layouts()
    x = torch.randn(8, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x), params)
    fake.d2h_bytes_per_s = float("inf")  # copies out complete at once and leave the window: the saves come back
    pairs = record_layouts(fake.engine)
    got = grads(lambda: ENTRY_POINTS[entry](model, x), params)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])
    assert fake.calls("copy") and not fake.calls("host waits")
    # The policy keeps op outputs, of which only sin's comes out transposed; the hooks see every layout.
    check_layouts(pairs, every_kind=entry != "policy")


def test_cpu_offload_policy_runs_the_demo_gpt_with_real_copies(fake):
    # Attention's output comes back as attention laid it out (batch, seq, heads, dim); a contiguous copy
    # made the recomputation's reshape copy it, an op forward never ran, and the replay refused it.
    # Without dropout the CPU runs the fused attention kernel, whose output has that layout, as CUDA's has.
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64, dropout=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg)
    wrapped = copy.deepcopy(plain)
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block), policy=offload_matmuls)
    tokens, targets = synthetic_batch(cfg, 2)
    expected = grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=3)
    got = grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=3)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])
    d2h = [c for c in fake.copies if c.to_host]
    assert d2h and len(d2h) == len([c for c in fake.copies if not c.to_host])


def test_kept_draws_and_outputs_changed_in_place_offload_correctly(fake):
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64, dropout=0.2)
    torch.manual_seed(0)
    plain = GPT(cfg)
    wrapped = copy.deepcopy(plain)
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block),
                                         policy=offload_everything)
    tokens, targets = synthetic_batch(cfg, 2)
    expected = grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=4)
    got = grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=4)
    assert_bitwise(expected[1], got[1])

    w = torch.randn(8, 8, requires_grad=True)

    def changes_its_matmul(t):
        h = t @ w
        h.mul_(2)  # the kept output changes while it is copied: it is recomputed instead of served
        return h.sin()

    x = torch.randn(8, 8, requires_grad=True)
    stats = remat.OffloadStats()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, offload_matmuls, stats=stats)
    got = torch.autograd.grad(remat.checkpoint(changes_its_matmul, x, context_fn=ctx).sum(), [x, w])
    assert_bitwise(torch.autograd.grad(changes_its_matmul(x).sum(), [x, w]), got)
    assert stats.offloaded_tensors == 0


def test_an_offloaded_output_changed_after_forward_is_served_as_forward_made_it(fake):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        h = t @ w
        return h, h.sin()

    expected = torch.autograd.grad(fn(x)[1].sum(), [x, w])
    h, out = remat.checkpoint(fn, x, policy=offload_matmuls)
    with torch.no_grad():
        h.add_(1)  # after forward: the host copy still holds what the recomputation needs
    assert_bitwise(expected, torch.autograd.grad(out.sum(), [x, w]))


def test_a_region_waits_for_its_copies_out_before_what_follows(fake):
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64, requires_grad=True)
    out = remat.checkpoint(lambda t: (t @ w).relu() @ w, x, policy=offload_matmuls)
    d2h_events = [entry[3] for entry in fake.calls("copy") if entry[1] == "d2h"]
    assert len(d2h_events) == 2
    # On the device only: the compute stream waits for the last copy out when the region ends.
    assert fake.calls("wait_event") == [("wait_event", "compute", d2h_events[-1])]
    out.sum().backward()
    assert not fake.calls("host waits")


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.ops.append(op)
        return op(*args, **(kwargs or {}))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_dispatch_modes_never_see_the_engines_copies(entry):
    torch.manual_seed(0)
    model = Layouts()
    x = torch.randn(8, 16, requires_grad=True)
    seen = []
    for device in (HostDevice(), FakeDevice()):  # the first moves nothing (save_on_cpu, policy) or copies on the spot
        for _ in range(2):  # the second step runs as the first: nothing carries over
            with use_device_model("cpu", device), OpNames() as names:
                torch.autograd.grad(ENTRY_POINTS[entry](model, x), [x, *model.parameters()])
            seen.append(names.ops)
    assert seen[0] == seen[2] and seen[1] == seen[3]
    assert all(op is not torch.ops.aten.copy_.default for ops in seen[2:] for op in ops)


def test_copies_out_follow_their_producers_and_overlap_compute(fake):
    engine, n, layer = fake.engine, 6, 1 / 8
    fake.d2h_bytes_per_s = fake.h2d_bytes_per_s = 2.0 ** 20  # one 64 KiB activation: 1/16 s each way
    activations, handles = [torch.randn(16384) for _ in range(n)], []
    for activation in activations:
        fake.run(layer)  # the layer computing the activation
        handles.append(engine.stash(activation))
    assert fake.compute.ready == n * layer  # forward never waited for a copy
    d2h = [c for c in fake.copies if c.to_host]
    assert [c.start for c in d2h] == [(i + 1) * layer for i in range(n)]  # each after its producer
    assert all(c.end == c.start + 1 / 16 for c in d2h)
    # The side stream waits for the producer, copies, and the source's memory is marked as used by it.
    assert [e[:3] for e in fake.log[:3]] == [("wait_stream", "side", "compute"), ("copy", "d2h", "side"),
                                            ("record_stream", "side", activations[0].data_ptr())]
    assert not fake.calls("host waits") and not fake.calls("wait_event")


@pytest.mark.parametrize("depth, paced, stall", [(0, True, 6 / 16), (1, True, 1 / 16), (2, True, 1 / 16),
                                                 (0, False, 1 / 16)])
def test_prefetch_hides_copies_back_behind_backward_compute(fake, depth, paced, stall):
    # paced: the host keeps pace with the device (it waits for each layer), so only prefetch copies ahead;
    # otherwise the host runs ahead and its fetches alone queue the copies back early (they wait for no compute).
    engine, n, layer = fake.engine, 6, 1 / 8
    fake.d2h_bytes_per_s = fake.h2d_bytes_per_s = 2.0 ** 20  # 1/16 s per copy, less than a layer's 1/8 s
    handles = [engine.stash(torch.randn(16384)) for _ in range(n)]
    fake.advance()
    start = fake.now
    for handle in reversed(handles):  # backward: last saved, first needed
        tensor = engine.fetch(handle, prefetch=depth)
        event = handle.event
        # The compute stream waits for the copy back, and the memory is marked as used by it.
        assert fake.log[-3:-1] == [("wait_event", "compute", event), ("record_stream", "compute", tensor.data_ptr())]
        assert fake.log[-1][:2] == ("record_event", "compute")  # where the compute stream gets to its use
        assert fake.compute.ready >= event.time and tensor.numel() == 16384
        fake.run(layer)
        if paced:
            fake.now = fake.compute.ready
    assert fake.compute.ready - start - n * layer == stall
    assert not fake.calls("host waits")


def test_prefetch_runs_in_backward_order(fake):
    x = torch.randn(32, 16, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu", prefetch_depth=2) as off:
        y = x + 0  # x itself is the caller's: it stays on the device
        for _ in range(6):
            y = torch.sin(y)  # each saves its input: backward needs them newest first
    blocks_out = [c.dst_ptr for c in fake.copies if c.to_host]
    fake.advance()  # the copies out complete and are let go of: every tensor comes back
    fake.engine.release_held()
    y.sum().backward()
    blocks_back = [c.source_ptr for c in fake.copies if not c.to_host]
    assert off.stats.offloaded_tensors == len(blocks_out) == len(blocks_back) == 6
    assert blocks_back == blocks_out[::-1]
    first_wait = next(i for i, e in enumerate(fake.log) if e[:2] == ("wait_event", "compute"))
    assert sum(e[:2] == ("copy", "h2d") for e in fake.log[:first_wait]) == 3  # the first one and two ahead


def test_pool_is_reused_across_steps_and_nothing_leaks(fake):
    model = MLPStack(depth=2, width=16, hidden=64, p=0.0)
    off = remat.offload(min_bytes=0, device_type="cpu")
    allocations = []
    for _ in range(3):
        with off:
            loss = model(torch.randn(32, 16)).sum()
        loss.backward()
        del loss
        fake.advance()  # the step's copies complete on the device
        allocations.append(off.pool.allocations)
    assert allocations[0] > 0 and allocations == [allocations[0]] * 3
    fake.engine.collect()
    pool = off.pool
    assert pool.in_use_bytes == 0 and pool.waiting_bytes == 0 and pool.free_bytes == pool.allocated_bytes
    assert fake.engine.live == 0


def test_close_sizes_share_a_block_which_waits_for_its_copies(fake):
    engine = fake.engine
    pool = engine.pool()
    assert size_class(5000) == size_class(5100)
    handle = engine.stash(torch.randn(1250))  # 5000 bytes
    del handle  # freed before its copy out has completed on the device
    kept = engine.stash(torch.randn(1275))  # 5100 bytes: same class, but the block may still be read
    assert pool.allocations == 2
    fake.advance()
    engine.collect()
    assert pool.free_bytes == size_class(5000)
    again = engine.stash(torch.randn(1275))
    assert pool.allocations == 2 and again is not None and kept is not None


def test_changing_a_saved_tensor_after_it_was_offloaded_is_refused(fake):
    x = torch.randn(8, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu"):
        y = x * 2
        z = y.sin()  # saves y
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified in place after it was offloaded"):
        z.sum().backward()


def test_torch_device_drives_a_torch_style_module(monkeypatch):
    # TorchDevice is what runs on CUDA; here it drives a module shaped like torch.cuda that logs each call.
    module = TorchStyleModule()
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: module.log.append(("record_stream",
                                                                                             stream.name)))
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=16, hidden=64, p=0.0)
    x = torch.randn(32, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x).sum(), params)
    with use_device_model("cpu", TorchDevice(module)) as engine:
        # pin_memory=False: pinning needs a real accelerator
        with remat.offload(min_bytes=0, device_type="cpu", pin_memory=False) as off:
            loss = model(x).sum()
        engine.release_held()  # every copy back is made, to be seen in the log
        got = torch.autograd.grad(loss, params)
        del loss
        engine.collect()
    assert_bitwise(expected[1], got)
    log, n = module.log, off.stats.offloaded_tensors
    assert module.created == 2 and not [e for e in log if e[0] == "host waits"]
    # Each copy out: the outbound stream waits for the compute stream, the copy runs with that stream current
    # and records its event there, and the source's memory is marked as used by it.
    out = [i for i, e in enumerate(log) if e == ("enter", "side1")]
    assert len(out) == n
    for i in out:
        assert log[i - 1] == ("wait_stream", "side1", "default")
        assert log[i + 1: i + 4] == [("record_event", "side1", "side1"), ("exit", "side1"),
                                     ("record_stream", "side1")]
    # Each copy back: memory allocated on the inbound stream, which then waits for that tensor's copy out only.
    back = [i for i, e in enumerate(log) if e == ("wait_event", "side2", "side1")]
    assert len(back) == n
    for i in back:
        assert log[i - 2: i] == [("enter", "side2"), ("exit", "side2")]
        assert log[i + 1: i + 4] == [("enter", "side2"), ("record_event", "side2", "side2"), ("exit", "side2")]
    # Each tensor is used only after the compute stream waited for its copy back, and is marked as used there.
    waits = [i for i, e in enumerate(log) if e == ("wait_event", "default", "side2")]
    assert len(waits) == n and all(log[i + 1] == ("record_stream", "default") for i in waits)
    assert off.pool.in_use_bytes == 0 and off.pool.free_bytes == off.pool.allocated_bytes


def test_a_recomputation_brings_back_only_its_own_offloaded_outputs():
    # A served output once prefetched the newest outputs of earlier regions too, holding them on the device
    # through this block's backward: only the region's own may come back while it recomputes.
    fake = FakeDevice()
    with use_device_model("cpu", fake) as engine:
        torch.manual_seed(0)
        model = MLPStack(depth=4, width=16, hidden=32, p=0.0)
        region, handles = [0], []
        stash, fetch = engine.stash, engine.fetch

        def stashing(tensor, *args, **kwargs):
            handle = stash(tensor, *args, **kwargs)
            handles.append((region[0], handle))
            return handle

        def fetching(handle, *args, **kwargs):
            mine = next(r for r, h in handles if h is handle)
            tensor = fetch(handle, *args, **kwargs)
            assert all(r == mine for r, h in handles if h.on_device is not None), "another region came back"
            return tensor

        engine.stash, engine.fetch = stashing, fetching

        def wrap(block, x):
            region[0] += 1
            return remat.checkpoint(block, x, policy=offload_matmuls)

        x = torch.randn(8, 16, requires_grad=True)
        model(x, wrap=wrap).sum().backward()
    assert len({r for r, _ in handles}) == 4 and sum(not c.to_host for c in fake.copies) == len(handles)


def test_copies_in_flight_are_bounded_by_a_host_wait_for_the_oldest(fake):
    engine, n = fake.engine, 8
    fake.d2h_bytes_per_s = 2.0 ** 20  # 1/16 s per 64 KiB copy; the compute makes one every 1/64 s
    engine.in_flight_limit = 3 * 65536
    for _ in range(n):
        fake.run(1 / 64)
        fake.now = fake.compute.ready  # the host keeps pace with the compute it issues
        engine.stash(torch.randn(16384))
        # Once the window is full, the host waited for the oldest copy out: at most the limit is in flight.
        unfinished = [c for c in fake.copies if c.to_host and c.end > fake.now]
        assert sum(c.nbytes for c in unfinished) <= engine.in_flight_limit
    waits = fake.calls("host waits")
    assert len(waits) == n - 3  # the fourth copy and each after it waited for one that was three older
    assert [w[1].copy for w in waits] == list(range(n - 3))


def test_copies_back_do_not_queue_behind_copies_out(fake):
    engine = fake.engine
    fake.d2h_bytes_per_s = fake.h2d_bytes_per_s = 2.0 ** 20  # 1/16 s per copy
    handles = [engine.stash(torch.randn(16384)) for _ in range(4)]
    engine.fetch(handles[0])  # needed while the later copies out still run
    back = next(c for c in fake.copies if not c.to_host)
    assert back.start == 1 / 16  # right after its own copy out, not after all four (4/16)
    assert max(c.end for c in fake.copies if c.to_host) == 4 / 16


def test_a_host_ahead_in_backward_brings_back_no_more_than_the_window(fake):
    engine, n, size = fake.engine, 8, 65536
    fake.d2h_bytes_per_s = fake.h2d_bytes_per_s = 2.0 ** 22  # 1/64 s per copy; a layer's compute takes 1/8 s
    handles = [engine.stash(torch.randn(16384)) for _ in range(n)]
    fake.advance()
    engine.in_flight_limit = 3 * size
    reached = []  # per fetch: when the compute stream gets to the tensor's use
    for handle in reversed(handles):  # the host never waits for compute by itself: it runs ahead
        engine.fetch(handle)
        reached.append(next(e[2].time for e in reversed(fake.log) if e[0] == "record_event"))
        ahead = sum(1 for t in reached if t > fake.now)  # brought back, and the compute stream not there yet
        assert ahead * size <= engine.in_flight_limit + size
        fake.run(1 / 8)
    assert len(fake.calls("host waits")) == n - 3  # from the fourth fetch on, for the compute three fetches back


def test_storages_a_leaf_owns_are_not_copied(fake):
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    for hooks in (remat.offload(min_bytes=0, device_type="cpu"), remat.save_on_cpu(pin_memory=False)):
        fake.copies.clear()
        with use_device_model("cpu", fake) as engine, hooks:
            y = linear(x).sin()  # saves x, the weight (a view of the parameter) and the linear's output
        fake.advance()
        for each in (engine, fake.engine):  # offload's was made before, save_on_cpu's when it packs
            each.release_held()
        y.sum().backward()
        # only the linear's output travelled, out and back
        assert [c.nbytes for c in fake.copies] == [4 * 16 * 4] * 2


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_keeps_depth_tensors_ahead_not_more(fake, depth):
    # Each fetch once started `depth` more copies back, so the tensors brought back ahead grew by one a fetch.
    engine, n = fake.engine, 12
    handles = [engine.stash(torch.randn(256)) for _ in range(n)]
    for i, handle in enumerate(reversed(handles)):
        engine.fetch(handle, prefetch=depth)
        ahead = [h for h in handles if h.on_device is not None]
        assert len(ahead) == min(depth, n - 1 - i)


@pytest.mark.parametrize("hooks", ["offload", "save_on_cpu"])
def test_a_tensor_saved_by_several_ops_travels_once_each_way(fake, hooks):
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(16, 16) for _ in range(3))
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *q.parameters(), *k.parameters(), *v.parameters()]

    def run():
        h = x.sin()  # saved by sin's output's three readers, as a layer's input is by its projections
        return (q(h) * k(h) + v(h)).sum()

    expected = torch.autograd.grad(run(), params)
    context = remat.offload(min_bytes=0, device_type="cpu") if hooks == "offload" else remat.save_on_cpu()
    with context:
        loss = run()
    out = [c for c in fake.copies if c.to_host]
    # x and the weights stay (a leaf's); h once, q(h) and k(h) (saved by the product) once each
    assert sorted(c.nbytes for c in out) == [4 * 16 * 4] * 3
    fake.advance()
    fake.engine.release_held()
    got = torch.autograd.grad(loss, params)
    assert_bitwise(expected, got)
    assert len([c for c in fake.copies if not c.to_host]) == 3


def test_a_tensor_changed_between_two_saves_is_copied_for_each(fake):
    x = torch.randn(4, 16, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu"):
        h = x * 2
        a = h.sin()  # saves h
        h.mul_(3)  # h changes: the next save must not share the first's bytes
        b = h.cos()
    assert len([c for c in fake.copies if c.to_host]) == 2
    with pytest.raises(RuntimeError, match="modified in place after it was offloaded"):
        (a + b).sum().backward()


def test_views_of_one_span_share_a_copy_each_in_its_own_layout(fake):
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(16, 16) for _ in range(3))
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(2, 4, 16, requires_grad=True)
    params = [x, w, *q.parameters(), *k.parameters(), *v.parameters()]

    def run():
        h = x.sin()  # 3-D: each linear saves a 2-D view of its own; mm saves h.t(), a transposed one
        return (q(h) + k(h) + v(h)).sum() + torch.mm(w.t(), h.reshape(8, 16).t()).sum()

    expected = torch.autograd.grad(run(), params)
    with remat.offload(min_bytes=0, device_type="cpu") as off:
        loss = run()
    assert [c.nbytes for c in fake.copies if c.to_host] == [2 * 4 * 16 * 4]  # h, once
    assert (off.stats.offloaded_tensors, off.stats.shared_tensors) == (4, 3)
    fake.advance()
    fake.engine.release_held()
    assert_bitwise(expected, torch.autograd.grad(loss, params))
    assert len([c for c in fake.copies if not c.to_host]) == 1


def test_a_new_tensor_at_a_freed_address_gets_its_own_copy(fake):
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu"):
        a = x * 2
        first = a.sin()  # saves a, then a is freed (its copy is all that holds it)
        address = a.data_ptr()
        del a
        b = x * 3  # may land where a was: same address, size and version
        second = b.sin()
        reused = b.data_ptr() == address
    assert len([c for c in fake.copies if c.to_host]) == 2, reused
    x_grad, = torch.autograd.grad((first + second).sum(), [x])
    assert torch.equal(x_grad, 2 * (x * 2).cos() + 3 * (x * 3).cos())


def test_a_conjugate_view_never_shares_the_plain_copy(fake):
    torch.manual_seed(0)
    x = torch.randn(4, 4, dtype=torch.cfloat, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.cfloat, requires_grad=True)

    def run():
        h = x.sin()
        return (torch.mm(w, h) + torch.mm(w, h.conj())).abs().sum()  # saves h, then its lazy conjugate

    expected = torch.autograd.grad(run(), [x, w])
    with remat.offload(min_bytes=0, device_type="cpu"):
        loss = run()
    assert_bitwise(expected, torch.autograd.grad(loss, [x, w]))


class _SquareReusingItsSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return h * h

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return grad * h.mul_(2)  # writes into what it was given back (a memory-saving idiom)


def test_a_save_written_in_backward_does_not_reach_the_other_saves_of_its_bytes(fake):
    x = torch.randn(64, requires_grad=True)

    def run():
        h = x.sin()
        return (h.cos() + _SquareReusingItsSave.apply(h)).sum()  # cos and the function both save h

    with remat.offload(min_bytes=0, device_type="cpu"):
        loss = run()
    fake.advance()  # h's copy out completed and is let go of: it comes back, and the function writes into its
    fake.engine.release_held()  # own copy
    (got,) = torch.autograd.grad(loss, [x])
    h = x.detach().sin()
    assert torch.allclose(got, -h.sin() * x.detach().cos() + 2 * h * x.detach().cos())


def test_a_save_served_in_flight_and_written_in_backward_is_refused_to_the_others_as_plain_autograd_does(fake):
    x = torch.randn(64, requires_grad=True)

    def run():
        h = x.sin()
        return (h.cos() + _SquareReusingItsSave.apply(h)).sum()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(run(), [x])
    with remat.offload(min_bytes=0, device_type="cpu"):
        loss = run()
    # h's copy out is still in flight: both saves get h itself, as without hooks
    with pytest.raises(RuntimeError, match="modified in place after it was offloaded"):
        torch.autograd.grad(loss, [x])


def test_frozen_parameters_stay_on_the_device(fake):
    frozen = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    x = torch.randn(4, 16, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu") as off:
        y = (x @ frozen.t()).sin() * frozen[0]  # saves the frozen weight's transpose and a row of it
    y.sum().backward()
    assert off.stats.offloaded_tensors == 1  # x @ W.t()'s output, saved by sin; never the weight


def test_a_tensor_over_the_window_alone_does_not_wait_for_its_own_copy(fake):
    engine = fake.engine
    engine.in_flight_limit = 1024
    handles = [engine.stash(torch.randn(4096)) for _ in range(3)]  # each alone over the limit
    # each waits for the one before it, never for itself
    assert [w[1].copy for w in fake.calls("host waits")] == [0, 1]
    engine.fetch(handles[2])
    assert [w[1].copy for w in fake.calls("host waits")] == [0, 1]


def test_a_shared_copy_a_backward_never_fetched_is_let_go_when_it_ends(fake):
    x = torch.randn(64, requires_grad=True)
    with remat.offload(min_bytes=0, device_type="cpu"):
        h = x.sin()
        used, unused = h.cos(), h.sin()  # both save h: one copy, two users
    torch.autograd.grad(used.sum(), [x], retain_graph=True)  # reaches cos's save only
    handles = [h for h in fake.engine._by_span.values()]
    assert handles and all(h.on_device is None for h in handles)
    del unused


def _checkpointed(block, x, context_fn):
    return remat.checkpoint(block, x, context_fn=context_fn)


def _offloading(rule_ops):
    """A rules policy offloading ``rule_ops``' outputs, with a count of how often remat asks it."""
    asked = [0]

    def op_rule(op):
        asked[0] += 1
        return OFFLOAD if op in rule_ops else None

    return remat.policies.Policy(op_rule=op_rule, name="offload counting"), asked


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_an_offloading_policy_is_asked_and_copies_the_same_every_step(fake, p):
    torch.manual_seed(0)
    model = MLPStack(depth=3, p=p)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    policy, asked = _offloading(remat.policies.MATMUL_OPS)
    per_step = []
    for step in range(3):
        expected = grads(lambda: model(x).sum(), params, seed=step)
        asked[0], stats, copies = 0, remat.OffloadStats(), len(fake.copies)
        ctx = functools.partial(remat.create_selective_checkpoint_contexts, policy, stats=stats)
        wrap = functools.partial(_checkpointed, context_fn=ctx)
        got = grads(lambda: model(x, wrap=wrap).sum(), params, seed=step)  # noqa: B023 - called at once
        assert_bitwise(expected[1], got[1])
        assert asked[0] > 0  # every call decides for itself: nothing of an earlier step is followed
        new = fake.copies[copies:]
        per_step.append((stats.offloaded_tensors, stats.offloaded_bytes, sum(c.to_host for c in new),
                         sum(not c.to_host for c in new)))
    assert per_step[0][0] > 0 and per_step == [per_step[0]] * 3
    assert not fake.calls("host waits")


def test_an_offloaded_output_changed_in_place_is_recomputed_at_every_step(fake):
    w = torch.randn(8, 8, requires_grad=True)

    def changes_its_matmul(t):
        h = t @ w
        h.mul_(2)
        return h.sin()

    policy, asked = _offloading(remat.policies.MATMUL_OPS)
    x = torch.randn(8, 8, requires_grad=True)
    for _ in range(3):
        stats = remat.OffloadStats()
        ctx = functools.partial(remat.create_selective_checkpoint_contexts, policy, stats=stats)
        got = torch.autograd.grad(remat.checkpoint(changes_its_matmul, x, context_fn=ctx).sum(), [x, w])
        assert_bitwise(torch.autograd.grad(changes_its_matmul(x).sum(), [x, w]), got)
        assert stats.offloaded_tensors == 0


@pytest.mark.parametrize("entry", ["offload", "save_on_cpu"])
def test_what_backward_needs_before_its_copy_out_completes_is_served_without_a_round_trip(fake, entry):
    torch.manual_seed(0)
    fake.d2h_bytes_per_s = fake.h2d_bytes_per_s = 2.0 ** 20  # 1/16 s per 64 KiB tensor
    w = torch.randn(128, 128, requires_grad=True)
    x = torch.randn(128, 128, requires_grad=True)

    def run():
        h = x
        for _ in range(4):
            h = (h @ w).sin()  # saves h @ w (64 KiB) and, from the second on, h
        return h.sum()

    expected = torch.autograd.grad(run(), [x, w])
    fake.engine.in_flight_limit = 3 * 65536  # three copies out in flight: the host waits for older ones
    context = remat.offload(min_bytes=0, device_type="cpu") if entry == "offload" else remat.save_on_cpu()
    with context:
        loss = run()
    out = [c for c in fake.copies if c.to_host]
    in_flight = [c for c in out if c.end > fake.now]
    assert len(out) == 7 and len(in_flight) == 3
    assert_bitwise(expected, torch.autograd.grad(loss, [x, w]))
    back = [c for c in fake.copies if not c.to_host]
    assert len(back) == len(out) - len(in_flight)  # the three in flight were used where they were
    assert {c.source_ptr for c in back} == {c.dst_ptr for c in out[:4]}
    assert fake.engine.live == 0


def test_a_tensor_several_ops_save_is_served_in_flight_to_each(fake):
    # A loss's log-probabilities are saved by log_softmax and by nll_loss: the first thing backward needs.
    torch.manual_seed(0)
    logits = torch.randn(16, 10, requires_grad=True)
    target = torch.randint(10, (16,))

    def run():
        return torch.nn.functional.nll_loss(torch.log_softmax(logits * 2, dim=1), target)

    expected = torch.autograd.grad(run(), [logits])
    with remat.offload(min_bytes=0, device_type="cpu") as off:
        loss = run()
    assert off.stats.shared_tensors == 1
    assert_bitwise(expected, torch.autograd.grad(loss, [logits]))
    assert not [c for c in fake.copies if not c.to_host] and fake.engine.live == 0


def test_held_tensors_are_exact_layouts_and_let_go_once_copied(fake):
    engine = fake.engine
    wide = torch.randn(64, 64)
    exact = engine.stash(wide * 1, hold_in_flight=True)
    thin = engine.stash((wide * 1)[:, :1], hold_in_flight=True)  # would come back contiguous: never held
    assert exact.in_flight is not None and thin.layout.exact is False and thin.in_flight is None
    engine.release_held()
    assert exact.in_flight is not None  # its copy is still running
    fake.advance()
    engine.release_held()
    assert exact.in_flight is None
    assert torch.equal(engine.fetch(exact), wide)  # brought back over the link now
