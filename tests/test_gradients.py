"""Gradients through remat equal plain autograd, bitwise, across the hard cases."""

import pytest
import torch
from helpers import MLPStack, assert_bitwise, backward_grads, grads

import remat

VARIANTS = [pytest.param(False, id="nonreentrant"), pytest.param(True, id="reentrant")]


def ck(use_reentrant):
    return lambda fn, *a, **k: remat.checkpoint(fn, *a, use_reentrant=use_reentrant, **k)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_mlp_stack_with_dropout_is_bitwise_equal(use_reentrant):
    torch.manual_seed(0)
    model = MLPStack(depth=4)
    x = torch.randn(8, 16, requires_grad=True)
    params = [x, *model.parameters()]
    loss_plain, g_plain = backward_grads(lambda: model(x).pow(2).sum(), params, seed=3)
    loss_ck, g_ck = backward_grads(lambda: model(x, wrap=ck(use_reentrant)).pow(2).sum(), params, seed=3)
    assert torch.equal(loss_plain, loss_ck)
    assert_bitwise(g_plain, g_ck)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_global_rng_ends_where_plain_autograd_leaves_it(use_reentrant):
    model = MLPStack(depth=3)
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(11)
    model(x).sum().backward()
    after_plain = torch.rand(5)
    torch.manual_seed(11)
    model(x, wrap=ck(use_reentrant)).sum().backward()
    after_ck = torch.rand(5)
    assert torch.equal(after_plain, after_ck)


def test_preserve_rng_state_false_skips_the_replay():
    x = torch.randn(64, requires_grad=True)

    def drop(t):
        return torch.nn.functional.dropout(t, 0.5) * t

    torch.manual_seed(0)
    y = remat.checkpoint(drop, x, preserve_rng_state=False)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.manual_seed(0)
    (g_plain,) = torch.autograd.grad(drop(x).sum(), x)
    assert not torch.equal(g, g_plain)  # a fresh dropout mask was drawn in recompute


@pytest.mark.parametrize("early_stop", [True, False])
def test_three_deep_nesting(early_stop):
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)

    def inner(t):
        return torch.nn.functional.dropout(t @ w, 0.2).tanh()

    def middle(t):
        return remat.checkpoint(inner, t.sin(), early_stop=early_stop) * t

    def outer(t):
        return remat.checkpoint(middle, t.exp(), early_stop=early_stop).cos() + t

    def plain_middle(t):
        return inner(t.sin()) * t

    def plain(t):
        return plain_middle(t.exp()).cos() + t

    expected = grads(lambda: plain(x).sum(), [x, w], seed=5)
    got = grads(lambda: remat.checkpoint(outer, x, early_stop=early_stop).sum(), [x, w], seed=5)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def test_global_early_stop_switch_is_both_call_and_context_manager():
    calls = []

    def fn(t):
        a = t.sin().exp()  # exp saves its output: the last tensor saved
        calls.append(1)  # only reached by a recompute that runs to the end
        return a * 2

    x = torch.randn(4, requires_grad=True)

    def recompute_ran_to_the_end():
        y = remat.checkpoint(fn, x)
        calls.clear()
        y.sum().backward()
        return len(calls) == 1

    assert not recompute_ran_to_the_end()  # default: early stop
    with remat.set_checkpoint_early_stop(False):
        assert recompute_ran_to_the_end()
    assert not recompute_ran_to_the_end()  # the with block restored the default
    remat.set_checkpoint_early_stop(False)
    try:
        assert recompute_ran_to_the_end()
    finally:
        remat.set_checkpoint_early_stop(None)


@pytest.mark.parametrize("early_stop", [True, False])
def test_autograd_grad_inside_the_checkpointed_function(early_stop):
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(5, requires_grad=True)

    def fn(t):
        h = (t * w).sin()
        (g,) = torch.autograd.grad(h.sum(), t, create_graph=True)
        return (g * h).exp()

    expected = grads(lambda: fn(x).sum(), [x, w])
    got = grads(lambda: remat.checkpoint(fn, x, early_stop=early_stop).sum(), [x, w])
    assert_bitwise(expected[1], got[1])


