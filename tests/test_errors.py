"""Bad input and divergent recomputation give errors people can act on; nothing is left behind."""

import pytest
import torch
from conftest import hooks_on_stack

import remat


class Flaky:
    """A function whose recomputation differs from its forward (reads a changing attribute)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        width = 4 if self.calls == 1 else 3
        return x[:width].sin().exp()


def test_metadata_mismatch_names_the_function_index_and_shapes():
    x = torch.randn(6, requires_grad=True)
    flaky = Flaky()
    y = remat.checkpoint(flaky, x)
    with pytest.raises(remat.CheckpointError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "Flaky" in message
    assert "saved position 0" in message
    assert "shape=(4,)" in message and "shape=(3,)" in message
    assert "debug=True" in message
    assert hooks_on_stack() is None


def test_mismatch_in_a_module_names_the_module_class_and_path():
    class Drifting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.step = 0

        def forward(self, x):
            self.step += 1
            return self.lin(x if self.step == 1 else x[:1])

    block = Drifting()
    block._remat_path = "layers.3"
    y = remat.checkpoint(block, torch.randn(2, 4))
    with pytest.raises(remat.CheckpointError, match=r"Drifting module at 'layers.3'"):
        y.sum().backward()


def test_debug_mode_shows_both_traces_and_marks_the_first_divergent_operator():
    state = {"n": 0}

    def fn(x):
        state["n"] += 1
        h = x.sin() if state["n"] == 1 else x.cos()
        return h.exp()

    x = torch.randn(4, requires_grad=True)
    y = remat.checkpoint(fn, x, debug=True, determinism_check="default")
    with pytest.raises(remat.CheckpointError) as info:
        y.sum().backward()
    message = str(info.value)
    assert "original forward" in message and "recomputation" in message
    assert "first diverging operator" in message
    assert "aten.sin.default" in message and "aten.cos.default" in message
    assert "test_errors.py" in message  # the call site of each operator
    marked = [line for line in message.splitlines() if line.startswith(">>>")]
    assert len(marked) == 1 and "aten.sin.default" in marked[0] and "aten.cos.default" in marked[0]


def test_global_debug_switch_turns_on_traces():
    with remat.set_checkpoint_debug_enabled(True):
        y = remat.checkpoint(Flaky(), torch.randn(6, requires_grad=True))
    with pytest.raises(remat.CheckpointError, match="original forward"):
        y.sum().backward()


def test_fewer_tensors_in_recompute_is_reported():
    state = {"n": 0}

    def fn(x):
        state["n"] += 1
        h = x.sin()
        return h.exp() if state["n"] == 1 else h * 2

    y = remat.checkpoint(fn, torch.randn(3, requires_grad=True), early_stop=False)
    with pytest.raises(remat.CheckpointError, match="fewer tensors"):
        y.sum().backward()


def test_more_tensors_in_recompute_is_reported_without_early_stop():
    state = {"n": 0}

    def fn(x):
        state["n"] += 1
        h = x.exp()
        return h.sin().cos() if state["n"] > 1 else h * 2

    y = remat.checkpoint(fn, torch.randn(3, requires_grad=True), early_stop=False)
    with pytest.raises(remat.CheckpointError, match="more tensors"):
        y.sum().backward()


def test_determinism_check_none_skips_the_metadata_check():
    x = torch.randn(6, requires_grad=True)

    def fn(t, flag=[0]):  # noqa: B006 - deliberate state across calls
        flag[0] += 1
        return (t * (1.0 if flag[0] == 1 else 2.0)).sin()

    y = remat.checkpoint(fn, x, determinism_check="none")
    y.sum().backward()  # values differ but shapes match: no error, no check


def test_unknown_determinism_check_is_a_value_error():
    with pytest.raises(ValueError, match=r"determinism_check must be one of \['default', 'none'\]"):
        remat.checkpoint(torch.sin, torch.randn(2, requires_grad=True), determinism_check="strict")


def test_input_mutated_in_place_before_backward_raises():
    x = torch.randn(4, requires_grad=True)
    h = x * 1
    y = remat.checkpoint(lambda t: t.sin().exp(), h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_exception_inside_the_function_leaves_no_hook_and_autograd_works():
    def boom(x):
        x.sin()
        raise KeyError("bad")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(KeyError):
        remat.checkpoint(boom, x)
    assert hooks_on_stack() is None
    (g,) = torch.autograd.grad(x.exp().sum(), x)
    assert torch.equal(g, x.exp())


def test_context_fn_that_swallows_an_exception_is_an_error():
    import contextlib

    class Swallow(contextlib.AbstractContextManager):
        def __exit__(self, *exc):
            return True

    def boom(x):
        raise ValueError("inner")

    with pytest.raises(RuntimeError, match="swallowed an exception"):
        remat.checkpoint(boom, torch.randn(2, requires_grad=True), context_fn=lambda: (Swallow(), Swallow()))


def test_context_fn_pair_is_entered_in_forward_and_recompute():
    import contextlib

    log = []

    @contextlib.contextmanager
    def tag(name):
        log.append(name)
        yield

    y = remat.checkpoint(torch.exp, torch.randn(3, requires_grad=True),
                         context_fn=lambda: (tag("forward"), tag("recompute")))
    assert log == ["forward"]
    y.sum().backward()
    assert log == ["forward", "recompute"]


def test_reentrant_rejects_autograd_grad_kwargs_context_fn_and_debug():
    x = torch.randn(3, requires_grad=True)
    y = remat.checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        torch.autograd.grad(y.sum(), x)
    with pytest.raises(ValueError, match="keyword arguments"):
        remat.checkpoint(lambda t, k=1: t * k, x, use_reentrant=True, k=2)
    needs = "context_fn, policy, debug and offload_inputs need use_reentrant=False"
    with pytest.raises(ValueError, match=needs):
        remat.checkpoint(torch.sin, x, use_reentrant=True, debug=True)
    with pytest.raises(ValueError, match=needs):
        remat.checkpoint(torch.sin, x, use_reentrant=True, context_fn=lambda: remat.noop_context_fn())
    with pytest.raises(ValueError, match=needs):
        remat.checkpoint(torch.sin, x, use_reentrant=True, offload_inputs=True)


def test_custom_function_reading_saved_tensors_twice_is_a_clear_error():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            (b,) = ctx.saved_tensors
            return g * 2

    y = remat.checkpoint(lambda t: Twice.apply(t.sin()), torch.randn(3, requires_grad=True))
    with pytest.raises(remat.CheckpointError, match="unpacked twice"):
        y.sum().backward()


def test_checkpoint_sequential_rejects_bad_segments_and_kwargs():
    layers = [torch.nn.Linear(2, 2)] * 3
    x = torch.randn(1, 2)
    with pytest.raises(ValueError, match="segments must be between 1 and"):
        remat.checkpoint_sequential(layers, 0, x)
    with pytest.raises(ValueError, match="unexpected keyword"):
        remat.checkpoint_sequential(layers, 1, x, bogus=1)
