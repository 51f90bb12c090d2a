"""Plans of random models keep their promise: predicted peak within 3% of MemTracker's at every training step,
gradients bitwise equal to the unplanned model's (tests/fuzz_models.py, tests/fuzz_check.py); and their profiles
on the meta device equal their CPU profiles, to the byte.

The seeded sweep plans every model at budgets of a grid and takes random assignments of options besides; the
regression tests below pin each accounting fix the fuzz led to on a model that showed it.
"""

import pytest
import torch
from fuzz_check import assignment_plan, check_case, meta_difference
from fuzz_models import PATTERNS, make_case
from torch import nn

import remat
from remat.planning.choices.chain import chain_options, passed_on
from remat.planning.choices.options import selective_option

SEEDS = range(40)
# Random assignments take every option a block has on the CPU: checkpoint, save_matmuls, selective policies that
# keep random sets of op outputs (drawn from each block's op graph, not from its timed front: the same plans on
# every machine), and segments.
ASSIGNED = ("checkpoint", "save_matmuls", "selective")


def _loss(out):
    return out.pow(2).mean()


@pytest.mark.parametrize("first", range(SEEDS.start, SEEDS.stop, 10))
def test_fuzzed_plans_hold(first):
    """Ten random models per case; every plan holds, nothing raises, every model profiles, and its profile on the
    meta device keeps the bytes its CPU profile keeps, to the byte."""
    failures = []
    for seed in range(first, first + 10):
        result = check_case(make_case(seed), budgets=(0.3, 0.5, 0.7, 0.9), assignments=2, allow=ASSIGNED)
        if result.error:
            failures.append(f"{result.case}: cannot be profiled: {result.error}")
            continue
        failures += [f"{result.case}: {plan}" for plan in result.misses()]
        differs = meta_difference(result.case, result.profile)
        failures += [f"{result.case}: meta differs: {differs}"] if differs else []
    assert not failures, "\n".join(failures)


def test_generator_is_seeded_and_covers_the_patterns():
    seen = {make_case(seed).pattern for seed in range(80)}
    assert seen == set(PATTERNS)
    case = make_case(11)
    first, second = case.build(), case.build()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert str(make_case(11)) == str(case)


def _forced(prof, *runs):
    """The plan taking ``(first block, option name, span)`` for each run, ``keep`` elsewhere."""
    options, chosen, p = chain_options(prof), [], 0
    wanted = {first: (name, span) for first, name, span in runs}
    while p < len(options):
        name, span = wanted.get(p, ("keep", 1))
        chosen.append(next(o for o in options[p] if o.name == name and o.span == span))
        p += span
    return assignment_plan(prof, chosen)


def _holds(factory, x, prof, *runs):
    plan = _forced(prof, *runs)
    result = remat.check_plan(factory, plan, x, loss_fn=_loss, steps=2, optimizer="sgd")
    assert result.holds, str(result)
    return plan


def _dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Tanh(), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128),
                         nn.SiLU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))


def test_segment_starting_at_dropout_holds():
    """A region that starts at Dropout keeps the Dropout's input (which Dropout itself does not save: it saves
    its mask) alive through its rerun and its backward, where the plain step had freed it."""
    x = torch.randn(512, 64)
    prof = remat.profile(_dropout_mlp(), x, loss_fn=_loss, repeats=1)
    dropout = prof.rows[4]
    assert dropout.cls == "Dropout" and dropout.unsaved_held_bytes == dropout.input_bytes > 0
    assert (5, dropout.input_bytes) in dropout.released_inputs  # freed before the next layer's forward
    _holds(_dropout_mlp, x, prof, (0, "segment", 3), (4, "segment", 2), (6, "segment", 2))  # issue 38's plan
    _holds(_dropout_mlp, x, prof, (4, "segment", 4))
    _holds(_dropout_mlp, x, prof, (4, "checkpoint", 1))  # alone: the input is alive in its backward too


