"""Scheduled plans (kept blocks moving saved tensors, their copies bounded at block starts) on random models, pushed
where they could break: random mixes of ``keep_offload`` levels with keep / checkpoint / segments, the solver's own
plans at budgets of 50-70-90%, plans made for the modelled link and for one slower than the blocks' compute (drains
other than 0), fake links from instant to far slower than compute, and what users do: eval forwards between steps, a
forward whose backward never comes, a block raising mid-step, blocks called twice per forward, plans applied twice or
over another or reloaded from a file, a deep copy of the planned model.

Every plan must train bitwise as the unplanned model (loss and gradients, three steps, SGD or AdamW between), peak at
most where it predicts at every step (MemTracker's bytes above parameters), and leave no hook behind after ``remove``.

The models are the plan fuzz's (tests/fuzz_models.py) with their batch raised until their larger saved tensors pass
:data:`~remat.planning.choices.keptoffload.MIN_TENSOR_BYTES` (smaller ones are never moved), and a small GPT.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from fake_device import FakeDevice
from fuzz_check import assignment_plan
from fuzz_models import make_case
from helpers import assert_bitwise
from torch import nn

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.choices import options as options_module
from remat.planning.choices.chain import chain_options
from remat.planning.choices.keptoffload import keep_offload_options
from remat.planning.choices.options import BlockOption
from remat.planning.measure.copies import MODELLED_LINK, Link
from remat.planning.measure.profile import StepProfile
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile
from remat.policies.hostcopy import use_device_model

LINKS = {"instant": math.inf, "moderate": 2.0 ** 32, "slow": 2.0 ** 24}
"""Fake link speeds (bytes/s each way).  The fake device's compute takes no time, so at any finite speed a copy is in
flight until a drain waits for it: the slow link leaves every copy in flight up to the next bound."""

SEEDS = (5, 7, 16, 19)
"""Fuzz models with blocks that offer ``keep_offload`` at their raised batch: shared_input, residual (linear), residual
with dropout (three levels), and a plain Sequential CNN with in-place activations."""


@dataclass
class Model:
    """A model to plan: ``build()`` gives it fresh with the same weights every call; ``batch(step)`` that step's
    inputs and loss function."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[tuple, Callable[[torch.Tensor], torch.Tensor]]]


