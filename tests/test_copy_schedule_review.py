"""A scheduled plan (kept blocks moving saved tensors, :mod:`remat.planning.solve.copyplan`) on models whose steps
differ from a plain stack of blocks: work between blocks, checkpointed blocks moving their inputs, segments.  On the
fake device nothing completes unless the host waits, the case where the engine lets go of nothing the timeline let
go of: what the plan counts must hold there too.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from fake_device import FakeDevice
from torch import nn

import remat
from remat.planning.choices.chain import segment_options
from remat.planning.choices.keptoffload import keep_offload_options
from remat.planning.choices.options import BlockOption, copy_schedule
from remat.planning.measure.copies import MODELLED_LINK, Link
from remat.planning.measure.copyline import Copy, simulate
from remat.planning.solve.solver import _smallest_peak, plan_from_profile, plan_of
from remat.policies.hostcopy import use_device_model
from remat.policies.offload import PREFETCH_DEPTH

D = 256


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Widen(nn.Module):
    """Between blocks: a transient 64 times the hidden state, freed before the next block (nothing saved)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.repeat(1, 1, 64).sum(-1, keepdim=True)


class _Net(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.widen = _Widen()
        self.out = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.blocks) - 1:
                x = self.widen(x)
        return self.out(x)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 128, D)
    prof = remat.profile(model, x, loss_fn=_loss, repeats=1, modules=[f"blocks.{i}" for i in range(4)])
    return model, x, prof


def _measured(model: nn.Module, x: torch.Tensor) -> int:
    def step() -> None:
        _loss(model(x)).backward()

    peak = remat.measure_step(step, model).peak_above_params
    model.zero_grad(set_to_none=True)
    return peak


def test_copies_held_between_blocks_stay_within_what_the_plan_counts_there(net):
    model, x, prof = net
    found = keep_offload_options(prof, MODELLED_LINK)
    chosen = [found[p][-1] if p in found else BlockOption("keep", row.own_bytes) for p, row in enumerate(prof.rows)]
    schedule = copy_schedule(prof, chosen)
    # the timeline lets go of a block's first copy at its second save: fewer bytes in flight between blocks than
    # the block moved, which the fake device (nothing completes unless waited for) would otherwise hold there
    moved = [sum(c.nbytes for c in o.copies) for o in chosen]
    assert any(schedule.line.before[p + 1] < moved[p] for p in range(len(chosen) - 1))
    plan = plan_of(prof, list(enumerate(chosen)), prof.peak_bytes)
    baseline = _measured(model, x)  # the profile's own figure differs from a measured step by a few bytes
    fake = FakeDevice(d2h_bytes_per_s=2.0**28, h2d_bytes_per_s=2.0**28)
    with use_device_model("cpu", fake):
        plan.apply(model)
        try:
            measured = max(_measured(model, x) for _ in range(2))
        finally:
            plan.remove(model)
    assert measured - baseline <= plan.predicted_peak - prof.peak_bytes


def _scheduled(prof) -> list[BlockOption]:
    found = keep_offload_options(prof, MODELLED_LINK)
    return [found[p][-1] if p in found else BlockOption("keep", row.own_bytes) for p, row in enumerate(prof.rows)]


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Sequential(*[_Block() for _ in range(4)]), nn.Linear(D, 8))
    x = torch.randn(8, 128, D)
    prof = remat.profile(model, x, loss_fn=_loss, repeats=1, modules=[f"1.{i}" for i in range(4)])
    return model, x, prof


