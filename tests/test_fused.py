"""Fused reruns: a followed region's refill compiled into one graph (remat.policies.fused_reruns).

With the ``eager`` backend the compiled graph runs the program's own ops, so gradients stay bitwise: that
checks the graph is the refill.  With Inductor they match to rounding (fusion reorders a reduction).
"""

import contextlib

import pytest
import torch
from helpers import assert_bitwise, grads
from test_program import Layer, _keep, llama_pair

import remat
from remat.policies import fused as fused_module
from remat.policies import fused_reruns

MM = {torch.ops.aten.mm.default}


@pytest.fixture
def compiled(monkeypatch):
    """Each graph a fused refill compiles, as the number of ops it holds (and a clean cache)."""
    monkeypatch.setattr(fused_module, "_compiled", type(fused_module._compiled)())
    seen = []
    real = fused_module._compile

    def counting(key, graph, backend):
        if key not in fused_module._compiled:
            seen.append(sum(node.op == "call_function" for node in graph.nodes))
        return real(key, graph, backend)

    monkeypatch.setattr(fused_module, "_compile", counting)
    return seen


def _stack(depth=3, width=16):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Layer(width) for _ in range(depth))
    params = list(layers.parameters())
    return layers, params


def _forward(layers, x, policy=None, backend="eager"):
    with fused_reruns(backend):
        for layer in layers:
            x = remat.checkpoint(layer, x, policy=policy) if policy is not None else layer(x)
    return x


def test_an_eager_fused_refill_is_bitwise_and_layers_share_one_graph(compiled):
    layers, params = _stack()
    x = torch.randn(4, 16, requires_grad=True)  # so the first layer saves what the others do
    params = [x, *params]
    policy = _keep(MM)
    for step in range(3):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        got = grads(lambda: _forward(layers, x, policy).sum(), params, seed=step)  # noqa: B023
        assert_bitwise(expected[1], got[1])
    assert len(compiled) == 1 and compiled[0] > 0  # three layers alike: one structure, compiled once
    assert len(fused_module._compiled) == 1


