"""Models without a repeated block are planned as a chain of segments (remat.planning.choices.chain).

An ``nn.Sequential`` of Linear and GELU layers, a hand-written CNN and a U-Net-like model: the candidate units
are their children in order, and the planner checkpoints runs of consecutive children of one ``nn.Sequential``
as one region where that frees what single layers cannot.  Bytes are asserted (MemTracker is deterministic);
times only as the cost model's predictions, never measured.
"""

import copy
import itertools
import json
import random
import textwrap

import pytest
import torch
from helpers import assert_bitwise, remat_cli
from torch import nn

import remat
from remat.api.sequential import checkpoint_runs, checkpointed_runs, remove_runs
from remat.planning.basics.discovery import NoBlocks, chain_links, chain_units, resolve_blocks
from remat.planning.choices.chain import (
    chain_options,
    segment_options,
    segment_time,
    segment_transient,
    sequential_choice,
)
from remat.planning.measure.profile import ModuleProfile, SharedTensor
from remat.planning.measure.timeline import Segment
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile, predict
from remat.planning.workflow import Profile


def _mlp():
    """12 Linear+GELU layers, widths alternating as in a transformer's MLP (64 -> 256 -> 64 ...)."""
    torch.manual_seed(0)
    layers = []
    for i in range(12):
        layers += [nn.Linear(64 if i % 2 == 0 else 256, 256 if i % 2 == 0 else 64), nn.GELU()]
    return nn.Sequential(*layers), torch.randn(512, 64)


def _loss(out):
    return out.pow(2).mean()


def _cbr(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(*_cbr(3, 16), *_cbr(16, 16), nn.MaxPool2d(2), *_cbr(16, 32), *_cbr(32, 32))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.features(x))


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.block = nn.Sequential(*_cbr(cin, cout), *_cbr(cout, cout))

    def forward(self, x):
        return self.block(x)


class UNet(nn.Module):
    """Children run in order by its own forward, with skip connections between them."""

    def __init__(self):
        super().__init__()
        self.inc = DoubleConv(3, 8)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(8, 16))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(16, 32))
        self.up1 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.conv1 = DoubleConv(32, 16)
        self.up2 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.conv2 = DoubleConv(16, 8)
        self.outc = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        y = self.conv1(torch.cat([self.up1(x3), x2], 1))
        y = self.conv2(torch.cat([self.up2(y), x1], 1))
        return self.outc(y)


_profiles: dict[str, tuple] = {}


def _profiled(name):
    """Each model built and profiled once per session (profiles are read-only; tests plan on copies)."""
    if name not in _profiles:
        torch.manual_seed(0)
        model, x = {"mlp": _mlp, "cnn": lambda: (SmallCNN(), torch.randn(8, 3, 32, 32)),
                    "unet": lambda: (UNet(), torch.randn(4, 3, 32, 32))}[name]()
        _profiles[name] = model, x, remat.profile(model, x, loss_fn=_loss, repeats=2)
    return _profiles[name]


def _step(model, x):
    """MemTracker's peak above parameters and buffers of one step, and the gradients it leaves."""
    memory = remat.measure_step(lambda: _held_step(model, x), model)
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return memory.peak_above_params, grads


def _held_step(model, x):
    output = model(x)  # alive until backward ends, as in the loop the profile assumes
    _loss(output).backward()


def test_a_sequential_of_layers_is_a_chain_of_linked_units():
    model, _ = _mlp()
    assert [name for name, _ in resolve_blocks(model, None)] == [str(i) for i in range(24)]
    assert chain_links(model, [str(i) for i in range(24)]) == [True] * 23
    cnn = SmallCNN()
    names = [name for name, _ in chain_units(cnn)]
    assert names == [f"features.{i}" for i in range(13)] + ["head.0", "head.1", "head.2"]
    assert chain_links(cnn, names) == [True] * 12 + [False, True, True]  # features and head are two containers
    unet = [name for name, _ in chain_units(UNet())]
    assert unet == ["inc", "down1.0", "down1.1", "down2.0", "down2.1", "up1", "conv1", "up2", "conv2", "outc"]
    with pytest.raises(NoBlocks, match=r"modules=\[\.\.\.\]"):
        resolve_blocks(nn.Linear(4, 4), None)


