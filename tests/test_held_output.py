"""A plan's peak holds in the loop people write, which keeps the model's output (the logits) alive through backward.

``outputs = model(input_ids=ids, labels=ids); loss = outputs.loss; loss.backward()`` holds the logits until
backward ends.  A profile measures that loop by default, ``hold_output=False`` the loop that lets go of the output
once the loss is computed; the plan records which (saved, loaded, printed) and ``check_plan`` trains that way.
The models are small but their logits are a large share of the step: a GPT-2 from transformers' config and
remat's built-in GPT.  Peaks are MemTracker's bytes above parameters and buffers (``remat.measure_step``).
"""

import json
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from doc_models import write_mypkg
from helpers import remat_cli
from torch import nn

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.memory import measure_step
from remat.planning.check import PEAK_TOLERANCE
from remat.planning.solve.solver import plan_from_profile

transformers = pytest.importorskip("transformers")

STEPS = 3


@dataclass
class _Case:
    """A model, its inputs and its loss (None: the output's ``.loss``); ``logits`` are the output's bytes."""

    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    loss_fn: Any
    logits: int

    def loss(self, output: Any) -> torch.Tensor:
        return output.loss if self.loss_fn is None else self.loss_fn(output)

    def held_step(self) -> None:
        outputs = self.model(*self.args, **self.kwargs)  # the loop people write: alive until backward ends
        loss = self.loss(outputs)
        loss.backward()

    def dropped_step(self) -> None:
        self.loss(self.model(*self.args, **self.kwargs)).backward()  # the output gone once the loss is computed


def _gpt2(loss_fn: Any = None) -> _Case:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=8000, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    ids = torch.randint(0, 8000, (2, 64), generator=torch.Generator().manual_seed(1))
    return _Case(transformers.GPT2LMHeadModel(cfg).train(), (), {"input_ids": ids, "labels": ids}, loss_fn,
                 2 * 64 * 8000 * 4)


def _gpt() -> _Case:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=128, vocab_size=2000)
    tokens, targets = synthetic_batch(cfg, 2, torch.Generator().manual_seed(1))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return _Case(GPT(cfg), (tokens,), {}, loss_fn, 2 * 128 * 2000 * 4)


# "gpt2-no-head": the model's own loss given as loss_fn, so plans have no chunked head (whose logits are None)
_BUILDS = {"gpt2": _gpt2, "gpt2-no-head": lambda: _gpt2(lambda output: output.loss), "gpt": _gpt}
# where held logits leave the lowest budgets unreachable without the chunked head, a higher one
_PLANS = [("gpt2", 0.9), ("gpt2", 0.5), ("gpt2-no-head", 0.9), ("gpt2-no-head", 0.8), ("gpt", 0.9), ("gpt", 0.5)]
_made: dict[tuple[str, Any], tuple[_Case, remat.Profile]] = {}


def _profiled(name: str, hold_output: bool | None) -> tuple[_Case, remat.Profile]:
    """The case and its profile, made once per session; ``hold_output=None``: the profile's default."""
    if (name, hold_output) not in _made:
        case = _BUILDS[name]()
        chosen = {} if hold_output is None else {"hold_output": hold_output}
        prof = remat.profile(case.model, *case.args, loss_fn=case.loss_fn, repeats=1, **chosen, **case.kwargs)
        _made[name, hold_output] = case, prof
    return _made[name, hold_output]