def test_retain_graph_then_second_backward_gives_the_same_gradients():
    model = MLPStack(depth=3)
    x = torch.randn(4, 16, requires_grad=True)
    params = list(model.parameters())
    torch.manual_seed(2)
    loss = model(x, wrap=ck(False)).pow(2).sum()
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    assert_bitwise(first, second)
    expected = grads(lambda: model(x).pow(2).sum(), params, seed=2)[1]
    assert_bitwise(expected, first)


def test_partial_backward_over_one_output_then_the_other():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(2, 6, requires_grad=True)

    def two_heads(t):
        return (t @ w).relu().sin(), (t * 2).exp().tanh()

    a, b = two_heads(x)
    ga_plain = torch.autograd.grad(a.sum(), [x, w])
    gb_plain = torch.autograd.grad(b.sum(), x)
    a, b = remat.checkpoint(two_heads, x)
    ga = torch.autograd.grad(a.sum(), [x, w])
    gb = torch.autograd.grad(b.sum(), x)
    assert_bitwise(ga_plain, ga)
    assert_bitwise(gb_plain, gb)


def test_partial_backward_over_shared_nodes_with_retain_graph():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(2, 6, requires_grad=True)

    def two_heads(t):
        h = (t @ w).relu()
        return h.sin(), (h @ w).cos()

    a, b = two_heads(x)
    ga_plain = torch.autograd.grad(a.sum(), [x, w], retain_graph=True)
    gb_plain = torch.autograd.grad(b.sum(), [x, w])
    a, b = remat.checkpoint(two_heads, x)
    ga = torch.autograd.grad(a.sum(), [x, w], retain_graph=True)
    gb = torch.autograd.grad(b.sum(), [x, w])
    assert_bitwise(ga_plain, ga)
    assert_bitwise(gb_plain, gb)