def test_a_segment_of_one_block_is_its_checkpoint():
    _, _, prof = _profiled("mlp")
    for i, row in enumerate(prof.rows):
        assert segment_time(prof, i, i) == row.checkpoint_time
        assert segment_transient(prof, i, i) == row.recompute_bytes
    assert all(row.held_bytes == row.own_bytes for row in prof.rows[1:])  # a layer alone frees nothing
    assert [o.span for o in segment_options(prof)[0]] == list(range(2, 25))


@pytest.mark.parametrize("fraction", [0.5, 0.35])  # 30%: below the floor, the output held
def test_mlp_plans_hold_their_peak_with_bitwise_gradients(fraction):
    model, x, prof = _profiled("mlp")
    plan = prof.plan(fraction)
    assert plan.segments and plan.predicted_peak <= plan.budget
    _, plain_grads = _step(model, x)
    planned = plan.apply(copy.deepcopy(model))
    measured, grads = _step(planned, x)
    predicted = plan.predicted_peak - plan.param_bytes
    assert abs(measured - predicted) <= 0.03 * measured, (plan.segments, predicted, measured)
    assert_bitwise(grads, plain_grads)
    assert list(planned.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("fraction", [0.5, 0.35])  # 30%: below the floor, the output held
def test_mlp_plans_are_no_slower_than_checkpoint_sequential_at_equal_memory(fraction):
    """checkpoint_sequential at every segment count, on the same cost model (its predictions hold too)."""
    model, x, prof = _profiled("mlp")
    plan = prof.plan(fraction)
    options = chain_options(prof)
    fitting = []
    for segments in range(1, len(prof.rows) + 1):
        peak, extra = predict(prof, sequential_choice(prof, options, segments))
        if peak <= plan.predicted_peak:
            fitting.append((extra, segments))
    assert fitting, "some segment count reaches the plan's memory"
    best, segments = min(fitting)
    assert plan.predicted_extra_time <= best + len(prof.rows) * 2.0**-32
    # the comparison is fair: checkpoint_sequential's own peak is what the model predicts for it
    peak, _ = predict(prof, sequential_choice(prof, options, segments))
    copied = copy.deepcopy(model)
    memory = remat.measure_step(lambda: _held_step(lambda t: remat.checkpoint_sequential(copied, segments, t), x),
                                copied)
    assert abs(memory.peak_above_params - (peak - prof.param_bytes)) <= 0.03 * memory.peak_above_params


def test_a_plan_with_segments_saves_loads_prints_removes_and_refuses_another_model(tmp_path):
    model, x, prof = _profiled("mlp")
    plan = prof.plan(0.4)
    planned = copy.deepcopy(model)
    plan.apply(planned)
    plan.apply(planned)  # idempotent
    assert checkpointed_runs(planned) and all(not isinstance(m, remat.ActivationWrapper) for m in planned)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.segments == plan.segments and loaded.decisions == plan.decisions
    assert json.loads((tmp_path / "plan.json").read_text())["segments"] == plan.segments
    again = loaded.apply(copy.deepcopy(model))
    assert checkpointed_runs(again) == checkpointed_runs(planned)
    _, plain_grads = _step(model, x)
    assert_bitwise(_step(again, x)[1], plain_grads)
    text = str(plan)
    first = plan.segments[0]
    assert f"{first[0]}..{first[-1]}" in text and f"{len(first)} blocks as one region" in text
    assert "blocks in segments" in text
    plan.remove(planned)
    assert not checkpointed_runs(planned) and "forward" not in planned.__dict__
    with pytest.raises(ValueError, match="already checkpoint .*plan.remove"):
        remat.plan(loaded.apply(copy.deepcopy(model)), x, loss_fn=_loss, budget=0.5)
    other = nn.Sequential(*[nn.Linear(64 if i % 2 == 0 else 256, 256 if i % 2 == 0 else 64) for i in range(24)])
    with pytest.raises(ValueError, match="is a Linear here and a GELU in the plan"):
        plan.apply(other)
    broken = copy.deepcopy(plan)
    broken.meta = {}  # the class check aside: a Sequential with a forward of its own cannot hold a region
    with pytest.raises(ValueError, match="segment .* needs the model to be an nn.Sequential here"):
        broken.apply(_Custom(*copy.deepcopy(model)))


class _Custom(nn.Sequential):
    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


def test_cnn_with_batch_norm_plans_with_bitwise_gradients_and_statistics():
    model, x, prof = _profiled("cnn")
    plan = prof.plan(0.7)
    assert plan.segments
    trained, planned = copy.deepcopy(model), plan.apply(copy.deepcopy(model))
    plain_bytes, plain_grads = _step(trained, x)
    measured, grads = _step(planned, x)
    assert_bitwise(grads, plain_grads)
    assert_bitwise(list(planned.buffers()), list(trained.buffers()))  # running statistics updated once
    predicted = plan.predicted_peak - plan.param_bytes
    assert abs(measured - predicted) <= 0.03 * measured and measured < plain_bytes, (plan.segments, predicted, measured)


def _optimizer_step_then_eval(model, optimizer, x):
    """The optimizer's step, then an evaluation forward between training steps, as training loops run one."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()


def test_a_cnn_plan_trains_as_plain_autograd_step_after_step():
    """Optimizer steps and an eval forward between training steps: weights and batch-norm statistics stay
    bitwise those of the plain model, and every step's peak stays the predicted one."""
    model, x, prof = _profiled("cnn")
    plan = prof.plan(0.7)
    plain, planned = copy.deepcopy(model), plan.apply(copy.deepcopy(model))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, planned)]
    for _ in range(3):
        for m, optimizer in zip((plain, planned), optimizers):
            peak = remat.measure_step(lambda m=m: _held_step(m, x), m).peak_above_params
            if m is planned:
                assert abs(peak - (plan.predicted_peak - plan.param_bytes)) <= 0.03 * peak
            _optimizer_step_then_eval(m, optimizer, x)
        assert_bitwise(list(planned.state_dict().values()), list(plain.state_dict().values()))


