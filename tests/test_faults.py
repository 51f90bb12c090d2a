"""Faults: errors in recomputation, interrupts, user hooks around checkpoints, anomaly mode."""

import traceback

import pytest
import torch
from conftest import hooks_on_stack
from helpers import MLPStack, assert_bitwise, grads

import remat


class FailsOnRecompute(torch.nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.error, self.calls, self.armed = error, 0, True

    def forward(self, x):
        self.calls += 1
        if self.calls == 2 and self.armed:
            raise self.error
        return self.lin(x).tanh()


@pytest.mark.parametrize("error", [ValueError("boom"), KeyboardInterrupt()], ids=["ValueError", "KeyboardInterrupt"])
def test_error_in_recompute_names_the_region_and_leaves_a_working_model(error):
    block = FailsOnRecompute(error)
    x = torch.randn(4, 8, requires_grad=True)
    y = remat.checkpoint(block, x)
    with pytest.raises(type(error)) as info:
        y.sum().backward()
    assert "recomputing FailsOnRecompute module" in "".join(traceback.format_exception(info.value))
    assert hooks_on_stack() is None
    block.armed = False
    expected = grads(lambda: block(x).sum(), [x, *block.parameters()])[1]
    got = grads(lambda: remat.checkpoint(block, x).sum(), [x, *block.parameters()])[1]
    assert_bitwise(expected, got)


def test_user_saved_tensor_hooks_around_checkpoints_compose():
    model = MLPStack(depth=3, p=0.2)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x).pow(2).sum(), params, seed=3)[1]

    def under_save_on_cpu():
        with torch.autograd.graph.save_on_cpu():
            return model(x, wrap=remat.checkpoint).pow(2).sum()

    def under_counting_hooks():
        seen = []

        def pack(t):
            seen.append(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x, wrap=remat.checkpoint).pow(2).sum()
        assert seen  # the region's inputs went through the user's hook
        return out

    for run in (under_save_on_cpu, under_counting_hooks):
        assert_bitwise(expected, grads(run, params, seed=3)[1])


def test_anomaly_mode_reports_the_backward_nan_with_its_forward_traceback():
    def region(t):
        return torch.sqrt(t - t.detach())  # value 0: sqrt's backward divides by zero -> inf*0 = nan

    x = torch.randn(4, requires_grad=True)
    messages = {}
    for name, run in (("plain", region), ("remat", lambda t: remat.checkpoint(region, t))):
        with pytest.warns(UserWarning) as record, torch.autograd.detect_anomaly():
            out = run(x)
            with pytest.raises(RuntimeError) as info:
                (out * 0).sum().backward()
        messages[name] = str(info.value)
        assert any("test_faults.py" in str(w.message) and "region" in str(w.message) for w in record), name
    assert "SqrtBackward0" in messages["plain"] and "nan" in messages["plain"].lower()
    assert messages["remat"] == messages["plain"]
