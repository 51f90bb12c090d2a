"""Plans with op-level ``selective`` blocks: exact memory, plain gradients, readable and reloadable."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bitwise

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.choices.options import block_options, selective_option
from remat.planning.measure.overheads import Overheads
from remat.planning.measure.prices import matmuls
from remat.planning.solve.solver import plan_of


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=3, d_model=64, n_heads=4, seq_len=64, vocab_size=128, dropout=0.1)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 4)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # the loops below let go of the logits once the loss is computed (the budgets are set for that loop)
    prof = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1, hold_output=False)
    # Op times from a roofline and no machinery cost: the fronts (and so the plans below) depend on bytes and
    # FLOPs only, never on how fast this machine ran the profile.
    prof.ops = remat.profile_ops(model, tokens, timing="estimate", overheads=Overheads(0.0, 0.0, 0.0, 0.0, 0.0))
    return model, tokens, loss_fn, prof


def _step(model, tokens, loss_fn):
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    loss_fn(model(tokens)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _peak(model, tokens, loss_fn):
    peak = remat.measure_step(lambda: loss_fn(model(tokens)).backward(), model).peak_above_params
    model.zero_grad(set_to_none=True)
    return peak


def test_selective_options_come_from_the_op_graphs(case):
    model, tokens, loss_fn, prof = case
    assert set(prof.ops.blocks) == {row.name for row in prof.rows}
    for row, choices in zip(prof.rows, block_options(prof)):
        selective = [o for o in choices if o.name == "selective"]
        assert selective, row.name
        held = next(o for o in choices if o.name == "checkpoint").kept
        for option in selective:
            # Between checkpointing and keeping: more than the inputs, less than plain autograd keeps.
            assert held < option.kept < row.own_bytes
            assert option.recomputes and option.policy.mode == "selective" and option.policy.kept
            assert option.kept - held == option.policy.kept_bytes
    assert not any(o.name == "selective" for c in block_options(prof, ("checkpoint",)) for o in c)
    assert remat.profile(model, tokens, loss_fn=loss_fn, repeats=1).ops.blocks.keys() == prof.ops.blocks.keys()
    without_ops = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1, ops=False)
    assert without_ops.ops is None
    assert not any(o.name == "selective" for c in block_options(without_ops) for o in c)


@pytest.mark.parametrize("budget", [0.45, 0.65])
def test_selective_plans_keep_the_predicted_bytes_and_plain_gradients(case, budget):
    model, tokens, loss_fn, prof = case
    reference = _step(model, tokens, loss_fn)
    # Without plain checkpointing a block below the budget can only be selective: memory decides, not timing.
    plan = prof.plan(budget, allow=("selective",))
    assert "selective" in plan.decisions.values()
    plan.apply(model)
    try:
        assert_bitwise(_step(model, tokens, loss_fn), reference)
        measured = _peak(model, tokens, loss_fn)
    finally:
        plan.remove(model)
    predicted = plan.predicted_peak - plan.param_bytes
    assert abs(measured - predicted) <= 0.01 * predicted, (plan.decisions, measured, predicted)
    assert plan.predicted_peak <= plan.budget


def test_saved_plan_records_per_op_decisions_and_reapplies(case, tmp_path):
    model, tokens, loss_fn, prof = case
    plan = prof.plan(0.45, allow=("selective",))
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    selective = [name for name, decision in data["decisions"].items() if decision == "selective"]
    assert selective and set(data["policies"]) == set(selective)
    for name in selective:
        ops = data["policies"][name]["ops"]
        assert {"op", "call", "bytes", "decision"} <= set(ops[0])
        kept = sum(d["bytes"] for d in ops if d["decision"] == "keep")
        assert kept > 0 and plan.blocks[name]["kept"] > kept
    loaded = remat.Plan.load(str(path))
    assert loaded.policies == plan.policies and loaded.blocks == plan.blocks
    reference = _step(model, tokens, loss_fn)
    loaded.apply(model)
    try:
        installed = {name: model.get_submodule(name)._remat_block_policy for name in selective}
        assert all(installed[n] == remat.BlockPolicy.from_dict(plan.policies[n]) for n in selective)
        loaded.apply(model)  # idempotent: the same wrappers stay
        assert all(model.get_submodule(n)._remat_block_policy is installed[n] for n in selective)
        assert_bitwise(_step(model, tokens, loss_fn), reference)
    finally:
        loaded.remove(model)
    assert not any(isinstance(m, remat.ActivationWrapper) for m in model.modules())


def test_printed_plan_summarises_each_block(case):
    _, _, _, prof = case
    plan = prof.plan(0.45, allow=("selective",))
    text = str(plan)
    for name, decision in plan.decisions.items():
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert decision in line
        if decision == "selective":
            assert str(plan.blocks[name]["recomputed_ops"]) in line and "#" in line  # ops rerun, kept op#call
    assert "Predicted peak" in text


def test_plans_on_an_accelerator_offload_what_the_link_hides_and_say_so(case):
    import copy

    from fake_device import FakeDevice

    from remat.policies.hostcopy import use_device_model

    model, tokens, loss_fn, prof = case
    ops = remat.profile_ops(model, tokens, timing="estimate",
                            overheads=Overheads(0.0, 0.0, 0.0, 0.0, 0.0, link_bytes_per_s=1e13))
    for graph in ops.blocks.values():
        # priced as on a GPU whose host link outruns the (roofline) kernels: offloading is all but free
        graph.asynchronous = True
    accelerated = copy.copy(prof)
    accelerated.ops = ops
    # Moved outputs come back together for the recomputation: a block that offloads holds them there, so the
    # plan offloads where the step's peak leaves room for that (here, in two blocks of three at 70%).
    plan = accelerated.plan(0.7, allow=("selective", "offload"))
    assert not any(block.get("offloaded") for block in accelerated.plan(0.7).blocks.values())  # asked by name
    moved = {name: block["offloaded"] for name, block in plan.blocks.items() if block.get("offloaded")}
    assert moved
    text = str(plan)
    for name, nbytes in moved.items():
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert "offloads" in line and "unhidden" in line
        decisions = plan.policies[name]["ops"]
        assert sum(d["bytes"] for d in decisions if d["decision"] == "offload") == nbytes
    # CPU prices never offload
    assert not any(block.get("offloaded") for block in prof.plan(0.7, allow=("selective",)).blocks.values())
    expected = _step(model, tokens, loss_fn)
    planned = copy.deepcopy(model)
    plan.apply(planned)
    with use_device_model("cpu", FakeDevice()) as engine:
        got = _step(planned, tokens, loss_fn)
    assert_bitwise(got, expected)
    assert engine.pool().allocations > 0  # the offloaded outputs really travelled


def test_a_plan_that_offloads_blocks_counts_one_window_of_copies_in_flight(case, monkeypatch):
    import copy
    import dataclasses

    from remat.planning.choices.options import block_options
    from remat.planning.solve.solver import _peak
    from remat.policies.hostcopy import engine_for

    _, _, _, prof = case
    on_gpu = copy.copy(prof)
    on_gpu.device = "cuda:0"
    assert not any(o.name == "offload" for options in block_options(prof) for o in options)  # never on the CPU
    for window in (0, 1 << 10, 1 << 40):
        monkeypatch.setattr(engine_for("cuda"), "in_flight_limit", window)
        offloads = []
        for row, options in zip(on_gpu.rows, block_options(on_gpu, allow=("offload",))):
            (offload,) = [o for o in options if o.name == "offload"]
            largest = max(s.nbytes for s in prof.ops.blocks[row.name].storages if s.saved)
            # the window, and one more entry: a tensor going out, or a fetch and its two prefetched coming back
            assert offload.kept == row.held_bytes
            assert offload.in_flight == min(row.own_bytes - row.held_bytes, window + 3 * largest) > 0
            offloads.append(offload)
        # one window for the step, however many blocks offload
        settled = [dataclasses.replace(o, in_flight=0) for o in offloads]
        assert _peak(on_gpu, offloads) == _peak(on_gpu, settled) + max(o.in_flight for o in offloads)
        plan = on_gpu.plan(0.8, allow=("offload",))
        assert plan.predicted_peak <= plan.budget


def test_the_last_block_keeping_its_dropout_masks_peaks_where_predicted():
    """Backward starts with the last block, so its recomputation makes the step's peak.  A kept dropout mask is a
    copy, handed back when the rerun reaches its draw and let go of there: the rest of the recomputation runs
    without it (a copy priced as held through the whole rerun puts the attention mask's point 1 MiB above its
    measured peak)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=16, mlp_ratio=8, seq_len=64, vocab_size=16)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 8)

    def loss_fn(logits):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    prof = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1, hold_output=False)
    last, row = len(prof.rows) - 1, prof.rows[-1]
    graph = prof.ops.blocks[row.name]
    draws = [i for i in graph.keepable if graph.nodes[i].random]
    assert len(draws) == 3  # attention's mask, the projection's, the MLP's
    for kept in ([draws[0]], draws, [*draws, *matmuls(graph)]):
        plan = plan_of(prof, [(last, selective_option(row, graph, sorted(set(kept) & set(graph.keepable))))],
                       prof.peak_bytes)
        plan.meta = {**prof.model_meta, **plan.meta}
        plan.apply(model)
        try:
            measured = remat.measure_step(lambda: loss_fn(model(tokens)).backward(), model).peak_total
        finally:
            plan.remove(model)
            model.zero_grad(set_to_none=True)
        assert abs(measured - plan.predicted_peak) <= 4096, (kept, measured, plan.predicted_peak)
