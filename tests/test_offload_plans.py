"""Kept blocks whose largest saved tensors go to host memory (``keep_offload``): correct in training, priced on the
copy engine's timeline, and placed where the timeline prefers.

Correctness runs on the CPU (the copies synchronous, through host buffers) and on the fake device (simulated
streams, where a host wait would show in its log).  The timeline (:mod:`remat.planning.measure.copyline`) is checked
against the engine itself on the fake device's clock.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from fake_device import FakeDevice
from helpers import assert_bitwise, gpt_case

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.blockpolicy import BlockPolicy, OpDecision, apply_block_policies
from remat.planning.choices.keptoffload import LEVELS, keep_offload_options, offload_candidates
from remat.planning.choices.options import BlockOption, step_extra_time
from remat.planning.choices.placement import cheaper_placement
from remat.planning.measure.copies import MODELLED_LINK, Link
from remat.planning.measure.copyline import Copy, simulate
from remat.planning.measure.profile import ModuleProfile, StepProfile
from remat.planning.measure.timeline import Segment
from remat.planning.solve.plan import Plan
from remat.planning.solve.solver import predict
from remat.policies.hostcopy import use_device_model

CFG = GPTConfig(n_layers=3, d_model=256, n_heads=2, seq_len=128, vocab_size=64, dropout=0.0)  # 1-4 MiB saved tensors


@pytest.fixture(scope="module")
def ops():
    torch.manual_seed(0)
    model = GPT(CFG)
    tokens, _ = synthetic_batch(CFG, 8)
    return remat.profile_ops(model, tokens, timing="estimate")


def _policy(ops, k: int) -> BlockPolicy:
    graph = ops.blocks["blocks.0"]
    chosen = offload_candidates(graph)[:k]
    return BlockPolicy("keep", [OpDecision(graph.nodes[i].op, graph.nodes[i].call, graph.nodes[i].saved_bytes,
                                           "offload") for i in sorted(chosen)])


def _train(model, steps: int, optimizer: str):
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    history = []
    for step in range(steps):
        tokens, targets = synthetic_batch(CFG, 8, torch.Generator().manual_seed(step))
        torch.manual_seed(step)
        loss = model.loss(tokens, targets)
        loss.backward()
        history.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return history


def _assert_same(expected, got):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(expected, got, strict=True):
        assert torch.equal(loss_a, loss_b)
        assert_bitwise(grads_a, grads_b)


def _offloading(plain, policy):
    model = copy.deepcopy(plain)
    return apply_block_policies(model, {f"blocks.{i}": policy for i in range(CFG.n_layers - 1)})


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_kept_blocks_offloading_their_largest_tensors_train_bitwise_on_the_cpu(ops, optimizer):
    torch.manual_seed(0)
    plain = GPT(CFG)
    policy = _policy(ops, 3)
    model = _offloading(plain, policy)
    expected = _train(plain, 3, optimizer)
    got = _train(model, 3, optimizer)
    _assert_same(expected, got)
    # on the CPU the copies run at once, through host buffers: every chosen tensor travelled, each step
    stats = model.blocks[0].offloader.stats
    assert stats.offloaded_bytes == 3 * policy.offloaded_bytes > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_kept_blocks_offloading_on_a_fake_device_train_bitwise_without_host_waits(ops, optimizer):
    torch.manual_seed(0)
    plain = GPT(CFG)
    fake = FakeDevice()
    with use_device_model("cpu", fake):
        policy = _policy(ops, 2)
        model = _offloading(plain, policy)
        fake.d2h_bytes_per_s = float("inf")  # copies out complete at once: later saves let go of the held ones
        expected = _train(plain, 3, optimizer)
        got = _train(model, 3, optimizer)
    _assert_same(expected, got)
    out = [c for c in fake.copies if c.to_host]
    assert sum(c.nbytes for c in out) == 3 * (CFG.n_layers - 1) * policy.offloaded_bytes
    assert out and [c for c in fake.copies if not c.to_host] and not fake.calls("host waits")


def test_which_tensors_move_is_decided_by_each_call_not_an_earlier_one(ops):
    # one block run twice per forward: its op counts start afresh each time, so each call moves the same tensors
    torch.manual_seed(0)
    model = GPT(CFG)
    block = model.blocks[0]
    policy = _policy(ops, 2)
    wrapped = policy.wrap(block)
    x = torch.randn(8, CFG.seq_len, CFG.d_model, requires_grad=True)
    expected = torch.autograd.grad(block(block(x)).square().sum(), [x, *block.parameters()])
    got = torch.autograd.grad(wrapped(wrapped(x)).square().sum(), [x, *block.parameters()])
    assert_bitwise(expected, got)
    assert wrapped.offloader.stats.offloaded_bytes == 2 * policy.offloaded_bytes
    assert wrapped.offloader.stats.offloaded_tensors == 2 * len(policy.offloaded_ops) > 0


def test_a_keep_offload_policy_round_trips_through_a_plan_file(ops, tmp_path):
    policy = _policy(ops, 2)
    assert BlockPolicy.from_dict(policy.to_dict()) == policy and policy.offloaded_bytes > 0
    decisions = {"blocks.0": "keep_offload", "blocks.1": "keep", "blocks.2": "keep"}
    plan = Plan(decisions=decisions, predicted_peak=1, predicted_extra_time=0.0, budget=1, baseline_peak=1,
                param_bytes=0, step_time=1.0, policies={"blocks.0": policy.to_dict()})
    plan.save(str(tmp_path / "plan.json"))
    model = Plan.load(str(tmp_path / "plan.json")).apply(GPT(CFG))
    assert model.blocks[0].offloader.outputs_of == {op: frozenset(c) for op, c in policy.offloaded_ops.items()}
    with pytest.raises(ValueError, match="keeps no op outputs by choice .it keeps all it saves."):
        BlockPolicy("keep", [OpDecision("aten.mm.default", 0, 4, "keep")])


def test_candidates_are_saved_op_outputs_largest_first(ops):
    graph = ops.blocks["blocks.0"]
    found = offload_candidates(graph)
    sizes = [graph.nodes[i].saved_bytes for i in found]
    assert found and sizes == sorted(sizes, reverse=True)
    assert all(graph.nodes[i].kind == "compute" and not graph.nodes[i].mutated for i in found)


def _profile(rows: int, forward: float, own: int, held: int, ops=None) -> StepProfile:
    """A chain of alike blocks: each keeps ``own`` bytes (``held`` of them its inputs), peak at the loss."""
    made = [ModuleProfile(name=f"blocks.{i}", cls="Block", act_bytes=own, input_bytes=held, output_bytes=held,
                          forward_time=forward, matmul_time=0.0, matmul_bytes=0, own_bytes=own, held_bytes=held,
                          recompute_bytes=own, checkpoint_time=forward, save_matmuls_time=float("inf"))
            for i in range(rows)]
    segments, live = [], 0
    for i in range(rows):
        segments.append(Segment(f"forward {i}", live + own, prefix=i, start=live))
        live += own
    segments.append(Segment("loss", live, prefix=rows, start=live))
    for i in reversed(range(rows)):
        segments.append(Segment(f"backward {i}", live, prefix=i, block=i, start=live, backward=True))
        live -= own
    return StepProfile(rows=made, segments=segments, param_bytes=0, buffer_bytes=0, grad_bytes=0,
                       peak_bytes=max(s.peak for s in segments), device="cuda", step_time=3 * rows * forward,
                       ops=ops)


def test_keep_offload_levels_take_the_largest_tensors_and_leave_the_last_block(ops):
    graph = ops.blocks["blocks.0"]
    own = graph.keep_all_bytes
    prof = _profile(CFG.n_layers, graph.forward_time, own, graph.input_bytes, ops)
    found = keep_offload_options(prof, MODELLED_LINK)
    assert sorted(found) == list(range(CFG.n_layers - 1))  # the last block has none
    candidates = offload_candidates(graph)
    levels = sorted({min(k, len(candidates)) for k in LEVELS})
    for option, k in zip(found[0], levels, strict=True):
        moved = sum(graph.nodes[i].saved_bytes for i in candidates[:k])
        assert option.kept == own - moved and sum(c.nbytes for c in option.copies) == moved
        assert all(c.scheduled for c in option.copies)  # a plan's schedule bounds them, not the window
        assert option.in_flight == 0 and not option.recomputes  # the plan's schedule counts its copies
        assert option.policy.offloaded_bytes == moved


def test_the_timeline_charges_only_what_the_compute_cannot_hide():
    link = Link(1e9, 1e9)  # 1 ms per MB each way
    # 1 MB a block behind 2 ms forwards and 4 ms backwards: hidden
    assert simulate([2e-3] * 4, [0.0] * 4, [[Copy(1.0, 0.0, 10**6)]] * 3 + [[]], link, 10**9).wait == 0.0
    # 3 MB a block (3 ms) behind 1 ms forwards with room for one copy in flight: forward stalls for the link
    line = simulate([1e-3] * 4, [0.0] * 4, [[Copy(1.0, 0.0, 3 * 10**6)]] * 4, link, 3 * 10**6)
    assert line.forward_wait == pytest.approx(3 * 2e-3)  # each save after the first waits for the one before it
    assert line.held == 3 * 10**6  # the last one stays in the window: no round trip


def test_the_timeline_follows_the_engine_on_a_fake_device():
    fake = FakeDevice(d2h_bytes_per_s=2.0**20)  # 1/16 s per 64 KiB copy
    forward, size = 1 / 32, 65536
    with use_device_model("cpu", fake) as engine:
        engine.in_flight_limit = 2 * size
        for _ in range(6):  # a block's forward makes one tensor at its end; the host keeps pace with the device
            fake.run(forward)
            fake.now = fake.compute.ready
            engine.stash(torch.randn(size // 4))
        fake.run(0.0)
        link = Link(fake.d2h_bytes_per_s, fake.h2d_bytes_per_s)
        line = simulate([forward] * 6, [0.0] * 6, [[Copy(1.0, 0.0, size)]] * 6, link, engine.in_flight_limit)
        assert fake.compute.ready == pytest.approx(6 * forward + line.forward_wait) and line.forward_wait > 0
        assert line.held == sum(e[1] for window in engine._out.values() for e in window.entries)


def test_a_plan_with_kept_offloads_is_priced_on_the_timeline_and_placed_where_it_hides():
    size = 200 << 20  # a copy out takes three blocks' forwards
    forward = MODELLED_LINK.seconds(size, to_host=True) / 3
    prof = _profile(6, forward, size + (32 << 20), 32 << 20)
    keep = [BlockOption("keep", row.own_bytes) for row in prof.rows]
    moving = BlockOption("keep_offload", 32 << 20, copy_time=0.0, in_flight=size,
                         copies=(Copy(1.0, 0.0, size, scheduled=True),))
    late = [*keep[:3], moving, moving, keep[5]]
    alone = sum(o.extra_time for o in late)
    priced = step_extra_time(prof, late)
    assert priced > alone  # the last block's drain waits for both copies: every copy is out before the loss
    placed = cheaper_placement(prof, list(enumerate(late)), lambda chosen: predict(prof, chosen)[0])
    chosen = [o for _, o in placed]
    assert step_extra_time(prof, chosen) < priced  # moved earlier, where the forwards after them hide the copies
    assert predict(prof, chosen)[0] <= predict(prof, late)[0]
    assert sorted(o.name for o in chosen) == sorted(o.name for o in late)


def test_what_the_engine_holds_after_a_forward_is_what_the_timeline_says_and_within_the_plans_count(ops):
    graph = ops.blocks["blocks.0"]
    prof = _profile(CFG.n_layers, 0.0, graph.keep_all_bytes, graph.input_bytes, ops)
    limit = 8 << 20  # two or three of the 1-4 MiB tensors
    option = keep_offload_options(prof, MODELLED_LINK)[0][2]  # the 3 largest tensors of each block
    torch.manual_seed(0)
    model = GPT(CFG)
    fake = FakeDevice(d2h_bytes_per_s=2.0**30)
    tokens, targets = synthetic_batch(CFG, 8)
    with use_device_model("cpu", fake) as engine:
        engine.in_flight_limit = limit
        apply_block_policies(model, {f"blocks.{i}": option.policy for i in range(CFG.n_layers - 1)})
        loss = model.loss(tokens, targets)  # the fake device computes in no time: the link alone paces forward
        held = sum(entry[1] for window in engine._out.values() for entry in window.entries)
        link = Link(fake.d2h_bytes_per_s, fake.h2d_bytes_per_s)
        copies = [option.copies] * (CFG.n_layers - 1) + [()]
        # installed by hand, without a plan's schedule: the engine's window bounds them
        copies = [[dataclasses.replace(c, scheduled=False) for c in block] for block in copies]
        line = simulate([0.0] * CFG.n_layers, [0.0] * CFG.n_layers, copies, link, limit)
        assert (held, fake.now) == (line.held, pytest.approx(line.forward_wait)) and line.forward_wait > 0
        assert held <= limit + max(c.nbytes for c in option.copies)
        loss.backward()


def test_a_kept_block_with_offloads_under_compile_breaks_the_graph_and_keeps_gradients(ops):
    torch.manual_seed(0)
    plain = GPT(CFG)
    model = _offloading(plain, _policy(ops, 2))
    tokens, targets = synthetic_batch(CFG, 8)
    params = list(plain.parameters())
    expected = torch.autograd.grad(plain.loss(tokens, targets), params)
    compiled = torch.compile(model.loss, backend="aot_eager")
    got = torch.autograd.grad(compiled(tokens, targets), list(model.parameters()))
    assert_bitwise(expected, got)
    assert model.blocks[0].offloader.stats.offloaded_bytes > 0  # the wrapped blocks ran eagerly, offloading


def test_the_h200_simulation_with_op_graphs_is_calibrated_and_weighs_kept_offloads():
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from remat.planning.choices.chain import chain_options
    from remat.planning.choices.fronts import evaluate
    from remat.policies.rules import MATMUL_OPS

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "h200_timeline.py"
    spec = importlib.util.spec_from_file_location("h200_timeline_ops", path)
    h200 = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = h200
    try:
        spec.loader.exec_module(h200)
        figures = json.loads(h200.RESULTS.read_text())
        prof, _ = h200.h200_profile(figures, graph=h200.meta_graph(figures))
    finally:
        del sys.modules[spec.name]
    rows = {row["key"]: row for row in figures["rows"]}
    graph = prof.ops.blocks["model.layers.0"]
    layer = prof.rows[0].forward_time
    assert sum(n.kernel_time for n in graph.nodes) == pytest.approx(layer)
    # keeping the matmuls' and attention's outputs costs what save_matmuls measured per layer on the H200
    kept = [i for i in graph.keepable if graph.nodes[i].op in {str(op) for op in MATMUL_OPS}]
    price = evaluate(graph, "selective", kept).extra_time * layer / evaluate(graph, "checkpoint").extra_time
    measured = (rows["remat-save-matmuls"]["median_ms"] - rows["plain"]["median_ms"]) / 1e3 / 12
    assert price == pytest.approx(measured, rel=1e-6)
    # the layer's largest saved tensors are the MLP's (4 x 2048 x 5632 bf16: 88 MiB), offered on all layers but the last
    options = chain_options(prof)
    levels = [[o for o in choices if o.name == "keep_offload"] for choices in options]
    assert all(levels[:-1]) and not levels[-1]
    assert levels[0][0].copies[0].nbytes == 4 * 2048 * 5632 * 2


def test_a_plans_measured_peak_falls_with_each_level_and_stays_within_its_prediction():

    from remat.planning.solve.solver import plan_of

    model, tokens, _, loss_fn = gpt_case(CFG, 8)

    def step():
        loss_fn(model(tokens)).backward()

    prof = remat.profile(model, tokens, loss_fn=loss_fn, repeats=1)
    fixed = prof.param_bytes + prof.buffer_bytes
    found = keep_offload_options(prof, MODELLED_LINK)
    previous = prof.peak_bytes - fixed
    for level in range(len(found[0])):
        chosen = [found[p][level] if p in found else BlockOption("keep", row.own_bytes)
                  for p, row in enumerate(prof.rows)]
        predicted, _ = predict(prof, chosen)
        plan = plan_of(prof, list(enumerate(chosen)), prof.peak_bytes)
        assert plan.copies["ahead"] == 2 * max(sum(c.nbytes for c in o.copies) for o in chosen)
        # copies complete at once each way: nothing is in flight when a block starts, nor before the loss
        fake = FakeDevice(d2h_bytes_per_s=float("inf"), h2d_bytes_per_s=float("inf"))
        with use_device_model("cpu", fake):
            plan.apply(model)
            step()  # the host pool's blocks are made in the first step
            model.zero_grad(set_to_none=True)
            measured = remat.measure_step(step, model).peak_above_params
            model.zero_grad(set_to_none=True)
            plan.remove(model)
        assert set(plan.copies["drains"].values()) == {0}
        # backward's stretches count every tensor already back by their end (here the first block's, two blocks
        # ahead, all of it in the second block's backward), so the prediction stops falling after the first level
        assert measured <= predicted - fixed < prof.peak_bytes - fixed
        assert measured <= previous and not fake.calls("host waits")  # each level moves more: the peak never rises
        previous = measured
    assert previous < prof.peak_bytes - fixed - 8 * 2**20