class _Residual(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(32, 96), act, nn.Linear(96, 32)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.blocks = nn.ModuleList(_Residual(act()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _stack_factory(act):
    def factory():
        torch.manual_seed(0)
        return _Stack(act)
    return factory


def test_save_matmuls_counts_what_it_keeps_and_what_its_rerun_is_spared():
    """The save_matmuls rule keeps every matmul output no later op of the block overwrites, ``down``'s too (after
    the block's last saved tensor, freed at once without a plan), and its recomputation is served the ones it
    reruns to (``up``'s), holding that much less than checkpoint's."""
    factory, x = _stack_factory(nn.Tanh), torch.randn(256, 32)
    prof = remat.profile(factory(), x, loss_fn=_loss, repeats=1)
    row = prof.rows[0]
    assert row.matmul_bytes == 256 * 96 * 4 + 256 * 32 * 4 and row.matmul_spared_bytes == 256 * 96 * 4
    _holds(factory, x, prof, (0, "save_matmuls", 1), (1, "checkpoint", 1))
    _holds(factory, x, prof, (0, "save_matmuls", 1), (1, "save_matmuls", 1), (2, "save_matmuls", 1))


def test_save_matmuls_after_an_inplace_activation():
    """A matmul output an in-place activation overwrites (``SiLU(inplace=True)`` on ``up``) is recomputed, not
    kept: save_matmuls keeps ``down``'s output only, and spares its recomputation nothing."""
    factory, x = _stack_factory(lambda: nn.SiLU(inplace=True)), torch.randn(256, 32)
    prof = remat.profile(factory(), x, loss_fn=_loss, repeats=1)
    assert (prof.rows[0].matmul_bytes, prof.rows[0].matmul_spared_bytes) == (256 * 32 * 4, 0)
    _holds(factory, x, prof, (0, "save_matmuls", 1), (1, "checkpoint", 1), (2, "save_matmuls", 1))


class _Plain(nn.Module):
    """A block ending in a Linear, with no residual: its output is the next block's input, which that saves."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _plain_factory():
    def factory():
        torch.manual_seed(0)
        model = _Stack(nn.Tanh)
        model.blocks = nn.ModuleList(_Plain() for _ in range(4))
        return model
    return factory


def test_save_matmuls_output_another_block_holds():
    """``down``'s output is kept by save_matmuls and saved by the next block's LayerNorm: one shared storage, alive
    until the later of the two backwards, counted once."""
    factory, x = _plain_factory(), torch.randn(128, 32)
    prof = remat.profile(factory(), x, loss_fn=_loss, repeats=1)
    (down,) = [s for s in prof.shared if s.kept_by == [2]]
    assert down.nbytes == 128 * 32 * 4 and down.saved_by == [3]
    assert prof.rows[2].matmul_bytes == 128 * 64 * 4  # up's output, which no other block holds
    _holds(factory, x, prof, (2, "save_matmuls", 1))
    _holds(factory, x, prof, (1, "save_matmuls", 1), (2, "checkpoint", 1), (3, "save_matmuls", 1))


def test_save_matmuls_output_the_loss_saves():
    """The last block's output is kept by its save_matmuls and saved by the loss (code outside the blocks), which
    frees it part-way through the stretch after the loss: the peak there already holds it.  The kept output is
    after the block's last saved tensor, so it is gone once the block's recomputation starts."""
    factory, x = _plain_factory(), torch.randn(128, 32)
    prof = remat.profile(factory(), x, loss_fn=_loss, repeats=1, hold_output=False)  # a loop that lets go of it
    (out,) = [s for s in prof.shared if s.kept_by == [3]]
    assert out.outside and not out.served_to and any(p and not a for p, a in zip(out.at_peak, out.alive))
    _holds(factory, x, prof, (3, "save_matmuls", 1))
    _holds(factory, x, prof, (2, "checkpoint", 1), (3, "save_matmuls", 1))
    # held by the loop through backward instead, it lives on whatever the plan
    prof = remat.profile(factory(), x, loss_fn=_loss, repeats=1)
    (out,) = [s for s in prof.shared if s.kept_by == [3]]
    assert out.outside and all(out.alive[len(prof.rows):])
    _holds(factory, x, prof, (3, "save_matmuls", 1))
    _holds(factory, x, prof, (2, "checkpoint", 1), (3, "save_matmuls", 1))


def test_shared_argument_input():
    """``ctx = embed(x)`` passed to both blocks, the first checkpointed: the step peaks where predicted.  Measured
    with MemTracker's module hooks it read 7% above: they hold the first block's input gradient until ``ctx``'s
    is complete (tests/test_memory.py)."""
    case = make_case(9, ("shared_input",))
    assert case.pattern == "shared_input"
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    _holds(case.build, case.inputs, prof, (0, "checkpoint", 1))


def test_kept_outputs_die_in_the_recomputation_once_read():
    """save_matmuls serves the recomputation the kept convolution outputs; each is gone once the op after it has
    read it (the ReLU, the residual add), so the rerun holds less than the kept bytes on top of its own."""
    case = make_case(1076, ("residual",))
    assert case.layers == "3 x [Conv relu Conv +x tanh]"
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    _holds(case.build, case.inputs, prof, (0, "checkpoint", 1), (1, "save_matmuls", 1), (2, "save_matmuls", 1))


def test_a_recomputing_forward_holds_what_its_code_holds():
    """A checkpointed block's forward saves nothing and a save_matmuls one keeps only its matmul outputs (``down``'s
    too, which autograd does not save): each is lower than the plain forward by what autograd alone held, which
    the block's own code let go of (``h = norm(x)`` is a local, alive through the forward).  Predicted at the
    plain forward's peak, the last block's forward, where this plan peaks, read 6.7% above the step."""
    case = make_case(12)
    assert case.layers.startswith("3 x [LayerNorm Linear(48,64) leaky_relu")
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    row, batch = prof.rows[2], 128
    # checkpointed, the forward's peak lacks up's output, act's and the mask (autograd's alone), and holds the
    # norm's output (a local of the block's code) as the plain one does
    assert (row.forward_peak - row.forward_start, row.forward_spared) == (164864, 66560)
    assert row.forward_spared - row.matmul_forward_spared == batch * 64 * 4  # save_matmuls holds up's output
    _holds(case.build, case.inputs, prof, (0, "save_matmuls", 1), (1, "save_matmuls", 1), (2, "checkpoint", 1))


def test_save_matmuls_forward_keeps_outputs_autograd_does_not_save():
    """``tanh`` saves its output, not ``up``'s: save_matmuls keeps ``up``'s output all the same, and with the
    Dropout's mask and ``down``'s output its forward holds nearly the plain forward's peak."""
    case = make_case(1032)
    assert case.layers.startswith("3 x [LayerNorm Linear(48,64) tanh")
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    assert prof.rows[1].matmul_forward_spared == 2048  # the norm's statistics only
    _holds(case.build, case.inputs, prof, (0, "checkpoint", 1), (1, "save_matmuls", 1), (2, "save_matmuls", 1))


def test_sequential_lets_go_of_what_it_passed_on():
    """A segment ``Conv BN ReLU_`` before a Dropout: the ReLU's output (BatchNorm's, written in place) goes to the
    Dropout, which saves its mask, not its input.  Without a plan the ReLU saves it to its backward; in the
    segment nothing does, and the ``nn.Sequential``'s loop drops it once the Dropout has returned: the forward
    stretches after it hold it no more (12% below the prediction before)."""
    case = make_case(1033)
    assert case.layers.startswith("Conv2d BatchNorm2d ReLU_ Dropout")
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    (relu,) = [s for s in prof.shared if s.output_of == [1, 2]]
    assert (relu.saved_by, relu.input_of, passed_on(prof, relu)) == ([2], [2, 3], 4)
    _holds(case.build, case.inputs, prof, (0, "segment", 3))
    _holds(case.build, case.inputs, prof, (0, "segment", 2), (3, "checkpoint", 1))


def test_save_matmuls_forward_may_hold_more_than_the_plain_one():
    """``up``'s output is not saved (``tanh`` saves its own) and dies after ``tanh`` without a plan; save_matmuls
    keeps it, so its forward peaks with it beside ``down``'s output, above the plain forward's peak (which held
    the add's output and the norm's statistics instead).  Counted as sparing nothing, the plan read 3.1% above."""
    case = make_case(1017)
    assert case.layers == "2 x [LayerNorm Linear(48,64) tanh Linear(64,48) +x] ctx shared"
    prof = remat.profile(case.build(), case.inputs, loss_fn=case.loss_fn, repeats=1)
    batch = case.inputs.shape[0]
    # up's output kept, where the plain forward's peak held the add's output and the norm's mean and rstd
    assert prof.rows[1].matmul_forward_spared == -(batch * 64 * 4 - batch * 48 * 4 - 2 * batch * 4)
    graph = prof.ops.blocks["blocks.0"]
    norm = selective_option(prof.rows[0], graph, [0])  # keeps the norm's output
    matmuls = next(o for o in chain_options(prof)[1] if o.name == "save_matmuls")
    plan = assignment_plan(prof, [norm, matmuls])
    result = remat.check_plan(case.build, plan, case.inputs, loss_fn=case.loss_fn, steps=2, optimizer="sgd")
    assert result.holds, str(result)
