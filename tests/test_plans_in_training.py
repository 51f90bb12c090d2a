"""A plan is a promise: its predicted peak holds at every step of a training loop, and backward runs the same.

Each loop trains a planned model beside an unplanned copy from the same weights: two micro-batches per step
(gradient accumulation), an evaluation forward between steps, then the optimizer's step (SGD, foreach and
fused AdamW, which move parameters and their version counters in place).  At every step the first
micro-batch's peak (MemTracker, from gradients set to None) equals step 1's and the plan's prediction, the
second micro-batch's backward runs the same ops as at step 1, and the gradients equal the unplanned model's.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.measure.overheads import Overheads

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
}
STEPS = 4


class _OpNames(TorchDispatchMode):
    """The ops run below it, by name: what a backward recomputes (served outputs never reach it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.ops.append(str(op))
        return op(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=3, d_model=64, n_heads=4, seq_len=64, vocab_size=128, dropout=0.1)
    model = GPT(cfg)
    batches = [synthetic_batch(cfg, 4, torch.Generator().manual_seed(i)) for i in range(2 * STEPS)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    tokens, targets = batches[0]
    prof = remat.profile(model, tokens, loss_fn=lambda out: loss_fn(out, targets), repeats=1)
    # Times from a roofline with no machinery cost: the plans depend on bytes and FLOPs, not on this machine.
    prof.ops = remat.profile_ops(model, tokens, timing="estimate", overheads=Overheads(0.0, 0.0, 0.0, 0.0, 0.0))
    return model, batches, loss_fn, prof


def _micro_batch(model, batch, loss_fn, seed):
    torch.manual_seed(seed)
    tokens, targets = batch
    logits = model(tokens)  # alive until backward ends, as in the loop the profile assumes
    loss = loss_fn(logits, targets)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("budget, allow", [(0.55, ("selective",)), (0.5, ("checkpoint", "selective"))])
def test_a_plan_holds_at_every_step_of_a_training_loop(case, optimizer, budget, allow):
    model, batches, loss_fn, prof = case
    plan = prof.plan(budget, allow=allow)
    if allow == ("selective",):
        assert "selective" in plan.decisions.values()
    plain, planned = copy.deepcopy(model), plan.apply(copy.deepcopy(model))
    plain_opt, planned_opt = OPTIMIZERS[optimizer](plain.parameters()), OPTIMIZERS[optimizer](planned.parameters())
    predicted = plan.predicted_peak - plan.param_bytes
    peaks, backward_ops = [], []
    for step in range(STEPS):
        first, second = batches[2 * step], batches[2 * step + 1]
        for opt in (plain_opt, planned_opt):
            opt.zero_grad(set_to_none=True)
        expected = [_micro_batch(plain, first, loss_fn, step), _micro_batch(plain, second, loss_fn, 100 + step)]
        got = []
        peaks.append(remat.measure_step(
            lambda: got.append(_micro_batch(planned, first, loss_fn, step)), planned).peak_above_params)  # noqa: B023
        torch.manual_seed(100 + step)
        tokens, targets = second
        loss = loss_fn(planned(tokens), targets)
        with _OpNames() as names:
            loss.backward()
        got.append(loss.detach())
        backward_ops.append(names.ops)
        assert_bitwise(expected, got)
        assert_bitwise([p.grad for p in plain.parameters()], [p.grad for p in planned.parameters()])
        for net in (plain, planned):  # an evaluation forward between steps changes nothing the plan holds
            net.eval()
            with torch.no_grad():
                net(first[0])
            net.train()
        plain_opt.step()
        planned_opt.step()
    assert peaks == [peaks[0]] * STEPS, peaks
    assert abs(peaks[0] - predicted) <= 0.03 * predicted, (peaks[0], predicted)
    assert all(ops == backward_ops[0] for ops in backward_ops)
    assert_bitwise(list(plain.parameters()), list(planned.parameters()))
