"""A region's device logic decides from the state at the region's start (CPU machines fake the accelerator)."""

import pytest
import torch

import remat


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA as the default accelerator, with a switch for whether its context is up."""
    state = {"up": True}
    if torch.cuda.is_available():
        torch.cuda.init()  # a real device's generators exist then, whatever the fake says about its context
    monkeypatch.setattr(remat.DefaultDeviceType, "_device_type", "cuda")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["up"])
    return state


def _block(x):
    return torch.nn.functional.dropout(x.sin(), 0.5, training=True).cos()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_cpu_region_runs_when_the_accelerator_was_up_before(fake_cuda, use_reentrant):
    x = torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(0)
    expected_out = _block(x)
    expected_out.sum().backward()
    expected = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    out = remat.checkpoint(_block, x, use_reentrant=use_reentrant)
    out.sum().backward()
    assert torch.equal(out, expected_out)
    assert torch.equal(x.grad, expected)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_accelerator_first_initialized_inside_the_region_is_refused(fake_cuda, use_reentrant):
    fake_cuda["up"] = False

    def starts_the_device(x):
        fake_cuda["up"] = True
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="first initialized inside"):
        remat.checkpoint(starts_the_device, x, use_reentrant=use_reentrant).sum().backward()


def test_no_rng_stash_means_no_check(fake_cuda):
    fake_cuda["up"] = False

    def starts_the_device(x):
        fake_cuda["up"] = True
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    remat.checkpoint(starts_the_device, x, preserve_rng_state=False).sum().backward()
    assert torch.equal(x.grad, x.detach().cos())


def test_the_default_device_type_without_torch_accelerator_is_cuda_where_cuda_is(monkeypatch):
    from remat.engine import replay

    monkeypatch.delattr(torch, "accelerator", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert replay._current_accelerator_type() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replay._current_accelerator_type() == "cpu"