def test_another_plan_applied_over_a_scheduled_one_leaves_no_drain_and_drains_wait_only_in_forward(stack):
    model, x, prof = stack
    chosen = _scheduled(prof)
    segment = next(o for o in segment_options(prof)[1] if o.span == 2)
    placed = [(0, chosen[0]), (1, segment), (3, chosen[3])]  # a segment's blocks run again in its recomputation
    scheduled = plan_of(prof, placed, prof.peak_bytes)
    assert scheduled.copies and scheduled.segments == [["1.1", "1.2"]]
    row = prof.rows[1]
    plain = plan_of(prof, [(1, BlockOption("checkpoint", row.held_bytes, row.checkpoint_time, row.recompute_bytes,
                                           True))], prof.peak_bytes)
    fake = FakeDevice(d2h_bytes_per_s=2.0**28, h2d_bytes_per_s=2.0**28)
    with use_device_model("cpu", fake) as engine:
        scheduled.apply(model)
        assert _hooks(model) == 2 * len(prof.rows) - 1
        drained = []
        engine.drain = lambda nbytes=0, drain=engine.drain: (drained.append(nbytes), drain(nbytes))[1]
        with torch.no_grad():
            model(x)
        assert not drained  # nothing saved, nothing to bound
        loss = _loss(model(x))
        assert len(drained) == 2 * len(prof.rows) - 1
        loss.backward()
        assert len(drained) == 2 * len(prof.rows) - 1  # none in the segment's recomputation
        plain.apply(model)
        assert _hooks(model) == 0 and not any(hasattr(m, "_remat_schedule") for m in model.modules())
        scheduled.apply(model)
        plain.remove(model)  # removing any plan of these blocks takes the schedule with it
        assert _hooks(model) == 0
    model.zero_grad(set_to_none=True)


def _engine_back(copies: list[list[Copy]], ahead: int) -> tuple[int, ...]:
    """What the engine has brought back of earlier blocks' tensors when each block's fetches end, fetching in the
    timeline's order: scheduled tensors by bytes, the others (a checkpoint's inputs) by depth."""
    with use_device_model("cpu", FakeDevice()) as engine:
        saved, tensors = [], []
        for block in copies:
            mine = []
            for c in sorted(block, key=lambda c: c.out_at):
                tensors.append(torch.zeros(c.nbytes // 4))
                mine.append((c, engine.stash(tensors[-1], check_version=True, hold_in_flight=True,
                                             limit=math.inf if c.scheduled else None,
                                             ahead=ahead if c.scheduled else None)))
            saved.append(mine)
        engine.drain(0)  # the last block's drain: nothing held into backward
        back = [0] * len(copies)
        for i in reversed(range(len(copies))):
            for c, handle in sorted(saved[i], key=lambda pair: pair[0].back_at):
                if c.scheduled:
                    engine.fetch(handle, prefetch_bytes=ahead)
                else:
                    engine.fetch(handle, PREFETCH_DEPTH)
            back[i] = sum(h.layout.nbytes for block in saved[:i] for _, h in block if h.on_device is not None)
        return tuple(back)


@pytest.mark.parametrize("seed", range(24))
def test_the_engine_brings_back_ahead_exactly_what_the_timeline_counts(seed):
    rng = random.Random(seed)
    unit = 1 << 16
    copies = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(("keep_offload", "checkpoint_offload", "keep"))
        if kind == "keep_offload":
            made = sorted(rng.random() for _ in range(rng.randint(1, 3)))
            copies.append([Copy(at, 1 - at, rng.randint(1, 4) * unit, scheduled=True) for at in made])
        else:
            copies.append([Copy(0.0, 0.0, rng.randint(1, 4) * unit)] if kind == "checkpoint_offload" else [])
    ahead = rng.randint(1, 10) * unit
    n = len(copies)
    line = simulate([1e-3] * n, [0.0] * n, copies, Link(1e9, 1e9), 1 << 40, ahead=ahead,
                    drains=[None, *[1 << 62] * (n - 1)], turn=0)
    assert _engine_back(copies, ahead) == line.back


def test_a_budget_only_kept_blocks_moving_more_than_their_forward_hides_can_meet_is_planned(net):
    _, _, prof = net
    slow = Link(1e6, 1e6)  # every level's copies outlast its block's forward: the chain's sums do not weigh them
    found = keep_offload_options(prof, slow)
    options = [[BlockOption("keep", row.own_bytes), *found.get(p, ())] for p, row in enumerate(prof.rows)]
    assert all(o.copy_time > 0 for extra in found.values() for o in extra)
    budget = _smallest_peak(prof, options)
    assert budget < prof.peak_bytes
    plan = plan_from_profile(prof, budget, options=options)  # no longer refused as "no plan fits"
    assert plan.copies and plan.predicted_peak <= budget