def _peaks_in_training(case: _Case, plan: remat.Plan, step: Any) -> list[int]:
    """Each step's peak of a 3-step SGD loop under ``plan`` (``step``: the case's held or dropped step)."""
    model = plan.apply(case.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    peaks = []
    try:
        for _ in range(STEPS):
            peaks.append(measure_step(step, model).peak_above_params)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        plan.remove(model)
    return peaks


def _assert_within_tolerance(peaks: list[int], plan: remat.Plan) -> None:
    predicted = plan.predicted_peak - plan.param_bytes
    assert all(abs(peak - predicted) <= PEAK_TOLERANCE * predicted for peak in peaks), (peaks, predicted, plan)


@pytest.mark.parametrize("name, budget", _PLANS)
def test_a_plan_holds_in_the_loop_that_keeps_the_output_by_default(name, budget):
    case, prof = _profiled(name, None)
    plan = prof.plan(budget)
    _assert_within_tolerance(_peaks_in_training(case, plan, case.held_step), plan)
    assert plan.hold_output


@pytest.mark.parametrize("name, budget", _PLANS)
def test_a_plan_for_a_loop_that_drops_the_output_holds_there(name, budget):
    case, prof = _profiled(name, False)
    plan = prof.plan(budget)
    assert not plan.hold_output
    _assert_within_tolerance(_peaks_in_training(case, plan, case.dropped_step), plan)


@pytest.mark.parametrize("name", list(_BUILDS))
def test_the_held_step_peaks_higher_by_the_logits(name):
    case, held = _profiled(name, None)
    _, dropped = _profiled(name, False)
    assert held.hold_output and not dropped.hold_output
    assert held.peak_bytes - dropped.peak_bytes == case.logits
    measured = measure_step(case.held_step, case.model).peak_above_params
    assert abs(held.peak_above_params - measured) <= 0.001 * measured
    case.model.zero_grad(set_to_none=True)


def test_the_chunked_head_holds_no_logits_in_the_loop_that_keeps_the_output():
    """A GPT-2's plan with its output layer and loss in chunks (its output's logits are None) holds in either loop."""
    case, prof = _profiled("gpt2", None)
    _, dropped = _profiled("gpt2", False)
    assert prof.head is not None and prof.head.profile.hold_output and not dropped.head.profile.hold_output
    assert [s.peak for s in prof.head.profile.segments] == [s.peak for s in dropped.head.profile.segments]
    # a plan on the chunked head's timeline, as Profile.plan makes it where that one is cheaper (80% of its peak)
    plan = replace(plan_from_profile(prof.head.profile, 0.8), head_chunks=prof.head.chunks, meta=prof.model_meta)
    for step in (case.held_step, case.dropped_step):
        _assert_within_tolerance(_peaks_in_training(case, plan, step), plan)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.relu(self.up(x))))


class _WideLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(x))  # the model's output, which its tanh saves


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(), _Block(), _WideLast()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_output_its_last_block_saves_outlives_that_block_checkpointed():
    """The loop holds the output whatever the plan: checkpointing the block that made (and saved) it frees nothing
    of it, and its recomputation makes another copy while it is held."""
    torch.manual_seed(0)
    case = _Case(_Net(), (torch.randn(2048, 64),), {}, lambda out: out.sum(), 2048 * 1024 * 4)
    prof = remat.profile(case.model, *case.args, loss_fn=case.loss_fn, repeats=1)
    for decisions in ({"blocks.3": "checkpoint"}, {f"blocks.{i}": "checkpoint" for i in range(4)}, {}):
        plan = prof.price(decisions)
        _assert_within_tolerance(_peaks_in_training(case, plan, case.held_step), plan)


@pytest.mark.parametrize("hold_output", [True, False])
def test_check_plan_trains_in_the_loop_the_plan_assumes(hold_output):
    case, prof = _profiled("gpt2", hold_output)
    plan = prof.plan(0.9)
    result = remat.check_plan(case.model, plan, *case.args, steps=2, optimizer="sgd", **case.kwargs)
    assert result.holds, str(result)
    assert abs(result.rows[0].unplanned_peak - prof.peak_above_params) <= PEAK_TOLERANCE * prof.peak_above_params


def test_the_plan_records_its_loop_in_its_file_and_its_print(tmp_path):
    _, prof = _profiled("gpt", False)
    for plan in (prof.plan(0.9), replace(prof.plan(0.9), hold_output=True)):
        path = tmp_path / "plan.json"
        plan.save(str(path))
        assert remat.Plan.load(str(path)).hold_output is plan.hold_output
        said = "holds the model's output until backward ends" if plan.hold_output else "lets go of the model's output"
        assert said in str(plan)
    data = json.loads(path.read_text())
    del data["hold_output"]  # a file saved before plans recorded it: its profile dropped the output
    path.write_text(json.dumps(data))
    assert remat.Plan.load(str(path)).hold_output is False
    path.write_text(json.dumps({**data, "hold_output": 1}))
    with pytest.raises(remat.PlanFileError, match="field 'hold_output' is 1, not true or false"):
        remat.Plan.load(str(path))


def test_the_command_plans_and_checks_for_a_loop_that_drops_the_output(tmp_path):
    write_mypkg(tmp_path)
    for flags, held in (((), True), (("--drop-output",), False)):
        made = remat_cli("plan", "mypkg.models:build", "--inputs", "mypkg.data:batch", "--budget", "60%", *flags,
                         "-o", "plan.json", cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        assert remat.Plan.load(str(tmp_path / "plan.json")).hold_output is held
        checked = remat_cli("check", "mypkg.models:build", "--inputs", "mypkg.data:batch", "--plan", "plan.json",
                            "--steps", "1", "--optimizer", "sgd", cwd=tmp_path)
        assert checked.returncode == 0, checked.stdout + checked.stderr
