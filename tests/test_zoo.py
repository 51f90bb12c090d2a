"""The planner on real models from transformers (tiny configs, random weights).

A few models run by default; the whole zoo runs with ``REMAT_ZOO=all python -m pytest tests/test_zoo.py``.
For every model: discovery finds its natural repeated block, checkpointing every block it finds gives
gradients bitwise equal to the plain model, the profile's predictions match MemTracker within 3%, plans fit
their budget (measured within 5%), and a budget is refused only when checkpointing every block does not meet
it.
"""

import copy
import fnmatch

import pytest
import torch
import zoo
from helpers import assert_bitwise

import remat
from remat.planning.basics.discovery import candidate_modules
from remat.planning.solve.solver import InfeasibleBudget, plan_from_profile, predict_peak

MODELS = zoo.model_params()
BUDGETS = (0.3, 0.5, 0.7)

_cache: dict[str, tuple] = {}


def _case_and_profile(name):
    """Build each model and profile it once per test session (profiles are read-only)."""
    if name not in _cache:
        case = zoo.BUILDERS[name]()
        prof = remat.profile(case.model, *case.args, loss_fn=case.loss_fn, repeats=2, **case.kwargs)
        _cache[name] = case, prof
    return _cache[name]


def _measure(case, plan=None):
    """MemTracker's whole-step peak above parameters and buffers, with ``plan`` applied for the step."""
    if plan is not None:
        plan.apply(case.model)
    try:
        return zoo.peak_above_params(case)
    finally:
        if plan is not None:
            plan.remove(case.model)


def _all_checkpointed(prof):
    plan = plan_from_profile(prof, 1.0, allow=("checkpoint",))
    plan.decisions = {row.name: "checkpoint" for row in prof.rows}
    return plan


@pytest.mark.parametrize("name", MODELS)
def test_discovery_finds_the_natural_block(name):
    case = zoo.BUILDERS[name]()
    blocks = candidate_modules(case.model)
    patterns = case.block.split("|")
    assert len(blocks) == case.blocks, [n for n, _ in blocks]
    assert all(any(fnmatch.fnmatch(type(m).__name__, p) for p in patterns) for _, m in blocks), blocks
    first = blocks[0][0]
    prof = remat.profile(case.model, *case.args, loss_fn=case.loss_fn, modules=[first], repeats=1, **case.kwargs)
    assert [row.name for row in prof.rows] == [first]  # modules= overrides discovery


@pytest.mark.parametrize("name", MODELS)
def test_checkpointing_every_block_gives_bitwise_equal_gradients(name):
    case = zoo.BUILDERS[name]()
    plain = case.model
    wrapped = copy.deepcopy(plain)
    targets = {id(wrapped.get_submodule(n)) for n, _ in candidate_modules(plain)}
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: id(m) in targets)
    results = []
    for model in (plain, wrapped):
        case.model = model
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        loss = case.loss()
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert_bitwise(results[0][1], results[1][1])


@pytest.mark.parametrize("name", MODELS)
def test_predictions_match_memtracker_and_plans_fit(name):
    case, prof = _case_and_profile(name)
    params = prof.param_bytes + prof.buffer_bytes
    measured = _measure(case)
    assert abs(prof.peak_above_params - measured) <= 0.03 * measured
    everything = _all_checkpointed(prof)
    floor = _measure(case, everything)
    predicted_floor = predict_peak(prof, list(everything.decisions.values()), ("checkpoint",)) - params
    assert abs(predicted_floor - floor) <= 0.03 * floor, (predicted_floor, floor)
    for fraction in BUDGETS:
        budget = int(fraction * prof.peak_above_params)
        try:
            plan = prof.plan(fraction)
        except InfeasibleBudget as error:
            # refused only when checkpointing every block does not meet it either
            assert floor > budget, (fraction, floor, budget)
            assert error.smallest - params <= 1.03 * floor
            continue
        got = _measure(case, plan)
        assert got <= 1.05 * budget, (fraction, got, budget)
        assert abs(plan.predicted_peak - params - got) <= 0.03 * got, (fraction, plan.decisions, got)


@pytest.mark.parametrize("name", MODELS)
def test_the_smallest_reachable_peak_is_what_its_plan_measures(name):
    case, prof = _case_and_profile(name)
    params = prof.param_bytes + prof.buffer_bytes
    with pytest.raises(InfeasibleBudget) as refused:
        prof.plan("1B")  # one byte: nothing fits
    smallest = refused.value.smallest
    plan = prof.plan(smallest)
    got = _measure(case, plan)
    assert abs(smallest - params - got) <= 0.03 * got, (smallest - params, got)