def test_autograd_grad_with_respect_to_a_parameter_only():
    model = MLPStack(depth=2, p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    weight = model.blocks[0].up.weight
    expected = grads(lambda: model(x).sum(), [weight])[1]
    got = grads(lambda: model(x, wrap=ck(False)).sum(), [weight])[1]
    assert_bitwise(expected, got)
    assert x.grad is None


def test_backward_with_inputs_argument():
    model = MLPStack(depth=2, p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    weight = model.blocks[1].down.weight
    model(x).sum().backward(inputs=[weight])
    expected, weight.grad = weight.grad, None
    model(x, wrap=ck(False)).sum().backward(inputs=[weight])
    assert torch.equal(expected, weight.grad)
    assert model.blocks[0].up.weight.grad is None


def test_kwargs_and_nested_structures_in_and_out():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = torch.randn(2, 4, requires_grad=True)

    def fn(pair, *, scale, extra=None, mapping):
        a, b = pair
        out_a = (a @ w).tanh() * scale
        out_b = (b * mapping["z"]).sin()
        return {"a": out_a, "rest": [out_b, None, "label", (out_a * out_b, 3)]}

    z = torch.randn(2, 4, requires_grad=True)
    args = dict(scale=2.0, extra=None, mapping={"z": z})

    def loss_of(out):
        assert out["rest"][1] is None and out["rest"][2] == "label" and out["rest"][3][1] == 3
        return out["a"].sum() + out["rest"][0].pow(2).sum() + out["rest"][3][0].sum()

    expected = grads(lambda: loss_of(fn((x, y), **args)), [w, x, y, z])
    got = grads(lambda: loss_of(remat.checkpoint(fn, (x, y), **args)), [w, x, y, z])
    assert_bitwise(expected[1], got[1])


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_inputs_without_grad_still_give_parameter_gradients(use_reentrant):
    model = MLPStack(depth=3)
    x = torch.randn(4, 16)  # no requires_grad
    params = list(model.parameters())
    expected = backward_grads(lambda: model(x).sum(), params, seed=1)[1]
    if use_reentrant:
        # The reentrant variant cannot: its outputs do not require grad. It warns.
        with pytest.warns(UserWarning, match="requires grad"):
            out = remat.checkpoint(model.blocks[0], x, use_reentrant=True)
        assert not out.requires_grad
        return
    got = backward_grads(lambda: model(x, wrap=ck(False)).sum(), params, seed=1)[1]
    assert all(g is not None for g in got)
    assert_bitwise(expected, got)


@pytest.mark.parametrize("use_reentrant", VARIANTS)
def test_autocast_cpu_bfloat16(use_reentrant):
    torch.manual_seed(0)
    model, head = MLPStack(depth=3), torch.nn.Linear(16, 4)
    x = torch.randn(8, 16, requires_grad=True)
    params = [x, *model.parameters(), *head.parameters()]

    # A weight used both inside and outside a reentrant region would get two
    # separate bf16 casts (and gradient sums) instead of one: keep the head apart.
    def run(wrap):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = head(model(x, wrap=wrap))
        assert out.dtype == torch.bfloat16
        return out.float().pow(2).sum()

    expected = backward_grads(lambda: run(None), params, seed=4)
    got = backward_grads(lambda: run(ck(use_reentrant)), params, seed=4)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def test_ambient_no_grad_and_inference_mode_just_run():
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        y = remat.checkpoint(torch.sin, x)
    assert not y.requires_grad and torch.equal(y, x.sin())
    with torch.inference_mode():
        y = remat.checkpoint(torch.sin, torch.randn(3))
    assert y.is_inference()


def test_non_tensor_arguments_and_single_tensor_output():
    x = torch.randn(5, requires_grad=True)

    def fn(t, power, name, flag=None):
        assert name == "n" and flag is None
        return t.pow(power).sin()

    expected = grads(lambda: fn(x, 3, "n").sum(), [x])[1]
    got = grads(lambda: remat.checkpoint(fn, x, 3, "n").sum(), [x])[1]
    assert_bitwise(expected, got)


def test_graph_exec_group_recomputes_each_region_once():
    calls = []
    x = torch.randn(4, requires_grad=True)

    def fn(t):
        calls.append(1)
        return t.sin().exp(), t.cos().exp()

    a, b = remat.checkpoint(fn, x, early_stop=False)
    calls.clear()
    with remat.GraphExecGroup():
        (ga,) = torch.autograd.grad(a.sum(), x)
        (gb,) = torch.autograd.grad(b.sum(), x)
    assert len(calls) == 1
    a_plain, b_plain = x.sin().exp(), x.cos().exp()
    assert torch.equal(ga, torch.autograd.grad(a_plain.sum(), x)[0])
    assert torch.equal(gb, torch.autograd.grad(b_plain.sum(), x)[0])
    # Without a group each backward recomputes.
    a, b = remat.checkpoint(fn, x, early_stop=False)
    calls.clear()
    torch.autograd.grad(a.sum(), x)
    torch.autograd.grad(b.sum(), x)
    assert len(calls) == 2


def test_graph_exec_groups_cannot_nest():
    with remat.GraphExecGroup():
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with remat.GraphExecGroup():
                pass


@pytest.mark.parametrize("use_reentrant", VARIANTS)
@pytest.mark.parametrize("segments", [1, 2, 6])
def test_checkpoint_sequential(use_reentrant, segments):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*MLPStack(depth=6).blocks)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = backward_grads(lambda: model(x).sum(), params, seed=7)
    got = backward_grads(
        lambda: remat.checkpoint_sequential(model, segments, x, use_reentrant=use_reentrant).sum(),
        params,
        seed=7,
    )
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def test_checkpoint_sequential_with_multi_input_stages():
    w = torch.randn(4, 4, requires_grad=True)

    def stage(a, b):
        return (a @ w).tanh(), (b * a).sin()

    x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    stages = [stage] * 4

    def plain():
        a, b = x, y
        for s in stages:
            a, b = s(a, b)
        return a.sum() + b.sum()

    def ckpt():
        a, b = remat.checkpoint_sequential(stages, 2, (x, y), unpack_tuples=True)
        return a.sum() + b.sum()

    assert_bitwise(grads(plain, [w, x, y])[1], grads(ckpt, [w, x, y])[1])
