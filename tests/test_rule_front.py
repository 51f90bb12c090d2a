"""Plans never lose to a rule they can express (every-k spread, every block, offloaded inputs), on the solver's
own cost model; checkpoint with offloaded inputs as a plan option; copies priced on a timeline.

Times here are the cost model's predictions, never measured.
"""

import importlib.util
import json
import pathlib
import random
import sys

import pytest
import torch
from torch import nn

import remat
from remat.planning.choices.baselines import rules, spread
from remat.planning.choices.chain import chain_options
from remat.planning.choices.options import block_options
from remat.planning.measure.copies import MODELLED_LINK, Link, link_for, prefetch_wait
from remat.planning.measure.copyline import Copy, simulate
from remat.planning.measure.profile import ModuleProfile
from remat.planning.measure.timeline import Segment
from remat.planning.solve.plan import _WRAPPERS
from remat.planning.solve.rulefront import front
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile, predict
from remat.planning.workflow import Profile

MIB = 1 << 20
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _profile(n, seed, device="cuda"):
    """A chain of blocks of random sizes and prices, MiB-sized (inputs of some above the offload floor)."""
    rng = random.Random(seed)
    rows, segments, live = [], [], 0
    for i in range(n):
        held = rng.choice([rng.randint(1, 64) * MIB, rng.randint(1, 900) * 1024])
        own = held + rng.randint(10, 800) * MIB
        forward = rng.uniform(0.5e-3, 4e-3)
        rows.append(ModuleProfile(
            name=f"layers.{i}", cls="Layer", act_bytes=own, input_bytes=held, output_bytes=held,
            forward_time=forward, matmul_time=0.0, matmul_bytes=0, own_bytes=own, held_bytes=held,
            recompute_bytes=own + rng.randint(0, 200) * MIB, checkpoint_time=forward * rng.uniform(0.9, 1.3),
            save_matmuls_time=float("inf")))
    for i in range(n):
        segments.append(Segment(f"forward {i}", live + rows[i].own_bytes + rng.randint(0, 50) * MIB, prefix=i,
                                start=live))
        live += rows[i].own_bytes
    segments.append(Segment("loss", live + rng.randint(100, 3000) * MIB, prefix=n, start=live))
    for i in reversed(range(n)):
        segments.append(Segment(f"backward {i}", live + rng.randint(0, 300) * MIB, prefix=i, block=i, start=live,
                                backward=True))
        live -= rows[i].own_bytes
    return Profile(rows=rows, segments=segments, param_bytes=0, buffer_bytes=0, grad_bytes=0,
                   peak_bytes=max(s.peak for s in segments), device=device, step_time=0.1)


def _dominates(rule, plan):
    return rule[0] <= plan[0] and rule[1] <= plan[1] and rule != plan


@pytest.mark.parametrize("seed", range(12))
def test_no_plan_is_dominated_by_a_rule_it_can_express(seed):
    prof = _profile(random.Random(seed).randint(2, 9), seed)
    options = chain_options(prof)
    points = [predict(prof, rule.chosen) for rule in rules(options)]
    assert any(r.name == "offloaded inputs" for r in rules(options)) or any(
        o.held_bytes < MIB for o in prof.rows[:-1])
    for budget in sorted({p for p, _ in points}) + [int(prof.peak_bytes * f) for f in (0.3, 0.5, 0.7)]:
        try:
            plan = plan_from_profile(prof, budget)
        except InfeasibleBudget:
            continue
        point = (plan.predicted_peak, plan.predicted_extra_time)
        assert point[0] <= budget
        assert not [rule for rule in points if _dominates(rule, point)], (budget, point)
    assert front(prof).dominated() == []


def test_every_k_rules_spread_the_checkpointed_blocks():
    assert spread(9, 12) == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert spread(3, 12) == [0, 4, 8] and spread(12, 12) == list(range(12)) and spread(0, 5) == []
    prof = _profile(12, 0)
    names = [rule.name for rule in rules(chain_options(prof))]
    assert names[:13] == [f"every-k {n} of 12" for n in range(13)]


def test_the_last_block_and_small_inputs_never_offload_and_the_cpu_offers_none():
    prof = _profile(6, 3)
    for row in prof.rows:
        row.held_bytes = 4 * MIB
    prof.rows[2].held_bytes = MIB - 1  # under the floor: its inputs stay
    names = [{o.name for o in choices} for choices in block_options(prof)]
    assert ["checkpoint_offload" in n for n in names] == [True, True, False, True, True, False]
    prof.device = "cpu"
    assert not any("checkpoint_offload" in {o.name for o in choices} for choices in block_options(prof))


def test_checkpoint_offload_costs_the_copy_back_the_next_blocks_backward_does_not_hide():
    prof = _profile(3, 1)
    prof.rows[0].held_bytes = 2 << 30  # 2 GiB: ~39 ms back against the next block's backward
    option = next(o for o in block_options(prof)[0] if o.name == "checkpoint_offload")
    wait = 2 * prof.rows[0].held_bytes / MODELLED_LINK.h2d / 2 - 2 * prof.rows[1].forward_time
    assert option.copy_time == pytest.approx(wait)
    assert option.extra_time == pytest.approx(prof.rows[0].checkpoint_time + wait)
    assert option.kept == 0 and option.in_flight == 2 * prof.rows[0].held_bytes


def test_the_plan_installs_checkpoint_with_offloaded_inputs():
    wrapper = _WRAPPERS["checkpoint_offload"](nn.Linear(4, 4))
    assert isinstance(wrapper, remat.CheckpointWrapper) and wrapper.checkpoint_fn.keywords["offload_inputs"] is True


