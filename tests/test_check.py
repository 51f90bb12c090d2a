"""remat.check_plan and `remat check`: a plan's predictions against a real training loop (memory, never time)."""

import copy
import dataclasses
import json

import pytest
import torch
from helpers import gpt_case, remat_cli
from test_cli import USER_MODULE

import remat
from remat.models import GPT, GPTConfig
from remat.planning.check import PlanCheck, StepCheck
from remat.planning.measure.overheads import Overheads

CFG = GPTConfig(n_layers=3, d_model=32, n_heads=2, seq_len=32, vocab_size=64, dropout=0.1)


@pytest.fixture(scope="module")
def case():
    model, tokens, targets, loss_fn = gpt_case(CFG, 4)

    prof = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1, ops=False)
    # Op times from a roofline and no machinery cost: the plans below depend on bytes and FLOPs only.
    prof.ops = remat.profile_ops(model, tokens, timing="estimate", overheads=Overheads(0.0, 0.0, 0.0, 0.0, 0.0))
    return model, tokens, loss_fn, prof


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_plan_that_checkpoints_some_blocks_holds_at_every_step(case, optimizer):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("checkpoint",))
    assert set(plan.decisions.values()) == {"checkpoint", "keep"}
    before = _weights(model)
    result = remat.check_plan(model, plan, tokens, loss_fn=loss_fn, steps=2, optimizer=optimizer)
    assert result.holds, str(result)
    assert [row.step for row in result.rows] == [1, 2]
    for row in result.rows:
        assert row.grads_equal and row.max_grad_diff == 0.0
        assert abs(row.peak - result.predicted_peak) <= 0.03 * result.predicted_peak
        assert row.unplanned_peak == prof.peak_above_params  # the step the plan was made from
        assert row.peak < row.unplanned_peak
    assert result.predicted_peak == plan.predicted_peak - plan.param_bytes and not result.notes
    assert result.verdict().startswith(f"the plan holds: 2 {optimizer} steps peaked within 3% of the predicted")
    # The check trains copies: the model given is left as it was, unwrapped.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(isinstance(m, remat.ActivationWrapper) for m in model.modules())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_selective_plan_holds_after_optimizer_steps(case, optimizer):
    """Op-level plans keep what they were priced to keep at every step, not only at the first."""
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("selective",))
    assert "selective" in plan.decisions.values()
    result = remat.check_plan(model, plan, tokens, loss_fn=loss_fn, steps=2, optimizer=optimizer)
    assert all(row.grads_equal for row in result.rows)
    assert result.holds, str(result)


def test_a_plan_predicting_too_little_memory_does_not_hold(case, tmp_path):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("checkpoint",))
    above = plan.predicted_peak - plan.param_bytes
    wrong = dataclasses.replace(plan, predicted_peak=plan.param_bytes + int(0.7 * above))
    path = tmp_path / "wrong.json"
    wrong.save(str(path))
    # a factory and a saved plan's path
    result = remat.check_plan(lambda: copy.deepcopy(model), str(path), tokens, loss_fn=loss_fn, steps=2)
    assert not result.holds and result.grads_equal and not result.peaks_hold
    for row in result.rows:
        assert result.peak_error(row) == pytest.approx(1 / 0.7 - 1, abs=0.01)
    verdict = result.verdict()
    assert verdict.startswith("the plan does not hold: steps 1, 2 peaked off the predicted")
    assert "(step 1: 637.8 KiB, +42.8%)" in verdict


def test_inputs_unlike_the_profiled_ones_are_named_in_a_note(case):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("checkpoint",))
    half = tokens[:2]
    result = remat.check_plan(model, plan, half, loss_fn=lambda logits: logits.float().pow(2).mean(), steps=1)
    assert not result.holds
    assert len(result.notes) == 1 and "the profile the plan was made from saw" in result.notes[0]


