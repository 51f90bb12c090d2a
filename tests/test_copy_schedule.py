"""A plan whose kept blocks move saved tensors runs its copies under a schedule: bounded at block starts (drains), not
by the engine's window; brought back by bytes, a block or two ahead.  The engine's pieces on the fake device, the
timeline's, and a plan that installs them: bitwise in training, its peak never above the prediction, its file
round trip, nothing left installed after ``remove``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from fake_device import FakeDevice
from helpers import assert_bitwise, gpt_case

import remat
from remat.models import GPTConfig, synthetic_batch
from remat.planning.choices.keptoffload import keep_offload_options
from remat.planning.choices.options import BlockOption, _checkpoint_offload, copy_schedule
from remat.planning.measure.copies import MODELLED_LINK, Link
from remat.planning.measure.copyline import Copy, simulate
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import plan_of, predict
from remat.policies.hostcopy import use_device_model

CFG = GPTConfig(n_layers=4, d_model=256, n_heads=2, seq_len=128, vocab_size=512, dropout=0.0)
SIZE = 1 << 20


def _window(engine) -> int:
    return sum(window.nbytes for window in engine._out.values())


def test_a_drain_waits_for_the_oldest_copies_until_within_its_bytes_and_lets_go_of_finished_ones():
    fake = FakeDevice(d2h_bytes_per_s=float(SIZE))  # a second per tensor
    with use_device_model("cpu", fake) as engine:
        kept = [torch.randn(SIZE // 4) for _ in range(3)]
        handles = [engine.stash(t, hold_in_flight=True, limit=math.inf) for t in kept]
        assert not fake.calls("host waits") and _window(engine) == 3 * SIZE  # no limit: nothing waited
        engine.drain(SIZE)
        assert fake.now == pytest.approx(2.0) and _window(engine) == SIZE  # the two oldest copies completed
        assert handles[0].in_flight is None and handles[2].in_flight is not None  # the held one let go
        fake.advance()
        waits = len(fake.calls("host waits"))
        engine.drain(0)  # complete already: let go without a wait
        assert _window(engine) == 0 and len(fake.calls("host waits")) == waits


def test_copies_a_plan_bounds_do_not_make_the_windows_other_copies_wait():
    fake = FakeDevice(d2h_bytes_per_s=float(SIZE))
    with use_device_model("cpu", fake) as engine:
        engine.in_flight_limit = 2 * SIZE
        scheduled = [engine.stash(torch.randn(SIZE // 4), hold_in_flight=True, limit=math.inf) for _ in range(4)]
        engine.stash(torch.randn(SIZE // 4))  # under the window's limit: only unbounded bytes ahead of it
        assert not fake.calls("host waits") and len(scheduled) == 4
        engine.stash(torch.randn(SIZE // 4))
        engine.stash(torch.randn(SIZE // 4))  # three bounded copies in flight: the oldest copy must complete
        assert fake.calls("host waits")


@pytest.mark.parametrize(("ahead", "brought"), [(None, 1), (SIZE, 1), (3 * SIZE, 2)])
def test_a_tensor_starts_back_once_any_fetch_is_within_its_plans_reach(ahead, brought):
    fake = FakeDevice(d2h_bytes_per_s=float("inf"), h2d_bytes_per_s=float(SIZE))
    with use_device_model("cpu", fake) as engine:
        tensors = [torch.randn(SIZE // 4) for _ in range(3)]
        first = engine.stash(tensors[0], ahead=ahead)  # a plan's, reaching ``ahead`` bytes
        middle = engine.stash(tensors[1])
        last = engine.stash(tensors[2])
        engine.release_held()
        fake.advance()
        back = len([c for c in fake.copies if not c.to_host])
        assert torch.equal(engine.fetch(last, prefetch=1), tensors[2])  # depth 1: the one saved just before it
        started = [c for c in fake.copies if not c.to_host][back:]
        # the fetched one, the one before it, and the first once the fetch is within its reach (2 MiB away)
        assert len(started) == 1 + brought and middle.on_device is not None
        assert (first.on_device is not None) == (brought == 2)


def test_the_timeline_bounds_each_block_start_by_its_drain_and_counts_what_is_back_ahead():
    link = Link(1e9, 1e9)  # 1 ms per MB each way
    copies = [[Copy(1.0, 0.5, 3 * 10**6, scheduled=True)], [], [], []]
    free = simulate([1e-3] * 4, [0.0] * 4, copies, link, 0, ahead=3 * 10**6, drains=[None, *[1 << 62] * 3], turn=0)
    # 3 ms of copy behind 1 ms forwards: in flight at the next blocks' starts, complete as forward ends
    assert free.forward_wait == 0.0 and free.after == (0, 3 * 10**6, 3 * 10**6, 3 * 10**6) and free.held == 0
    bound = simulate([1e-3] * 4, [0.0] * 4, copies, link, 0, ahead=3 * 10**6, drains=[None, 0, 0, 0], turn=0)
    assert bound.forward_wait == pytest.approx(3e-3) and bound.after == (0, 0, 0, 0)  # block 1 waits it all
    late = simulate([1e-3] * 4, [0.0] * 4, copies, link, 0, ahead=3 * 10**6, drains=[None, *[1 << 62] * 3], turn=None)
    assert late.held == 3 * 10**6 and late.wait == 0.0  # no drain at the end: held into backward, no round trip
    # backward: nothing fetches before block 0's, whose tensor comes back then, 3 ms the compute waits for
    assert bound.back == (0, 0, 0, 0) and bound.wait - bound.forward_wait == pytest.approx(3e-3)
    chained = simulate([1e-3] * 3, [0.0] * 3, [[Copy(1.0, 0.5, 10**6, scheduled=True)]] * 2 + [[]], link, 0,
                       ahead=10**6, drains=[None, 1 << 62, 1 << 62], turn=0)
    assert chained.back == (0, 10**6, 0)  # block 1's fetch brought block 0's tensor, a block ahead
    near = simulate([1e-3] * 3, [0.0] * 3, [[Copy(1.0, 0.5, 10**6, scheduled=True)]] * 2 + [[]], link, 0,
                    ahead=10**6 - 1, drains=[None, 1 << 62, 1 << 62], turn=0)
    assert near.back == (0, 0, 0)  # out of reach: it comes back when its own block fetches it


@pytest.fixture(scope="module")
def profiled():
    model, tokens, _, loss_fn = gpt_case(CFG, 8)
    return model, remat.profile(model, tokens, loss_fn=loss_fn, repeats=1)


def _chosen(prof, kind: str) -> list[BlockOption]:
    """Kept blocks moving their two largest tensors, checkpointed blocks moving their inputs, or both alternating."""
    levels = keep_offload_options(prof, MODELLED_LINK)
    rows = prof.rows
    inputs = [_checkpoint_offload(prof, row, after)[0] for row, after in zip(rows, rows[1:])]
    chosen = [BlockOption("keep", row.own_bytes) for row in rows]
    for p in range(len(rows) - 1):
        moving = {"keep_offload": levels[p][1], "checkpoint_offload": inputs[p]}
        chosen[p] = moving[kind] if kind in moving else list(moving.values())[p % 2]
    return chosen


@pytest.fixture(scope="module")
def planned(profiled):
    model, prof = profiled
    chosen = _chosen(prof, "keep_offload")
    return model, prof, chosen, plan_of(prof, list(enumerate(chosen)), prof.peak_bytes)


def test_a_scheduled_plan_records_its_schedule_and_its_peak_counts_it(planned):
    _, prof, chosen, plan = planned
    schedule = copy_schedule(prof, chosen)
    names = [row.name for row in prof.rows]
    assert plan.copies == {"device": prof.device, "ahead": schedule.ahead, "last": names[-1],
                           "drains": dict(zip(names[1:], schedule.drains[1:], strict=True)),
                           "ends": dict(zip(names[:-1], schedule.line.before[1:], strict=True))}
    assert schedule.line.held == 0  # every copy out complete when the last block's forward ends
    assert plan.predicted_peak == predict(prof, chosen)[0] < prof.peak_bytes


_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
}


def _halve(module, args, output):
    return output * 0.5


@pytest.mark.parametrize(("kind", "optimizer"), [("keep_offload", "fused"), ("checkpoint_offload", "foreach"),
                                                  ("both", "sgd")])
def test_a_scheduled_plan_trains_bitwise_on_a_slow_fake_link_within_its_predicted_peak(profiled, kind, optimizer,
                                                                                         tmp_path):
    model, prof = profiled
    plan = plan_of(prof, list(enumerate(_chosen(prof, kind))), prof.peak_bytes)
    plan.save(str(tmp_path / "plan.json"))
    loaded = Plan.load(str(tmp_path / "plan.json"))
    assert loaded.copies == plan.copies and (loaded.copies["ahead"] is None) == (kind == "checkpoint_offload")
    model = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    fake = FakeDevice(d2h_bytes_per_s=2.0**28, h2d_bytes_per_s=2.0**28)  # far slower than the model's compute
    fixed = prof.param_bytes + prof.buffer_bytes
    with use_device_model("cpu", fake):
        loaded.apply(model)
        loaded.apply(model)  # idempotent: one set of hooks per block
        hooks = sum(len(m._remat_schedule) for m in model.blocks if hasattr(m, "_remat_schedule"))
        assert hooks == 2 * CFG.n_layers - 1  # a drain where each block but the first starts, one where each ends
        opts = [_OPTIMIZERS[optimizer](m.parameters()) for m in (plain, model)]
        for step in range(3):
            tokens, targets = synthetic_batch(CFG, 8, torch.Generator().manual_seed(step))
            results = []
            for m, opt in zip((plain, model), opts, strict=True):
                if step == 1:  # a hook of the user's on a scheduled block, for one step only
                    halving = m.blocks[1].register_forward_hook(_halve)
                def run(m=m, tokens=tokens, targets=targets):
                    F.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()).backward()
                measured = remat.measure_step(run, m).peak_above_params
                results.append([p.grad.clone() for p in m.parameters()])
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step == 1:
                    halving.remove()
            assert_bitwise(*results)
            assert measured <= plan.predicted_peak - fixed  # the drains hold the copies to what the plan counts
        assert fake.calls("host waits")  # the slow link made the drains wait
        loaded.remove(model)
    assert not any(hasattr(m, "_remat_schedule") for m in model.modules())
    assert not any(m._forward_hooks for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())
