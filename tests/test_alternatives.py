"""Plans made on purpose: the runners-up near a budget hold as the chosen plan does, and a plan chosen by name is
priced as the solver prices it."""

import pytest
import torch
import torch.nn.functional as F

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.solve.solver import predict_peak


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64, vocab_size=128, dropout=0.1)
    tokens, targets = synthetic_batch(cfg, 4, torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return build, tokens, loss_fn, remat.profile(build(), tokens, loss_fn=loss_fn, repeats=1)


def test_alternatives_are_distinct_cheapest_first_and_fit(case):
    _, _, _, prof = case
    plans = prof.alternatives("60%", count=4)
    assert len(plans) >= 2
    assert plans[0].decisions == prof.plan("60%").decisions
    shapes = [(tuple(sorted(p.decisions.items())), tuple(map(tuple, p.segments)),
               tuple(sorted((k, str(v)) for k, v in p.policies.items()))) for p in plans]
    assert len(set(shapes)) == len(plans)
    times = [p.predicted_extra_time for p in plans]
    assert times == sorted(times)
    assert all(p.predicted_peak <= plans[0].budget for p in plans)
    assert all(p.meta["model"] == "remat.models.GPT" for p in plans)  # each can be applied and checked like prof.plan's


def test_every_alternative_holds_in_training(case):
    build, tokens, loss_fn, prof = case
    for plan in prof.alternatives("60%", count=3):
        result = remat.check_plan(build, plan, tokens, loss_fn=loss_fn, steps=2, optimizer="sgd")
        assert result.grads_equal, plan.decisions
        assert result.peaks_hold, f"{plan.decisions}\n{result}"


def test_a_plan_chosen_by_name_is_priced_as_the_solver_prices_it(case):
    build, tokens, loss_fn, prof = case
    chosen = {"blocks.0": "checkpoint", "blocks.2": "save_matmuls"}
    plan = prof.price(chosen)
    assert plan.decisions == {**{r.name: "keep" for r in prof.rows}, **chosen}
    names = [plan.decisions[r.name] for r in prof.rows]
    assert plan.predicted_peak == predict_peak(prof, names)
    assert plan.budget == plan.predicted_peak
    result = remat.check_plan(build, plan, tokens, loss_fn=loss_fn, steps=2, optimizer="sgd")
    assert result.grads_equal and result.peaks_hold, str(result)


@pytest.mark.parametrize("decisions, segments, message", [
    ({"blocks.9": "checkpoint"}, (), r"no block 'blocks\.9'; its blocks are blocks\.0, blocks\.1"),
    ({"blocks.0": "teleport"}, (), r"`blocks\.0` has no option 'teleport' here; it has checkpoint, keep"),
    ({}, [["blocks.0", "blocks.2"]], r"not a run of consecutive blocks"),
    ({}, [["blocks.0", "blocks.1"]], r"cannot run as one region"),
])
def test_a_plan_chosen_by_name_refuses_what_cannot_be(case, decisions, segments, message):
    with pytest.raises(ValueError, match=message):
        case[3].price(decisions, segments)


def test_alternatives_refuse_a_budget_nothing_fits(case):
    with pytest.raises(remat.InfeasibleBudget):
        case[3].alternatives("1%")