def test_a_plan_for_another_model_is_refused_before_training(case):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("checkpoint",))
    other = GPT(dataclasses.replace(CFG, n_layers=2))
    with pytest.raises(ValueError, match=r"^remat.Plan.apply: the plan's Block block `blocks.2` is not in this GPT"):
        remat.check_plan(other, plan, tokens, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="optimizer must be one of adamw, sgd"):
        remat.check_plan(model, plan, tokens, loss_fn=loss_fn, optimizer="lion")


@pytest.mark.parametrize("budget", [0.8, 0.6])
def test_a_stock_hf_llama_plan_holds_at_every_step(budget):
    """A transformers Llama from its stock config (tiny sizes, random weights), labels as its loss."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="use_cache=True"):
        plan = remat.plan(model, input_ids=ids, labels=ids, budget=budget, repeats=1)
    assert set(plan.decisions.values()) != {"keep"}
    result = remat.check_plan(model, plan, input_ids=ids, labels=ids, steps=3, optimizer="adamw")
    assert result.holds, str(result)
    assert all(abs(row.peak - result.predicted_peak) <= 0.03 * result.predicted_peak for row in result.rows)


def test_differing_gradients_fail_the_verdict():
    rows = [StepCheck(1, 100, 200, 0.02, 0.01, True, 0.0), StepCheck(2, 100, 200, 0.02, 0.01, False, 2.5e-3)]
    result = PlanCheck(rows, predicted_peak=100, predicted_extra_time=0.01, profiled_peak=200, optimizer="sgd",
                       device="cpu")
    assert result.peaks_hold and not result.grads_equal and not result.holds
    assert result.extra_time == pytest.approx(0.01) and result.extra_time_error == pytest.approx(0.0)
    assert result.verdict() == ("the plan does not hold: gradients differ from the unplanned model's at step 2 "
                                "(max |Δ| 0.0025); extra time 10.0 ms per step vs 10.0 ms predicted (+0%)")
    assert "max |Δ| 0.0025" in str(result)


# ---- the command --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planned_user_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("user")
    (path / "usermodel.py").write_text(USER_MODULE)
    out = remat_cli("plan", "usermodel:build", "--inputs", "usermodel:batch", "--budget", "60%", "--allow",
                    "checkpoint", "-o", "plan.json", cwd=path)
    assert out.returncode == 0, out.stderr
    assert "checkpoint" in json.loads((path / "plan.json").read_text())["decisions"].values()
    return path


def test_the_check_command_prints_the_table_and_a_verdict(planned_user_module):
    out = remat_cli("check", "usermodel:build", "--plan", "plan.json", "--inputs", "usermodel:batch", "--steps", "2",
                    "--optimizer", "sgd", cwd=planned_user_module)
    assert out.returncode == 0, out.stdout + out.stderr
    for header in ("step", "peak predicted", "peak measured", "peak unplanned", "time predicted", "time measured",
                   "time unplanned", "grads equal"):
        assert header in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("the plan holds: 2 sgd steps peaked within 3% of the predicted"), out.stdout


def test_the_check_command_exits_1_when_the_plan_does_not_hold(planned_user_module, tmp_path):
    data = json.loads((planned_user_module / "plan.json").read_text())
    data["predicted_peak"] = data["param_bytes"] + int(0.7 * (data["predicted_peak"] - data["param_bytes"]))
    (tmp_path / "wrong.json").write_text(json.dumps(data))
    out = remat_cli("check", "usermodel:build", "--plan", str(tmp_path / "wrong.json"), "--input-shape", "512,16",
                    "--steps", "1", cwd=planned_user_module)
    assert out.returncode == 1, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("the plan does not hold: step 1 peaked off")


def test_a_missing_plan_file_is_one_line_and_exit_2(planned_user_module):
    out = remat_cli("check", "usermodel:build", "--plan", "missing.json", "--input-shape", "512,16",
                    cwd=planned_user_module)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "remat check: error: cannot read the plan missing.json (No such file or directory); make one with "
        "`remat plan ... -o missing.json`"]


def test_the_check_command_has_help_with_examples():
    out = remat_cli("check", "--help", cwd=None)
    assert out.returncode == 0 and "examples:" in out.stdout and "usage: remat check" in out.stdout


def test_a_loss_that_is_nan_with_and_without_the_plan_is_reported_as_such(case):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.6, allow=("checkpoint",))

    def nan_loss(logits):  # every gradient NaN, in both copies alike
        return loss_fn(logits) * float("nan")

    result = remat.check_plan(model, plan, tokens, loss_fn=nan_loss, steps=2, optimizer="sgd")
    assert all(row.grads_equal and row.max_grad_diff == 0.0 for row in result.rows)
    assert result.losses_equal and result.holds
    verdict = result.verdict()
    assert "gradients differ" not in verdict and "max |Δ| 0" not in verdict
    assert "without the plan too the loss is nan from step 1: the training diverges" in verdict


def test_a_loss_that_differs_or_is_nan_only_under_the_plan_is_named_before_gradients():
    rows = [StepCheck(1, 100, 200, 0.02, 0.01, True, 0.0, loss=2.5, unplanned_loss=2.5),
            StepCheck(2, 100, 200, 0.02, 0.01, False, 1e-3, loss=2.25, unplanned_loss=2.0),
            StepCheck(3, 100, 200, 0.02, 0.01, False, float("inf"), loss=float("nan"), unplanned_loss=1.5)]
    result = PlanCheck(rows, predicted_peak=100, predicted_extra_time=0.01, profiled_peak=200, optimizer="sgd",
                       device="cpu")
    assert not result.losses_equal and not result.holds
    assert result.verdict().startswith(
        "the plan does not hold: under the plan the loss is nan at step 3 where without it it is 1.5; the loss "
        "differs from the unplanned model's at step 2 (step 2: 2.25 vs 2); gradients differ from the unplanned "
        "model's at steps 2, 3 (max |Δ| inf)")


def test_gradients_nan_in_the_same_places_are_equal_and_elsewhere_differ():
    from remat.planning.check import _compare

    nan = float("nan")
    assert _compare([torch.tensor([1.0, nan])], [torch.tensor([1.0, nan])]) == (True, 0.0)
    assert _compare([torch.tensor([1.0, nan])], [torch.tensor([1.5, nan])]) == (False, 0.5)
    assert _compare([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, nan])]) == (False, float("inf"))


def test_buffers_a_plan_leaves_unequal_fail_the_verdict_by_name():
    from remat.planning.check import _buffers_differ

    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4))
    planned = copy.deepcopy(plain)
    remat.apply_activation_checkpointing(planned, check_fn=lambda m: isinstance(m, torch.nn.BatchNorm1d))
    assert _buffers_differ(plain, planned) == ()
    with torch.no_grad():
        planned[2].running_mean += 1.0
    assert _buffers_differ(plain, planned) == ("2.running_mean",)
    rows = [StepCheck(1, 100, 200, 0.02, 0.01, True, 0.0, buffers_differ=("2.running_mean",))]
    result = PlanCheck(rows, predicted_peak=100, predicted_extra_time=0.01, profiled_peak=200, optimizer="sgd",
                       device="cpu")
    assert not result.holds and not result.buffers_equal
    assert "buffers differ from the unplanned model's at step 1 (2.running_mean)" in result.verdict()


def test_a_plan_over_batch_norm_leaves_its_statistics_as_plain_training_does():
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(8 * 12 * 12, 4))

    x = torch.randn(16, 3, 12, 12)
    prof = remat.profile(build(), x, loss_fn=lambda out: out.pow(2).mean(), repeats=1)
    plan = prof.price({}, segments=[["0", "1", "2"], ["3", "4", "5"]])
    result = remat.check_plan(build, plan, x, loss_fn=lambda out: out.pow(2).mean(), steps=3, optimizer="sgd")
    assert result.buffers_equal and result.holds, str(result)
