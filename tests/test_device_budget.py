"""Budgets of what a CUDA device has free: ``"free"``, ``"free-4GiB"``, ``"free-20%"``.

The device's memory is faked here (``torch.cuda``'s queries patched), so the arithmetic and the plan's
statement are tested on any machine; tests/test_gpu.py plans with one on a real GPU.
"""

import pytest
import torch

import remat
from remat.planning.basics.memory import budget_on_device
from remat.planning.basics.units import FREE_MARGIN, Budget, parse_budget
from remat.planning.solve.solver import plan_from_profile

GiB = 1 << 30


def test_free_budgets_are_read():
    assert parse_budget("free") == Budget(free=True, margin_fraction=FREE_MARGIN, text="free")
    assert parse_budget("free-4GiB").margin_bytes == 4 * GiB
    assert parse_budget("free - 20%").margin_fraction == pytest.approx(0.2)
    assert parse_budget("free-0").margin_bytes == 0
    for bad, words in (("free-x", "cannot read 'free-x' as a budget"), ("free-100%", "under 100%"),
                       ("free-50", "write the margin with its unit (free-50GiB) or as a share of the device"),
                       ("freedom", "what the device has free (free, free-4GiB, free-20%)")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_budget(bad)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of 80 GiB: 30 GiB free, 2 GiB reserved by PyTorch's allocator of which 0.5 GiB unused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (30 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 3 * GiB // 2)


def test_free_is_what_the_device_can_give_the_step_less_the_margin(fake_gpu):
    resident = 5 * GiB  # the model's parameters and buffers, on the device already and counted in a plan's peak
    default = budget_on_device(parse_budget("free"), "cuda:0", resident)
    assert default.nbytes == 30 * GiB + GiB // 2 + resident - 8 * GiB  # margin: 10% of 80 GiB
    four = budget_on_device(parse_budget("free-4GiB"), "cuda", resident)
    assert four.nbytes == 30 * GiB + GiB // 2 + resident - 4 * GiB
    assert "30.5 GiB free on cuda:0" in default.text and "8.0 GiB margin" in default.text
    with pytest.raises(ValueError, match="no more than the 40.0 GiB margin") as refused:
        budget_on_device(parse_budget("free-40GiB"), "cuda:0", resident)
    assert "\n" not in str(refused.value)
    assert budget_on_device(parse_budget("50%"), "cuda:0", resident) == parse_budget("50%")


def test_a_free_budget_on_a_cpu_profile_is_refused_in_one_line():
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                      torch.nn.Linear(128, 32)) for _ in range(3)))
    prof = remat.profile(model, torch.randn(64, 32), loss_fn=lambda y: y.square().mean(), ops=False)
    with pytest.raises(ValueError, match="what a CUDA device has free, and this profile ran on cpu") as refused:
        prof.plan("free")
    assert "\n" not in str(refused.value)


def test_the_plan_states_the_free_budget_it_was_made_for():
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                      torch.nn.Linear(128, 32)) for _ in range(3)))
    prof = remat.profile(model, torch.randn(64, 32), loss_fn=lambda y: y.square().mean(), ops=False)
    stated = "free: 30.5 GiB free on cuda:0 with 5.0 GiB of parameters and buffers, less a 8.0 GiB margin"
    plan = plan_from_profile(prof, Budget(nbytes=prof.peak_bytes, text=stated))
    assert plan.meta["budget"] == stated and stated in str(plan)
    assert "budget" not in plan_from_profile(prof, 0.9).meta