def test_unet_plans_without_error():
    model, x, prof = _profiled("unet")
    plan = prof.plan(0.65)
    planned = plan.apply(copy.deepcopy(model))
    measured, grads = _step(planned, x)
    assert_bitwise(grads, _step(copy.deepcopy(model), x)[1])
    assert measured <= 1.03 * (plan.predicted_peak - plan.param_bytes)


def test_layers_that_return_their_input_never_end_a_segment():
    """nn.Identity returns its input: the profile sees no backward of its own, so no run's rerun is checked there;
    an empty nn.Sequential is no unit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Identity(), nn.Linear(256, 64), nn.GELU(), nn.Sequential(),
                          nn.Linear(64, 256), nn.Identity(), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(512, 64)
    prof = remat.profile(model, x, loss_fn=_loss, repeats=1)
    assert [row.name for row in prof.rows] == ["0", "1", "2", "3", "4", "6", "7", "8", "9"]
    runs = [(first, first + o.span - 1) for first, options in segment_options(prof).items() for o in options]
    assert runs and not {last for _, last in runs} & {2, 6}
    assert not [run for run in runs if run[0] <= 4 < run[1]]  # "4" and "6" are not neighbours in the container
    plan = prof.plan(0.7)
    measured, grads = _step(plan.apply(copy.deepcopy(model)), x)
    assert plan.segments and measured == plan.predicted_peak - plan.param_bytes
    assert_bitwise(grads, _step(model, x)[1])


class _Bottleneck(nn.Module):
    """A residual block whose input (1024 wide) is most of what it saves: alone, checkpointing it frees little."""

    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Linear(1024, 16), nn.Linear(16, 1024)

    def forward(self, x):
        return x + self.up(torch.relu(self.down(x)))


def test_repeated_blocks_in_a_sequential_are_grouped_when_that_keeps_less():
    torch.manual_seed(0)
    model, x = nn.Sequential(*[_Bottleneck() for _ in range(8)]), torch.randn(256, 1024)
    prof = remat.profile(model, x, loss_fn=_loss, repeats=1)
    assert [row.name for row in prof.rows] == [str(i) for i in range(8)]  # found as repeated blocks
    alone = plan_from_profile(prof, 1.0, options=[[o for o in choices if o.span == 1]
                                                  for choices in chain_options(prof)])
    with pytest.raises(InfeasibleBudget):
        plan_from_profile(prof, 0.6, options=[[o for o in choices if o.span == 1] for choices in chain_options(prof)])
    plan = prof.plan(0.6)
    assert plan.segments and alone.predicted_peak == prof.peak_bytes
    planned = plan.apply(copy.deepcopy(model))
    measured, grads = _step(planned, x)
    assert_bitwise(grads, _step(model, x)[1])
    assert abs(measured - (plan.predicted_peak - plan.param_bytes)) <= 0.03 * measured


def test_checkpoint_runs_keeps_keys_and_children_and_rejects_bad_runs():
    model, x = _mlp()
    keys = list(model.state_dict())
    _, plain = _step(model, x)
    checkpoint_runs(model, [(0, 5), (5, 12), (20, 22)])
    assert list(model.state_dict()) == keys and checkpointed_runs(model) == [(0, 5), (5, 12), (20, 22)]
    assert_bitwise(_step(model, x)[1], plain)
    assert torch.equal(model[0](x), remove_runs(copy.deepcopy(model))[0](x))  # a child called alone: as before
    for bad in ([(3, 3)], [(4, 8), (2, 5)], [(20, 30)]):
        with pytest.raises(ValueError, match="disjoint"):
            checkpoint_runs(model, bad)
    with pytest.raises(TypeError, match="nn.Sequential"):
        checkpoint_runs(_Custom(nn.Linear(2, 2)), [(0, 1)])
    remove_runs(model)
    assert not checkpointed_runs(model)


def _synthetic_chain(n, seed, shared):
    """A random profile of ``n`` linked blocks: bytes, prices, peaks and shared storages shaped like a timeline."""
    rng = random.Random(seed)
    rows, segments, live = [], [], 10_000
    acts, starts, peaks, saves = [], [], [], []
    for i in range(n):
        act = rng.randint(1_000, 50_000)
        held = rng.choice([act, rng.randint(100, act)])
        start = live
        peak = live + act + rng.randint(0, 4_000)
        segments.append(Segment(f"forward {i}", peak, prefix=i, start=start))
        acts.append(act)
        starts.append(start)
        peaks.append(peak)
        saves.append(live + act + rng.randint(0, peak - live - act))
        live += act
        forward = rng.uniform(1e-3, 2e-2)
        rows.append(ModuleProfile(
            name=f"{i}", cls="Layer", act_bytes=act, input_bytes=held, output_bytes=500, forward_time=forward,
            matmul_time=0.0, matmul_bytes=0, own_bytes=act, held_bytes=held, recompute_bytes=saves[i] - start,
            checkpoint_time=forward * rng.uniform(1.0, 1.3), save_matmuls_time=0.0, forward_start=start,
            forward_peak=peak, save_peak=saves[i], region_time=rng.uniform(0, 1e-3), tail_time=rng.uniform(0, 2e-3)))
    segments.append(Segment("loss", live + 2_000, prefix=n, start=live))
    for i in reversed(range(n)):
        segments.append(Segment(f"backward {i}", live + rng.randint(0, 8_000), prefix=i, block=i, start=live,
                                backward=True))
        live -= acts[i]
    storages = []
    for _ in range(shared):
        first = rng.randrange(n)
        holders = sorted(rng.sample(range(first, min(first + 3, n)), min(2, n - first)))
        storages.append(SharedTensor(
            nbytes=rng.randint(500, 6_000), saved_by=[h for h in holders if rng.random() < 0.6],
            input_of=[h for h in holders if rng.random() < 0.5], outside=rng.random() < 0.2,
            alive=[rng.random() < 0.5 for _ in segments]))
    return Profile(rows=rows, segments=segments, param_bytes=10_000, buffer_bytes=0, grad_bytes=0,
                   peak_bytes=max(s.peak for s in segments), device="cpu", step_time=0.1, shared=storages,
                   links=[rng.random() < 0.85 for _ in range(n - 1)])


def _every_chain_plan(prof, options):
    """Every choice of one option per run of blocks that covers the chain once."""
    n = len(prof.rows)

    def plans_from(p):
        if p == n:
            yield []
            return
        for option in options[p]:
            for rest in plans_from(p + option.span):
                yield [option, *rest]

    return plans_from(0)


@pytest.mark.parametrize("seed", range(5))
def test_the_chain_dp_is_the_exhaustive_optimum(seed):
    prof = _synthetic_chain(8, seed, shared=seed + 1)
    options = chain_options(prof, ("checkpoint",))
    assert any(o.span > 1 for choices in options for o in choices)
    every = [predict(prof, chosen) for chosen in _every_chain_plan(prof, options)]
    for fraction in (0.3, 0.45, 0.6, 0.8):
        budget = prof.param_bytes + int(fraction * prof.peak_above_params)
        costs = [cost for peak, cost in every if peak <= budget]
        if not costs:
            with pytest.raises(InfeasibleBudget):
                plan_from_profile(prof, budget, ("checkpoint",))
            continue
        plan = plan_from_profile(prof, budget, ("checkpoint",))
        assert plan.predicted_peak <= budget
        assert plan.predicted_extra_time == pytest.approx(min(costs), rel=1e-12, abs=1e-15)
        assert sum(len(run) for run in plan.segments) == list(plan.decisions.values()).count("segment")


def test_the_command_line_plans_a_sequential_and_names_modules_as_it_spells_them(tmp_path):
    (tmp_path / "layers.py").write_text(textwrap.dedent('''
        from torch import nn

        def mlp():
            return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())])

        def single():
            return nn.Linear(32, 32)
    '''))

    out = remat_cli("plan", "layers:mlp", "--input-shape", "256,32", "--budget", "70%", "--allow", "checkpoint",
                    cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "segment" in out.stdout and "Predicted peak" in out.stdout
    out = remat_cli("plan", "layers:single", "--input-shape", "256,32", "--budget", "50%", cwd=tmp_path)
    assert out.returncode == 2 and "--modules NAME" in out.stderr and "modules=[" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_every_option_pattern_of_a_chain_predicts_what_memtracker_measures(name):
    """Random segments, checkpoints and keeps; the CNN's ReLU outputs are shared (the next conv saves them too)."""
    model, x, prof = _profiled(name)
    options = chain_options(prof, ("checkpoint",))
    rng = random.Random(0)
    for _ in range(6):
        chosen, p = [], 0
        while p < len(prof.rows):
            option = rng.choice(options[p])
            chosen.append(option)
            p += option.span
        plan = plan_from_profile(prof, 1.0)
        starts = list(itertools.accumulate([0] + [o.span for o in chosen]))
        plan.segments = [[prof.rows[k].name for k in range(s, s + o.span)] for s, o in zip(starts, chosen)
                         if o.span > 1]
        plan.decisions = {prof.rows[k].name: o.name for s, o in zip(starts, chosen) for k in range(s, s + o.span)}
        measured, _ = _step(plan.apply(copy.deepcopy(model)), x)
        predicted = predict(prof, chosen)[0] - prof.param_bytes
        assert abs(measured - predicted) <= 0.01 * measured, (plan.segments, predicted, measured)