def _fuzz_model(seed: int) -> Model:
    case = make_case(seed)
    shape = case.inputs.shape
    rows = max(shape[0], (512 << 10) // (case.inputs[0].numel() * 4))  # its larger saved tensors reach 1 MiB

    def batch(step: int) -> tuple[tuple, Callable]:
        return (torch.randn((rows, *shape[1:]), generator=torch.Generator().manual_seed(seed * 100 + step)),), \
            case.loss_fn

    return Model(str(case), case.build, batch)


GPT_CFG = GPTConfig(n_layers=3, d_model=128, n_heads=2, seq_len=128, vocab_size=64, dropout=0.0)


def _gpt() -> Model:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(GPT_CFG)

    def batch(step: int) -> tuple[tuple, Callable]:
        tokens, targets = synthetic_batch(GPT_CFG, 8, torch.Generator().manual_seed(step))
        return (tokens,), lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return Model("gpt", build, batch)


def _profile(model: Model) -> StepProfile:
    args, loss_fn = model.batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unsteady timings on a busy machine: the plans are checked anyway
        return remat.profile(model.build(), *args, loss_fn=loss_fn, repeats=1)


def _with_offload(prof: StepProfile, link: Link = MODELLED_LINK) -> list[list[BlockOption]]:
    """The chain's options with every block's ``keep_offload`` levels (priced for ``link``) appended."""
    found = keep_offload_options(prof, link)
    assert found, "the model offers no keep_offload level: raise its batch"
    return [[*choices, *found.get(p, [])] for p, choices in enumerate(chain_options(prof))]


def _random_mix(options: list[list[BlockOption]], rng: random.Random) -> list[BlockOption]:
    """One option per run of blocks: a ``keep_offload`` level where a block has one, most of the time, else any of
    its options (a segment a third of the time where one starts); at least one block offloads."""
    while True:
        chosen, p = [], 0
        while p < len(options):
            levels = [o for o in options[p] if o.name == "keep_offload"]
            segments = [o for o in options[p] if o.span > 1]
            if levels and rng.random() < 0.6:
                option = rng.choice(levels)
            elif segments and rng.random() < 0.33:
                option = rng.choice(segments)
            else:
                option = rng.choice([o for o in options[p] if o.span == 1 and o.name != "keep_offload"])
            chosen.append(option)
            p += option.span
        if any(o.name == "keep_offload" for o in chosen):
            return chosen


def _no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, f"{name} keeps a hook"
        assert not hasattr(module, "_remat_schedule"), f"{name} keeps its drain handles"


def _step(module: nn.Module, model: Model, step: int) -> Callable[[], torch.Tensor]:
    args, loss_fn = model.batch(step)  # made before the step: the profile's inputs were not counted either

    def run() -> torch.Tensor:
        torch.manual_seed(step)  # dropout draws the same in both models
        loss = loss_fn(module(*args))
        loss.backward()
        return loss.detach()

    return run


def _train(model: Model, plan: Plan, prof: StepProfile, link: float, optimizer: str, steps: int = 3,
           install: Callable[[nn.Module], Plan] | None = None,
           before: Callable[[nn.Module, int], None] | None = None) -> FakeDevice:
    """Train a planned and a plain copy of ``model`` ``steps`` steps on a fake device of ``link`` bytes/s, both ways;
    assert bitwise losses and gradients, the planned step's peak within the prediction at every step, no copy left
    in flight or unfetched after it, and nothing left installed after ``remove``.

    ``install(module)`` applies the plan (default ``plan.apply``) and returns the plan that removes it;
    ``before(module, step)`` runs on both copies before each step, on the planned one inside the measured span (what
    it leaves on the device counts against the step's peak)."""
    plain, planned = model.build(), model.build()
    make = ((lambda ps: torch.optim.SGD(ps, lr=0.05)) if optimizer == "sgd"
            else (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
    opts = [make(m.parameters()) for m in (plain, planned)]
    fixed = prof.param_bytes + prof.buffer_bytes
    fake = FakeDevice(d2h_bytes_per_s=link, h2d_bytes_per_s=link)
    with use_device_model("cpu", fake) as engine:
        installed = install(planned) if install is not None else plan.apply(planned) and plan
        for step in range(steps):
            if before is not None:
                before(plain, step)
            expected = _step(plain, model, step)()
            grads = [p.grad.clone() for p in plain.parameters()]
            box, run = [], _step(planned, model, step)

            def measured(run=run, step=step, box=box) -> None:
                if before is not None:
                    before(planned, step)
                    # no backward is coming for what it saved: nothing it moved may still be alive
                    assert engine.live == 0, f"{model.name}: a forward without backward left its graph alive"
                box.append(run())

            peak = remat.measure_step(measured, planned).peak_above_params
            assert_bitwise([expected, *grads], [box[0], *(p.grad for p in planned.parameters())])
            assert peak <= plan.predicted_peak - fixed, (f"{model.name}: step {step} peaks {peak:,} B above "
                                                         f"parameters, {plan.predicted_peak - fixed:,} predicted")
            assert sum(window.nbytes for window in engine._out.values()) == 0 and engine.live == 0
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
        installed.remove(planned)
    _no_hooks(planned)
    return fake


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(48), nn.Linear(48, 128), nn.Linear(128, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Twice(nn.Module):
    """Every block runs twice per forward, on its own output (weights tied across the two calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(16, 48), nn.Linear(48, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(block(h))
        return self.head(h)


def _twice() -> Model:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _Twice()

    def batch(step: int) -> tuple[tuple, Callable]:
        return (torch.randn(4096, 16, generator=torch.Generator().manual_seed(step)),), lambda y: y.pow(2).mean()

    return Model("twice", build, batch)


_profiles: dict[str | int, tuple[Model, StepProfile]] = {}


def _profiled(key: str | int) -> tuple[Model, StepProfile]:
    if key not in _profiles:
        model = {"gpt": _gpt, "twice": _twice}[key]() if isinstance(key, str) else _fuzz_model(key)
        _profiles[key] = (model, _profile(model))
    return _profiles[key]


def _slower_than_compute(prof: StepProfile, factor: float) -> Link:
    """A link over which the most a block moves takes ``factor`` times the longest block's forward: the plan's
    timeline leaves copies in flight at later block starts, so its drains bound them at bytes other than 0."""
    moved = max(sum(c.nbytes for c in o.copies) for levels in keep_offload_options(prof, MODELLED_LINK).values()
                for o in levels)
    rate = moved / (factor * max(row.forward_time for row in prof.rows))
    return Link(rate, rate)


@pytest.fixture(params=["modelled", "slower"])
def planning_link(request, monkeypatch) -> Callable[[StepProfile, float], Link]:
    """The link plans are made for: the modelled one (CPU blocks take far longer than their copies: every drain is
    0) or one slower than the blocks' compute (``factor``: see :func:`_slower_than_compute`), installed where the
    planner looks a device's link up."""
    def use(prof: StepProfile, factor: float) -> Link:
        link = MODELLED_LINK if request.param == "modelled" else _slower_than_compute(prof, factor)
        monkeypatch.setattr(options_module, "link_for", lambda device: link)
        return link

    return use


@pytest.mark.parametrize("key", [*SEEDS, "gpt", "twice"])
def test_random_mixes_of_offloading_kept_blocks_hold_on_every_link(key, planning_link):
    """Three random mixes per model (``keep_offload`` levels among keep / checkpoint / selective / segments), each on
    one fake link: instant with SGD, moderate with AdamW, slow with SGD (where the drains must wait)."""
    model, prof = _profiled(key)
    rng = random.Random(f"mix {key}")
    options = _with_offload(prof, planning_link(prof, 3.0))
    bounds = []
    for k, (link, optimizer) in enumerate([("instant", "sgd"), ("moderate", "adamw"), ("slow", "sgd")]):
        plan = assignment_plan(prof, _random_mix(options, rng))
        assert plan.copies, "a plan that offloads records its copy schedule"
        bounds += plan.copies["drains"].values()
        fake = _train(model, plan, prof, LINKS[link], optimizer)
        if link == "slow":
            assert fake.calls("host waits"), f"plan {k}: the slow link's copies never made a drain wait"


@pytest.mark.parametrize("key", [*SEEDS, "gpt"])
def test_the_solvers_plans_with_offloading_kept_blocks_hold(key, planning_link):
    """The solver given the ``keep_offload`` levels besides the chain's options, at 50% (slow link), 70% (moderate,
    AdamW) and 90% (instant): every plan it makes holds, whether it moves tensors or not."""
    model, prof = _profiled(key)
    options = _with_offload(prof, planning_link(prof, 0.6))  # the solver moves tensors over it
    planned = 0
    for fraction, link in ((0.5, "slow"), (0.7, "moderate"), (0.9, "instant")):
        try:
            plan = plan_from_profile(prof, fraction, options=options)
        except InfeasibleBudget:
            continue
        planned += 1
        _train(model, plan, prof, LINKS[link], "adamw" if fraction == 0.7 else "sgd")
    assert planned


def _all_offloading(prof: StepProfile, options: list[list[BlockOption]]) -> Plan:
    """Every block that can moves its most; the rest kept."""
    return assignment_plan(prof, [next((o for o in reversed(choices) if o.name == "keep_offload"), choices[0])
                                  for choices in options])


def _batches(model: Model, steps: int = 3) -> list[tuple[tuple, Callable]]:
    """Other batches than the steps', made here: the plan counts no input made in its step (the profile's was made
    before it), so neither may these."""
    return [model.batch(100 + step) for step in range(steps)]


def _eval_forward(model: Model) -> Callable[[nn.Module, int], None]:
    batches = _batches(model)

    def before(module: nn.Module, step: int) -> None:
        args, _ = batches[step]
        module.eval()
        with torch.no_grad():
            module(*args)
        module.train()

    return before


def _forward_only(model: Model) -> Callable[[nn.Module, int], None]:
    """A training forward whose backward never comes: its graph is dropped with the loss."""
    batches = _batches(model)

    def before(module: nn.Module, step: int) -> None:
        args, loss_fn = batches[step]
        torch.manual_seed(100 + step)
        loss_fn(module(*args))

    return before


def _raising_in(model: Model, block: str) -> Callable[[nn.Module, int], None]:
    """A training forward that raises inside ``block``'s last layer with weights (after its earlier ops saved their
    tensors; where it has none, as it starts), at step 1; the caller catches it, as a loop skipping a bad batch
    would."""
    batches = _batches(model)

    def before(module: nn.Module, step: int) -> None:
        if step != 1:
            return
        args, loss_fn = batches[step]
        found = module.get_submodule(block)
        leaf = [m for m in found.modules() if not list(m.children()) and list(m.parameters())][-1:] or [found]

        def fail(m: nn.Module, inputs: tuple) -> None:
            raise RuntimeError("a bad batch")

        handle = leaf[0].register_forward_pre_hook(fail)
        try:
            torch.manual_seed(100 + step)
            loss_fn(module(*args)).backward()
        except RuntimeError as error:
            assert str(error) == "a bad batch"
        finally:
            handle.remove()
        # nothing the raising block entered stays entered: no saved-tensor hooks pushed, no offloader counting calls
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        assert not any(getattr(m, "offloader", None) and m.offloader._markers for m in module.modules())

    return before


@pytest.mark.parametrize("key", ["gpt", 7])
@pytest.mark.parametrize("run", ["eval forwards", "forward only", "raises in the first block",
                                 "raises in the last block"])
def test_scheduled_plans_hold_across_forwards_that_do_not_train(key, run, planning_link):
    """An eval forward (no grad), a forward whose backward never comes, or one that raises mid-block, before each
    step: what it leaves on the device counts in the next step's measured peak, which must still hold."""
    model, prof = _profiled(key)
    plan = _all_offloading(prof, _with_offload(prof, planning_link(prof, 3.0)))
    names = [row.name for row in prof.rows]
    before = {"eval forwards": _eval_forward, "forward only": _forward_only,
              "raises in the first block": lambda m: _raising_in(m, names[0]),
              "raises in the last block": lambda m: _raising_in(m, names[-1])}[run](model)
    _train(model, plan, prof, LINKS["slow"], "adamw", before=before)


def test_a_scheduled_plan_applied_again_or_reloaded_installs_one_schedule(tmp_path, planning_link):
    """Applied over another plan, applied twice, saved, loaded and applied again on the same model: one drain per
    bounded block, and the loaded plan trains as the plan does and removes it all."""
    model, prof = _profiled("gpt")
    options = _with_offload(prof, planning_link(prof, 3.0))
    plan = _all_offloading(prof, options)
    other = assignment_plan(prof, _random_mix(options, random.Random("other")))
    path = str(tmp_path / "plan.json")

    def install(module: nn.Module) -> Plan:
        other.apply(module)
        plan.apply(module)
        plan.apply(module)
        plan.save(path)
        loaded = Plan.load(path)
        loaded.apply(module)
        ends = {*plan.copies.get("ends", {}), plan.copies["last"]}
        for name, block in module.named_modules():
            expected = (name in plan.copies["drains"]) + (name in ends)  # a drain where it starts, one where it ends
            assert len(getattr(block, "_remat_schedule", ())) == expected, name
        return loaded

    _train(model, plan, prof, LINKS["slow"], "adamw", install=install)


@pytest.mark.parametrize("hooks", [lambda: remat.offload(min_bytes=0), lambda: remat.save_on_cpu(),
                                   lambda: remat.offload(outputs_of={torch.ops.aten.mm.default: {0}})],
                         ids=["offload", "save_on_cpu", "offload_outputs_of"])
def test_a_graph_whose_backward_never_runs_is_freed_with_its_output(hooks):
    """The offloaders' hooks keep the tensors they do not move as they are (all of them on the CPU): an op's output
    among them (``exp`` saves its own) must not keep its graph alive once the output is dropped."""
    x = torch.randn(64, 64, requires_grad=True)
    with hooks():
        out = (x @ x).exp()
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_a_deep_copy_of_a_planned_model_runs_as_it_and_its_plan_comes_off_apart():
    """``copy.deepcopy`` of a model under a scheduled plan (an EMA copy, say): the copy's offloaders share the device
    type's engine, it trains as the model does, and removing the plan from it leaves the model's own installed."""
    model, prof = _profiled("gpt")
    plan = _all_offloading(prof, _with_offload(prof))

    def install(module: nn.Module) -> Plan:
        plan.apply(module)
        twin = copy.deepcopy(module)
        results = []
        for m in (module, twin):
            loss = _step(m, model, 0)()
            results.append([loss, *(p.grad for p in m.parameters())])
            m.zero_grad(set_to_none=True)
        assert_bitwise(*results)
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())
        plan.remove(twin)
        _no_hooks(twin)
        assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules()) == hooks > 0
        return plan

    _train(model, plan, prof, LINKS["slow"], "adamw", install=install)


def test_moving_a_blocks_output_frees_none_of_its_own_bytes():
    """Seed 47's residual blocks end in tanh, which saves its output: the block's output, which the next block's
    input holds anyway.  The level that moves it as well keeps what the level below it keeps (BatchNorm's statistics,
    128 B); counted as freed, it predicted a plan with the next block checkpointed 128 B under its step."""
    model, prof = _profiled(47)
    options = _with_offload(prof)
    levels = [o for o in options[1] if o.name == "keep_offload"]
    assert levels[-1].kept == levels[-2].kept > 0
    checkpoint = next(o for o in options[2] if o.name == "checkpoint")
    _train(model, assignment_plan(prof, [options[0][0], levels[-1], checkpoint]), prof, LINKS["instant"], "sgd")