def test_offloaded_inputs_are_out_before_the_loss_and_start_back_when_backward_fetches_the_next():
    link = Link(1e9, 1e9)  # a MB per millisecond
    # 4 blocks of 2 ms forward (4 ms backward); blocks 0-2 offload 6 MB inputs (6 ms each way), under a schedule that
    # lets the copies run on through forward and waits for every one of them when the last block's forward ends
    inputs = [[Copy(0.0, 0.0, 6_000_000)]] * 3 + [[]]
    drains = [None, *[1 << 62] * 3]
    line = simulate([2e-3] * 4, [0.0] * 4, inputs, link, 1 << 62, drains=drains, turn=0)
    # out back to back from 0, 6 and 12 ms: the last completes at 18 ms, 10 ms after forward ends
    assert line.forward_wait == pytest.approx(10e-3) and line.held == 0
    assert line.after == (0, 6_000_000, 12_000_000, 12_000_000)  # in flight as each block starts
    # block 2's fetch finds nothing back (6 ms) and starts blocks 1's and 0's (2 ms late each behind 4 ms backwards)
    assert line.wait - line.forward_wait == pytest.approx(10e-3)
    assert line.back == (0, 6_000_000, 12_000_000, 0)  # brought back ahead, on the device until their backward
    # a recomputation in each block's backward hides the later copies back
    rerun = simulate([2e-3] * 4, [2e-3] * 4, inputs, link, 1 << 62, drains=drains, turn=0)
    assert rerun.wait - rerun.forward_wait == pytest.approx(6e-3)
    # without the schedule the engine holds the copies still in its window into backward: no round trip
    assert simulate([2e-3] * 4, [0.0] * 4, inputs, link, 1 << 62).held == 18_000_000
    assert prefetch_wait(6_000_000, 4e-3, link) == pytest.approx(2e-3)
    assert link_for("cpu") == MODELLED_LINK and link_for("meta") == MODELLED_LINK


@pytest.fixture(scope="module")
def h200():
    spec = importlib.util.spec_from_file_location("h200_timeline", BENCHMARKS / "h200_timeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_h200_model_reproduces_the_measured_plans_and_goes_below_checkpointing_every_layer(h200, capsys):
    figures = json.loads(h200.RESULTS.read_text())
    prof, link = h200.h200_profile(figures)
    assert link.d2h == figures["bandwidth"]["D2H"]
    measured = {row["key"]: row for row in figures["rows"]}
    for key, count in (("plan-70", 6), ("plan-50", 9), ("plan-30", 12), ("remat-ckpt", 12)):
        rule = next(r for r in rules(chain_options(prof)) if r.name == f"every-k {count} of 12")
        peak, extra = predict(prof, rule.chosen)
        assert abs(peak / measured[key]["peak"] - 1) < 0.005, key
    lowest = min(front(prof).plans, key=lambda p: p.peak)
    assert lowest.peak / prof.peak_bytes <= 0.27 and "checkpoint_offload" in lowest.decisions
    assert h200.main([]) == 0
    assert "plan 30%" in capsys.readouterr().out


def test_profile_front_prints_plans_beside_rules():
    prof = _profile(4, 5)
    text = str(prof.front(budgets=(0.5,)))
    assert "every-k 4 of 4" in text and "remat" in text and "rule" in text
    assert torch.get_default_dtype() == torch.float32


def test_the_link_is_measured_once_per_process_and_kept_with_the_timings(monkeypatch, tmp_path):
    from remat.planning.measure import copies

    measured = []

    def measure(device, rounds=5):
        measured.append(device)
        return Link(40e9, 45e9)

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(copies, "measure_link", measure)
    copies._cached_link.cache_clear()
    try:
        assert copies.link_for("cuda") == copies.link_for("cuda") == Link(40e9, 45e9)
        assert len(measured) == 1
        copies._cached_link.cache_clear()  # a new process: the timings file answers
        assert copies.link_for("cuda") == Link(40e9, 45e9) and len(measured) == 1
        assert "link|" in (tmp_path / "timings.json").read_text()
    finally:
        copies._cached_link.cache_clear()


def test_at_equal_memory_the_plan_takes_the_cheaper_placement():
    prof = _profile(6, 7, device="cpu")
    for i, row in enumerate(prof.rows):  # equal bytes; the later blocks rerun faster
        # (a recomputation whose transient is small next to the loss's: it sets the peak nowhere)
        row.own_bytes, row.held_bytes, row.recompute_bytes = 300 * MIB, 2 * MIB, 50 * MIB
        row.checkpoint_time = 4e-3 if i < 3 else 1e-3
    prof.segments = [s for s in prof.segments if s.label.startswith(("forward", "backward"))]
    live = 0
    for s in prof.segments:
        if not s.backward:
            s.start, s.peak = live, live + 10 * MIB
            live += 300 * MIB
    # the loss (logits) holds more than any block: the peak is there, where every checkpointed block's bytes
    # are freed alike, wherever it sits
    prof.segments.insert(6, Segment("loss", live + 2000 * MIB, prefix=6, start=live))
    for s in prof.segments[7:]:
        s.start, s.peak = live, live + 10 * MIB
        live -= 300 * MIB
    prof.peak_bytes = max(s.peak for s in prof.segments)
    spread_rule = next(r for r in rules(chain_options(prof)) if r.name == "every-k 3 of 6")
    peak, extra = predict(prof, spread_rule.chosen)
    plan = plan_from_profile(prof, peak)
    assert plan.predicted_peak == peak and plan.predicted_extra_time < extra
    assert list(plan.decisions.values()) == ["keep"] * 3 + ["checkpoint"] * 3