class _Scaled(nn.Module):
    """A layer whose Python number, activation and dropout change between calls, as a schedule changes them."""

    def __init__(self):
        super().__init__()
        self.linear, self.scale, self.act, self.drop = nn.Linear(32, 32), 1.0, nn.GELU(), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.act(self.linear(x) * self.scale))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-fused"])
def test_segments_train_as_plain_autograd_while_the_layers_change_between_steps(optimizer):
    """Each step changes what a segment runs (a scale, an activation swapped, a dropout probability, a forward
    hook added then removed, an eval forward between): loss and gradients stay bitwise plain autograd's."""
    from remat.planning.basics.optimizers import make_optimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[_Scaled() for _ in range(6)])
    plain, segmented = copy.deepcopy(model), checkpoint_runs(copy.deepcopy(model), [(0, 3), (3, 5)])
    optimizers = [make_optimizer(optimizer, list(m.parameters())) for m in (plain, segmented)]
    x = torch.randn(16, 32)
    calls = {id(plain): 0, id(segmented): 0}
    for m in (plain, segmented):
        m[0].register_forward_pre_hook(lambda mod, args, m=m: calls.__setitem__(id(m), calls[id(m)] + 1))
    for step in range(5):
        handles = []
        for m in (plain, segmented):
            m[1].scale = 1.0 + 0.5 * step
            m[2].act = nn.ReLU() if step % 2 else nn.GELU()
            m[4].drop.p = 0.1 * (step % 3)
            if step in (2, 3):  # activation steering on a layer inside a segment
                handles.append(m[3].register_forward_hook(lambda mod, args, out: out + 0.25))
        losses, grads = [], []
        for m, opt in zip((plain, segmented), optimizers):
            torch.manual_seed(100 + step)
            loss = _loss(m(x))
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in m.parameters()])
            _optimizer_step_then_eval(m, opt, x)
        for handle in handles:
            handle.remove()
        assert torch.equal(losses[0], losses[1]), step
        assert_bitwise(grads[1], grads[0])
    assert calls[id(segmented)] == calls[id(plain)] + 5  # each training step reran the first segment
