"""torch.compile around and inside checkpointed regions: right gradients (graph breaks are fine)."""

import pytest
import torch

import remat


def _setup():
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def block(x):
        return torch.nn.functional.dropout(lin2(torch.nn.functional.gelu(lin1(x))), 0.2).sin()

    x = torch.randn(8, 16, requires_grad=True)
    return block, [x, lin1.weight, lin1.bias, lin2.weight]


def _grads(loss_fn, params):
    torch.manual_seed(1)
    return torch.autograd.grad(loss_fn(), params)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_checkpoint_inside_a_compiled_function(backend):
    torch._dynamo.reset()
    block, params = _setup()
    x = params[0]
    expected = _grads(lambda: block(x).sum(), params)
    compiled = torch.compile(lambda t: remat.checkpoint(block, t).sum(), backend=backend)
    got = _grads(lambda: compiled(x), params)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # eager regions inside: bitwise


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_block_inside_checkpoint(backend):
    torch._dynamo.reset()
    block, params = _setup()
    x = params[0]
    compiled = torch.compile(block, backend=backend)
    expected = _grads(lambda: compiled(x).sum(), params)  # the compiled block without checkpointing
    got = _grads(lambda: remat.checkpoint(compiled, x).sum(), params)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)
