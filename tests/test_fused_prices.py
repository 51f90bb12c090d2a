"""Prices of fused reruns: a profile inside fused_reruns times each block's compiled refill (remat.planning.fusedtime).

The times themselves are the machine's; these tests check what is timed, and that prices follow from the
timed refill as the module docstring says (times set by hand where a test needs exact numbers).
"""

import dataclasses

import pytest
import torch
from test_fused import compiled  # noqa: F401  (fixture)
from test_program import Layer
from test_timing import _timed_graph
from torch import nn

import remat
from remat.planning.fusedtime import FusedRefill
from remat.planning.prices import BlockPrices, fused_shares
from remat.policies import fused_reruns


def _stack(depth=3, width=16):
    torch.manual_seed(0)
    return nn.Sequential(*(Layer(width, 4 * width) for _ in range(depth)))


def test_a_profile_inside_fused_reruns_times_each_distinct_blocks_refill_once(compiled):  # noqa: F811
    model, x = _stack(), torch.randn(4, 16, requires_grad=True)
    state = torch.get_rng_state()
    with fused_reruns("eager"):
        prof = remat.profile_ops(model, x, modules=["0", "1", "2"], repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    (graph,) = prof.distinct  # three layers alike: one graph, one compile
    assert len(compiled) == 1 and compiled[0] > 0
    assert graph.runs_program and graph.fused is not None and graph.fused.backend == "eager"
    assert graph.fused.device_time > 0 and graph.fused.host_time > 0
    assert "fused by eager" in str(graph)
    assert remat.profile_ops(model, x, modules=["0"], repeats=1).blocks["0"].fused is None  # outside: op by op


def test_a_block_without_a_program_gets_no_fused_price(compiled):  # noqa: F811
    # Batch norm counts its batches in a buffer: its region reruns the Python code, never a compiled refill.
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    with fused_reruns("eager"):
        graph = remat.profile_ops(nn.Sequential(block), torch.randn(4, 8, requires_grad=True), modules=["0"],
                                  repeats=1).blocks["0"]
    assert not graph.runs_program and graph.fused is None and not compiled


def _fused(asynchronous, device_time, host_time=1e-5):
    graph = _timed_graph(asynchronous, host=2e-6, kernel=1e-4)
    graph.overheads = dataclasses.replace(graph.overheads, program_op=3e-6)
    graph.fused = FusedRefill("inductor", device_time, host_time)
    return graph


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_fused_refill_costs_what_was_timed_and_each_op_its_share(asynchronous):
    graph = _fused(asynchronous, device_time=1.5e-4)
    rerun, nodes = graph.program_rerun(), graph.nodes
    matmuls = [i for i in rerun if nodes[i].op == "aten.addmm.default"]
    others = [i for i in rerun if i not in matmuls]
    assert matmuls and others
    # The matmul keeps its kernel time; the other ops share what is left of the timed refill.
    scale = (1.5e-4 - sum(nodes[i].kernel_time for i in matmuls)) / sum(nodes[i].kernel_time for i in others)
    factors, fixed = fused_shares(graph)
    assert 0 < scale < 1 and fixed == 0.0
    assert all(factors[i] == 1.0 for i in matmuls) and all(factors[i] == pytest.approx(scale) for i in others)
    prices = BlockPrices(graph)
    o = graph.overheads
    machinery = o.region + o.per_saved * graph.saved_tensors
    # Keeping nothing costs the timed refill (on an accelerator, or the host's one call where that is longer);
    # a checkpoint keeps nothing as a policy inside fused_reruns, so it costs the same.
    expected = max(1.5e-4, machinery + 1e-5) if asynchronous else machinery + 1.5e-4
    assert prices.selective_time == pytest.approx(expected) and prices.checkpoint_time == prices.selective_time
    for i, gain in prices.gain.items():
        share = nodes[i].kernel_time * factors[i] if i in rerun else 0.0
        assert gain == pytest.approx(share)


def test_without_a_timed_refill_a_program_is_priced_op_by_op():
    graph = _fused(False, device_time=2.5e-4)
    fused = BlockPrices(graph)
    graph.fused = None
    op_by_op = BlockPrices(graph)
    assert fused_shares(graph) == ([1.0] * len(graph.nodes), 0.0)
    o = graph.overheads
    machinery = o.region + o.per_saved * graph.saved_tensors
    assert op_by_op.selective_time == pytest.approx(
        machinery + sum(graph.nodes[i].kernel_time + o.program_op for i in graph.program_rerun()))
    assert op_by_op.checkpoint_time != op_by_op.selective_time != fused.selective_time


def test_a_fused_refill_faster_than_its_matmuls_prices_the_other_ops_at_nothing():
    graph = _fused(True, device_time=1e-9)  # timing noise below the matmuls' own kernels
    factors, fixed = fused_shares(graph)
    assert min(factors) == 0.0 and max(factors) == 1.0 and fixed == 0.0


def test_a_fused_refill_slower_than_its_ops_one_by_one_counts_the_excess_as_fixed():
    # A compiled call's fixed cost above tiny ops: keeping an op spares no more than its own kernel.
    graph = _fused(False, device_time=1e-2)
    factors, fixed = fused_shares(graph)
    rerun, nodes = graph.program_rerun(), graph.nodes
    assert factors == [1.0] * len(nodes) and fixed == pytest.approx(1e-2 - sum(nodes[i].kernel_time for i in rerun))
    prices = BlockPrices(graph)
    o = graph.overheads
    assert prices.selective_time == pytest.approx(o.region + o.per_saved * graph.saved_tensors + 1e-2)
    assert all(gain == pytest.approx(nodes[i].kernel_time if i in rerun else 0.0) for i, gain in prices.gain.items())
    everything = prices.time("selective", tuple(prices.gain))
    assert everything >= o.region + o.per_saved * graph.saved_tensors + fixed - 1e-12


def test_a_plan_from_a_fused_profile_says_how_it_was_priced(compiled):  # noqa: F811
    model, x = _stack(4, 64), torch.randn(256, 64, requires_grad=True)
    with fused_reruns("eager"):
        prof = remat.profile(model, x, modules=["0", "1", "2", "3"], loss_fn=lambda y: y.sum(), repeats=1)
    plan = prof.plan(0.5)
    assert plan.meta["fused_reruns"] == "eager" and "fused_reruns()" in str(plan)
    assert "fused_reruns" not in remat.profile(model, x, modules=["0", "1", "2", "3"], loss_fn=lambda y: y.sum(),
                                               repeats=1).plan(0.5).meta


def test_a_backend_that_fails_to_compile_gets_no_fused_price(compiled):  # noqa: F811
    from torch._dynamo import register_backend

    @register_backend
    def refusing(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model, x = _stack(), torch.randn(4, 16, requires_grad=True)
    with fused_reruns("refusing"), pytest.warns(UserWarning, match="failed to compile"):
        prof = remat.profile_ops(model, x, modules=["0", "1", "2"], repeats=1)
    assert prof.distinct[0].fused is None


def test_a_callable_backend_names_the_plan(compiled):  # noqa: F811
    def mine(gm, example_inputs):
        return gm.forward

    model, x = _stack(4, 64), torch.randn(256, 64, requires_grad=True)
    with fused_reruns(mine):
        prof = remat.profile(model, x, modules=["0", "1", "2", "3"], loss_fn=lambda y: y.sum(), repeats=1)
    assert prof.plan(0.5).meta["fused_reruns"] == "mine"
