"""The profiler takes the models users write, and leaves them as it found them.

* ``remat.profile`` and ``remat.profile_ops`` leave parameters, buffers (batch norm's statistics and
  ``num_batches_tracked``, a buffer a forward replaces), gradients and the RNG as they were;
* an ``nn.Sequential`` with in-place activations as layers of their own, and a block that writes in place to a
  view of its input, profile and plan (their timed runs write to copies, never to a leaf);
* a model written as ``Sequential(OrderedDict(features=Sequential(...), head=Sequential(...)))`` plans layer by
  layer, as the same layers in one container do.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import remat


def _cnn(inplace: bool) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=inplace), nn.Dropout(0.2),
        nn.Flatten(), nn.Linear(16 * 12 * 12, 10))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict(keep_vars=False).items()}


def _assert_same_state(before: dict[str, torch.Tensor], model: nn.Module) -> None:
    after = model.state_dict()
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"profiling changed {changed}"


@pytest.mark.parametrize("profiler", ["profile", "profile_ops"])
def test_profiling_leaves_parameters_buffers_grads_and_rng_as_found(profiler):
    torch.manual_seed(0)
    model = _cnn(inplace=False)
    x = torch.randn(8, 3, 12, 12)
    model(x).sum().backward()  # the user's gradients, and statistics a trained model has moved
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    before = _state(model)
    assert int(model[1].num_batches_tracked) == 1
    rng = torch.get_rng_state()
    if profiler == "profile":
        remat.profile(model, x, loss_fn=lambda out: out.sum(), repeats=2)
    else:
        remat.profile_ops(model, x, repeats=2)
    _assert_same_state(before, model)
    assert int(model[1].num_batches_tracked) == 1
    assert all(torch.equal(p.grad, grads[name]) for name, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class _Replacing(nn.Module):
    """A forward that assigns a new tensor to a buffer's name (a cache some models rebuild)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.detach().mean(0)
        return torch.relu(self.lin(x))


def test_a_buffer_a_forward_replaces_is_put_back():
    model = nn.Sequential(_Replacing(), _Replacing(), nn.Linear(8, 2))
    original = model[0].seen
    remat.profile(model, torch.randn(16, 8), loss_fn=lambda out: out.sum(), repeats=1)
    assert model[0].seen is original and not original.any()


def _holds(model_factory, x, budget) -> remat.PlanCheck:
    torch.manual_seed(0)
    prof = remat.profile(model_factory(), x, loss_fn=lambda out: out.float().pow(2).mean(), repeats=1)
    plan = prof.plan(budget)
    assert set(plan.decisions.values()) - {"keep"}, "the budget needs checkpointing: the plan must checkpoint something"
    torch.manual_seed(0)
    return remat.check_plan(model_factory, plan, x, loss_fn=lambda out: out.float().pow(2).mean(), steps=3,
                            optimizer="sgd")


def test_in_place_activations_as_layers_profile_and_plan():
    x = torch.randn(16, 3, 12, 12)
    result = _holds(lambda: _cnn(inplace=True), x, "70%")
    assert result.grads_equal
    assert result.peaks_hold, str(result)


class _WritesItsInput(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, :4].mul_(2)  # in place, on a view of the block's input (the sum of the block before: not saved)
        return torch.relu(self.lin(x)) + x


class _Stack(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_WritesItsInput(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_block_writing_in_place_to_a_view_of_its_input_profiles_and_is_never_a_region_start():
    """Such a block reruns from the input it wrote: it is kept, and a budget only its checkpoint would reach
    is refused with the reason, in one line."""
    prof = remat.profile(_Stack(), torch.randn(1024, 64), loss_fn=lambda out: out.pow(2).mean(), repeats=1)
    assert [row.writes_input for row in prof.rows] == [True] * 4
    with pytest.raises(remat.InfeasibleBudget, match=r"write in place to their inputs \(`blocks\.0`, `blocks\.1`, "
                       r"`blocks\.2` and 1 more\): write to a copy \(x = x\.clone\(\)\) in the forward of `blocks\.0`"):
        prof.plan("70%")


def _chained_writers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), _WritesItsInput(64), nn.Linear(64, 64), _WritesItsInput(64),
                         nn.Linear(64, 64), nn.Tanh())


def test_a_block_writing_to_its_input_runs_inside_a_segment_that_starts_before_it():
    x = torch.randn(1024, 64)
    prof = remat.profile(_chained_writers(), x, loss_fn=lambda out: out.pow(2).mean(), repeats=1)
    plan = prof.plan("70%")
    assert plan.segments and all(segment[0] in ("0", "2", "4") for segment in plan.segments), plan.segments
    result = remat.check_plan(_chained_writers, plan, x, loss_fn=lambda out: out.pow(2).mean(), steps=3,
                              optimizer="sgd")
    assert result.grads_equal
    assert result.peaks_hold, str(result)


def _features_and_head() -> nn.Sequential:
    return nn.Sequential(OrderedDict(
        features=nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),
        head=nn.Sequential(nn.Flatten(), nn.Linear(16 * 12 * 12, 10))))


def test_nested_containers_plan_layer_by_layer():
    x = torch.randn(32, 3, 12, 12)
    prof = remat.profile(_features_and_head(), x, loss_fn=lambda out: out.sum(), repeats=1)
    assert [row.name for row in prof.rows] == [*(f"features.{i}" for i in range(6)), "head.0", "head.1"]
    result = _holds(_features_and_head, x, "90%")
    assert result.grads_equal
    assert result.peaks_hold, str(result)


