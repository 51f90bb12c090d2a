"""Nothing leaks across steps; recomputed tensors live for one backward; memory really drops."""

import gc
import threading
import weakref

import torch
from conftest import hooks_on_stack
from helpers import MLPStack, assert_bitwise, grads

import remat
from remat import CheckpointPolicy
from remat.engine.nonreentrant import _Frame, _Placeholder
from remat.planning.basics.memory import measure_step
from remat.policies import Policy


def live(kind):
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kind))


def frame_of(fn):
    """The live frame of the region running ``fn`` (other tests' frames may linger in pytest's tracebacks)."""
    (frame,) = [obj for obj in gc.get_objects() if isinstance(obj, _Frame) and obj.fn is fn]
    return frame


def test_two_hundred_steps_leave_no_frames_placeholders_hooks_or_tensors():
    torch.manual_seed(0)
    model = MLPStack(depth=3, width=8, hidden=16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, wrap=remat.checkpoint).pow(2).mean()
        loss.backward()
        opt.step()

    for _ in range(10):
        step()
    frames, placeholders, tensors = live(_Frame), live(_Placeholder), live(torch.Tensor)
    for _ in range(200):
        step()
    assert hooks_on_stack() is None
    assert live(_Frame) == frames
    assert live(_Placeholder) == placeholders
    assert live(torch.Tensor) <= tensors


def test_frames_die_with_the_graph_even_without_backward():
    x = torch.randn(4, requires_grad=True)

    def fn(t):
        return t.sin().exp()

    y = remat.checkpoint(fn, x)
    ref = weakref.ref(frame_of(fn))
    del y
    gc.collect()
    assert ref() is None


def test_recomputed_tensors_are_released_when_backward_ends_even_with_retain_graph():
    x = torch.randn(16, requires_grad=True)
    recomputes = []

    def fn(t):
        recomputes.append(1)
        return t.sin().exp().cos()

    y = remat.checkpoint(fn, x)
    frame = frame_of(fn)
    recomputes.clear()
    g1 = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert frame.refills == {}  # nothing held between backwards
    g2 = torch.autograd.grad(y.sum(), x)
    assert frame.refills == {}
    assert len(recomputes) == 2  # the second backward recomputed again
    assert_bitwise(g1, g2)


def test_partial_backward_then_rest_leaves_nothing_behind():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    def fn(t):
        return (t @ w).sin(), (t * 3).exp()

    a, b = remat.checkpoint(fn, x)
    frame = frame_of(fn)
    torch.autograd.grad(a.sum(), w)
    assert frame.refills == {}
    torch.autograd.grad(b.sum(), x)
    assert frame.refills == {}


def test_four_threads_concurrently_get_the_right_gradients():
    torch.manual_seed(0)
    model = MLPStack(depth=3, p=0.0)
    params = list(model.parameters())
    inputs = [torch.randn(6, 16) * (i + 1) for i in range(4)]
    expected, results, errors = [None] * 4, [None] * 4, []
    barrier = threading.Barrier(4)

    def work(i):
        # The reference is plain autograd in this same thread: a new thread may run matmuls with another
        # intra-op thread count than the main thread, which changes reduction order in the last bits.
        try:
            expected[i] = grads(lambda: model(inputs[i]).pow(2).sum(), params)[1]
            barrier.wait()
            for _ in range(5):
                loss = model(inputs[i], wrap=remat.checkpoint).pow(2).sum()
                results[i] = torch.autograd.grad(loss, params)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for want, got in zip(expected, results):
        assert_bitwise(want, got)


def _mlp_peak(checkpointed: bool) -> int:
    torch.manual_seed(0)
    model = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(6)
    )
    x = torch.randn(2048, 64)

    def step():
        h = x
        for block in model:
            h = remat.checkpoint(block, h) if checkpointed else block(h)
        h.pow(2).mean().backward()

    return measure_step(step, model).peak_above_params


def test_six_block_mlp_whole_step_peak_is_at_most_40_percent():
    plain, checkpointed = _mlp_peak(False), _mlp_peak(True)
    assert checkpointed <= 0.40 * plain, (checkpointed, plain)


def test_a_region_is_freed_during_backward_once_its_nodes_ran():
    x = torch.randn(64, requires_grad=True)

    def first(t):
        return t.sin().exp()

    def second(t):
        return t.cos().exp()

    h = remat.checkpoint(first, x)
    y = remat.checkpoint(second, h)
    ref = weakref.ref(frame_of(second))
    seen = []
    h.register_hook(lambda g: seen.append(ref() is None))  # runs between the two regions' backward
    y.sum().backward()
    assert seen == [True]



def test_selective_regions_leave_no_frame_behind_across_steps():
    """A kept output autograd saves as its own op's output (exp) must be kept detached: with its grad_fn it
    would keep its graph, and the frame, alive forever (a cycle through C++ the collector cannot see)."""
    keep_all = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE, name="keep every output")
    w = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        return (t @ w).exp().sum(0)

    def step(backward: bool) -> None:
        y = remat.checkpoint(fn, torch.randn(8, 8, requires_grad=True), policy=keep_all)
        if backward:
            y.sum().backward()

    step(True)
    frames, placeholders = live(_Frame), live(_Placeholder)
    for i in range(6):
        step(backward=i % 2 == 1)
    assert live(_Frame) == frames
    assert live(_Placeholder) == placeholders