def test_inductor_fuses_the_refill_and_gradients_match_to_rounding(compiled):
    layers, params = _stack(depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep(MM)
    for step in range(2):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        got = grads(lambda: _forward(layers, x, policy, "inductor").sum(), params, seed=step)  # noqa: B023
        for a, b in zip(expected[1], got[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(compiled) == 1
    (call,) = fused_module._compiled.values()
    assert call.compiled is not None  # Inductor compiled it: no fall-back to the eager graph


class Noisy(torch.nn.Module):
    """A layer with out-of-place random ops between its matmuls (dropout as CUDA runs it)."""

    def __init__(self, draws: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.draws = draws

    def forward(self, x):
        h = torch.relu(self.up(x))
        for _ in range(self.draws):
            h = h * (torch.rand_like(h) > 0.25)
        return x + self.down(h)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_one_random_op_runs_in_the_graph_and_draws_what_forward_drew(compiled, backend):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Noisy(draws=1) for _ in range(2))
    params = list(layers.parameters())
    x = torch.randn(4, 16)
    policy = _keep({torch.ops.aten.addmm.default})
    for step in range(3):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        got = grads(lambda: _forward(layers, x, policy, backend).sum(), params, seed=step)  # noqa: B023
        assert_bitwise(expected[1], got[1])  # a wrong draw would change a mask: no tolerance would hide it
    assert len(compiled) == 1
    (call,) = fused_module._compiled.values()
    assert call.compiled is not None


def test_a_refill_with_two_random_ops_runs_op_by_op_under_the_forward_rng(compiled, monkeypatch):
    drawn = []
    real = fused_module.run
    monkeypatch.setattr(fused_module, "run", lambda program, plan, *a: drawn.append(plan.draws) or real(program, plan,
                                                                                                        *a))
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Noisy(draws=2) for _ in range(2))
    params = list(layers.parameters())
    x = torch.randn(4, 16)
    policy = _keep({torch.ops.aten.addmm.default})
    for step in range(3):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        got = grads(lambda: _forward(layers, x, policy).sum(), params, seed=step)  # noqa: B023
        assert_bitwise(expected[1], got[1])
    assert compiled == [] and drawn == [True] * 4  # both layers, in the two steps that followed their tapes


def _broken(graph, inputs):
    raise RuntimeError("this backend compiles nothing")


def test_a_graph_the_compiler_rejects_runs_op_by_op_once_warned(compiled):
    layers, params = _stack(depth=2)
    x = torch.randn(4, 16)
    policy = _keep(MM)
    with pytest.warns(UserWarning, match="failed to compile"):
        for step in range(3):
            expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
            got = grads(lambda: _forward(layers, x, policy, _broken).sum(), params, seed=step)  # noqa: B023
            assert_bitwise(expected[1], got[1])
    assert all(call.compiled is None for call in fused_module._compiled.values())


def test_backward_twice_and_outside_the_with_block_refills_fused_and_bitwise(compiled):
    layers, params = _stack(depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep(MM)
    for step in range(3):
        torch.manual_seed(step)
        expected = torch.autograd.grad(_forward(layers, x).sum(), params)
        torch.manual_seed(step)
        loss = _forward(layers, x, policy).sum()  # the backward below runs outside fused_reruns
        first = torch.autograd.grad(loss, params, retain_graph=True)
        assert_bitwise(expected, first)
        assert_bitwise(expected, torch.autograd.grad(loss, params))
    assert len(compiled) == 1


def test_under_autocast_the_fused_graph_runs_the_casts_forward_ran(compiled):
    layers, params = _stack(depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep(MM)

    def run(policy):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _forward(layers, x, policy).float().sum()

    for step in range(3):
        expected = grads(lambda: run(None), params, seed=step)
        got = grads(lambda: run(policy), params, seed=step)
        assert_bitwise(expected[1], got[1])
    assert len(compiled) == 1


def test_a_hugging_face_llama_with_sdpa_refills_from_one_graph_bitwise(compiled):
    model, reference, ids = llama_pair()
    for step in range(3):
        expected = grads(lambda: reference(input_ids=ids, labels=ids).loss, list(reference.parameters()), step)
        with fused_reruns("eager"):
            got = grads(lambda: model(input_ids=ids, labels=ids).loss, list(model.parameters()), step)
        assert_bitwise(expected[1], got[1])
    assert len(compiled) == 1 and compiled[0] > 20  # norms, rotary, SiLU and the gate product in one graph


def test_under_a_dispatch_mode_the_refill_runs_op_by_op_and_later_ones_still_fuse(compiled):
    from helpers import CountOps

    layers, params = _stack(depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep(MM)
    for step in range(4):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        counter = CountOps({torch.ops.aten.rsqrt.default})
        with counter if step == 1 else contextlib.nullcontext():
            got = grads(lambda: _forward(layers, x, policy).sum(), params, seed=step)  # noqa: B023
        assert_bitwise(expected[1], got[1])
        if step == 1:
            assert counter.count == 4  # each layer's norm, in forward and in its refill: the mode saw every op
    (call,) = fused_module._compiled.values()
    assert call.compiled is not None


def test_a_checkpoint_without_policy_reruns_its_whole_program_fused(compiled):
    layers, params = _stack(depth=3)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]

    def run(wrap):
        with fused_reruns("eager"):
            h = x
            for layer in layers:
                h = wrap(layer, h)
            return h.sum()

    for step in range(3):
        expected = grads(lambda: run(lambda layer, h: layer(h)), params, seed=step)
        got = grads(lambda: run(remat.checkpoint), params, seed=step)
        assert_bitwise(expected[1], got[1])
    assert len(compiled) == 1 and compiled[0] > 8  # the matmuls rerun in the graph too


class Signed(torch.nn.Module):
    """A layer whose rerun takes a constant that only its sign tells apart from another's."""

    def __init__(self, zero: float) -> None:
        super().__init__()
        self.lin, self.zero = torch.nn.Linear(16, 16), zero

    def forward(self, x):
        return torch.atan2(torch.full_like(x, self.zero) + 0 * self.lin(x), -torch.ones_like(x)).sin() * x


def test_constants_equal_as_numbers_but_not_as_bits_get_graphs_of_their_own(compiled):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Signed(0.0), Signed(-0.0)])
    x = torch.randn(4, 16, requires_grad=True)
    policy = _keep(MM)
    for step in range(3):
        for layer in layers:
            params = [x, *layer.parameters()]
            expected = grads(lambda: layer(x).sum(), params, seed=step)  # noqa: B023
            got = grads(lambda: _forward([layer], x, policy).sum(), params, seed=step)  # noqa: B023
            assert_bitwise(expected[1], got[1])
    assert len(compiled) == 2


def test_another_backend_gets_its_own_graph(compiled):
    layers, params = _stack(depth=1)
    x = torch.randn(4, 16, requires_grad=True)
    seen = []

    def backend(name):
        def compile_(graph, inputs):
            seen.append(name)
            return graph.forward
        return compile_

    first, second = backend("first"), backend("second")
    policy = _keep(MM)
    for chosen in (first, first, second):
        loss = _forward(layers, x, policy, chosen).sum()
        loss.backward()
    assert seen == ["first", "second"]


def test_a_flop_counter_sees_the_refill_op_by_op(compiled):
    from torch.utils.flop_counter import FlopCounterMode

    layers, params = _stack(depth=2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep(MM)
    for step in range(3):
        with FlopCounterMode(display=False) if step == 1 else contextlib.nullcontext():  # its hooks order sums
            torch.manual_seed(step)
            _forward(layers, x).sum().backward()
        expected = [p.grad for p in params]
        for p in params:
            p.grad = None
        counter = FlopCounterMode(display=False)
        with counter if step == 1 else contextlib.nullcontext():  # its module tracker hooks every module call
            torch.manual_seed(step)
            _forward(layers, x, policy).sum().backward()
        assert_bitwise(expected, [p.grad for p in params])
        for p in params:
            p.grad = None
        if step == 1:
            assert counter.get_total_flops() > 0


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_block_with_in_place_ops_and_cpu_dropout_refills_fused(compiled, backend):
    from helpers import MLPBlock

    class Block(MLPBlock):
        def forward(self, x):  # CPU dropout draws in place; the ReLU writes in place
            return x + self.drop(self.down(torch.relu_(self.up(x))))

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Block() for _ in range(2))
    params = list(layers.parameters())
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *params]
    policy = _keep({torch.ops.aten.addmm.default})
    for step in range(3):
        expected = grads(lambda: _forward(layers, x).sum(), params, seed=step)  # noqa: B023
        got = grads(lambda: _forward(layers, x, policy, backend).sum(), params, seed=step)  # noqa: B023
        assert_bitwise(expected[1], got[1])  # one draw, run as eager runs it: the mask is forward's
    assert len(compiled) == 1
    (call,) = fused_module._compiled.values()
    assert call.compiled is not None