def test_repeated_sequential_stages_stay_blocks():
    """Plain containers of one structure are one block repeated: they stay the unit of the plan."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)) for _ in range(4)))
    assert [name for name, _ in remat.planning.basics.discovery.candidate_modules(model)] == ["0", "1", "2", "3"]


def _make_divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class _ConvNormActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                 activation: type[nn.Module] | None = nn.Hardswish) -> None:
        layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        super().__init__(*layers, *([activation(inplace=True)] if activation is not None else []))


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(channels, squeezed, 1), nn.Conv2d(
            squeezed, channels, 1)
        self.activation, self.scale_activation = nn.ReLU(), nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x))))) * x


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, excite: bool, hardswish: bool,
                 stride: int) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        activation = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = [] if expanded == cin else [_ConvNormActivation(cin, expanded, 1,
                                                                                   activation=activation)]
        layers.append(_ConvNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=activation))
        if excite:
            layers.append(_SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers.append(_ConvNormActivation(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.block(x)
        if self.use_res_connect:
            result += x  # in place, as torchvision writes it
        return result


class _MobileNetV3Small(nn.Module):
    """torchvision's ``mobilenet_v3_small``, layer for layer (the suite has no torchvision)."""

    SETTINGS = [(16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2), (24, 3, 88, 24, False, False, 1),
                (24, 5, 96, 40, True, True, 2), (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
                (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1), (48, 5, 288, 96, True, True, 2),
                (96, 5, 576, 96, True, True, 1), (96, 5, 576, 96, True, True, 1)]

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(_ConvNormActivation(3, 16, 3, 2),
                                      *(_InvertedResidual(*setting) for setting in self.SETTINGS),
                                      _ConvNormActivation(96, 576, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(inplace=True),
                                        nn.Dropout(0.2, inplace=True), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def test_mobilenet_v3_small_profiles_to_memtrackers_byte_and_its_plan_holds():
    """Its profile peak is MemTracker's to the byte (the same bytes as torchvision's own model, measured beside it)."""
    x = torch.randn(8, 3, 96, 96)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _MobileNetV3Small().train()

    model = build()
    prof = remat.profile(model, x, loss_fn=lambda out: out.sum(), repeats=1)
    assert [row.name for row in prof.rows] == [f"features.{i}" for i in range(1, 12)]
    model.zero_grad(set_to_none=True)
    def step() -> None:
        out = model(x)  # alive until backward ends, as in the loop the profile assumes
        out.sum().backward()

    measured = remat.measure_step(step, model).peak_above_params
    # 26,357,488 bytes: torchvision 0.29.1's own model measures 26,357,168 letting go of its 320 bytes of output
    assert prof.peak_above_params == measured
    result = remat.check_plan(build, prof.plan("70%"), x, loss_fn=lambda out: out.sum(), steps=2, optimizer="sgd")
    assert result.holds, str(result)


class _ScalesByMask(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # writes its input in place, and reads an expanded mask it cannot write to
        return torch.relu(self.lin(x)) * mask + x


def test_a_block_writing_its_input_beside_an_expanded_mask_profiles():
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(16, 16)
            self.blocks = nn.ModuleList(_ScalesByMask(16) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(1, 16).expand(x.shape[0], 16)  # stride 0 in its first dimension
            x = self.stem(x)
            for block in self.blocks:
                x = block(x, mask)
            return x

    prof = remat.profile(Masked(), torch.randn(64, 16), loss_fn=lambda out: out.sum(), repeats=1)
    assert [row.writes_input for row in prof.rows] == [True] * 3


class _Relaxed(nn.Module):
    """A gradient step inside the forward (``torch.autograd.grad(..., create_graph=True)``): its backward unpacks
    what the block saved while the profiler records it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up, self.energy, self.down = nn.Linear(width, 64), nn.Linear(64, 64), nn.Linear(64, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        (g,) = torch.autograd.grad(nn.functional.softplus(self.energy(h)).sum(), h, create_graph=True)
        return x + self.down(h - 0.1 * g)


def test_a_block_running_backward_in_its_forward_profiles_and_its_plan_holds(monkeypatch):
    """The recorder keeps nothing autograd saves; the energy's output, which the code lets go of, is needed by
    the backward inside the forward: the forward is recorded again keeping what the graph keeps."""
    from remat.planning.measure import saved

    gone = []
    unpack = saved.Unheld.unpack
    monkeypatch.setattr(saved.Unheld, "unpack", staticmethod(lambda ref: gone.append(ref() is None) or unpack(ref)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *(_Relaxed() for _ in range(3)), nn.Linear(32, 4))
    x = torch.randn(64, 16)
    prof = remat.profile(model, x, loss_fn=lambda out: out.pow(2).mean(), repeats=1)
    assert any(gone)
    plan = prof.plan(0.8, allow=("checkpoint",))
    assert "checkpoint" in plan.decisions.values()
    check = remat.check_plan(model, plan, x, loss_fn=lambda out: out.pow(2).mean(), steps=2)
    assert check.holds, check


class _ViewsItsInput(nn.Module):
    """Its first op is a view of its input, as tensor parallel's ``DTensor.from_local`` of the token ids is."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
                                      for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x.view_as(x))


def test_an_input_the_forward_views_counts_from_the_view_as_measure_step_counts_it():
    """MemTracker counts every storage an op returns, the input's under a view of it (32 KiB here, made before the
    step): the profile's peak does too, to the byte."""
    torch.manual_seed(0)
    model, x = _ViewsItsInput(), torch.randn(128, 64)
    prof = remat.profile(model, x, loss_fn=lambda out: out.pow(2).mean(), repeats=1, hold_output=False)
    model.zero_grad(set_to_none=True)
    measured = remat.measure_step(lambda: model(x).pow(2).mean().backward(), model).peak_total
    assert prof.peak_bytes == measured
