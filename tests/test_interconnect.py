"""Collectives priced from the ranks' interconnect where a profile runs on the meta device: a tensor-parallel model
built on meta in a fake world (``remat.fake_world``) pays ``latency + bus bytes / bandwidth`` for every collective,
with nccl-tests' bus bytes, in its blocks' forwards, in what their recomputations send again and in the step; its
compute is what one rank's shards compute.  The same models' real two-rank runs are compared in test_tp_plan.py."""

import pytest
import torch
import torch.distributed as dist

import remat
from remat.planning.choices.options import selective_option
from remat.planning.measure.interconnect import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, Interconnect, bus_factor
from remat.planning.measure.prices import BlockPrices

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import tp_plan_worker as worker  # noqa: E402  (the tensor-parallel models the two-rank run trains)

BATCH = 8
ACTIVATION = BATCH * worker.GPT_CFG.seq_len * worker.GPT_CFG.d_model * 4  # a block's output, float32, every rank
LINK = {"interconnect_bandwidth": 50e9, "interconnect_latency": 20e-6}


def _meta_profile(build, ranks: int, **link) -> remat.Profile:
    """``build``'s GPT on the meta device in a fake world of ``ranks``, profiled as the two-rank run trains it."""
    from torch.distributed.device_mesh import init_device_mesh

    tokens = torch.empty(BATCH, worker.GPT_CFG.seq_len, dtype=torch.long, device="meta")
    with remat.fake_world(ranks):
        mesh = init_device_mesh("cpu", (ranks,))
        with torch.device("meta"):
            model = build(mesh)
        return remat.profile(model, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tokens.flatten()), device="meta", hold_output=False, **link)


def test_bus_bytes_follow_nccl_tests_conventions():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == 1.75
    for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        assert bus_factor(kind, 8) == 0.875, kind
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0 and bus_factor("wait_tensor", 8) == 0.0
    link = Interconnect(bandwidth=100e9, latency=5e-6)
    assert link.seconds("all_reduce", 1 << 20, 4) == 5e-6 + 1.5 * (1 << 20) / 100e9
    assert link.seconds("all_reduce", 1 << 20, 1) == 0.0  # one rank sends nothing, and waits for no one


def test_each_functional_collective_is_priced_on_the_whole_tensor_of_its_group():
    """An all-gather's whole tensor is its output (its input times the group's size); a reduce-scatter's, its
    input; the group's size read from the group the call names."""
    ops = torch.ops._c10d_functional
    link = Interconnect(bandwidth=1e9, latency=1e-6)
    x = torch.empty(16, 256, device="meta")  # 16 KiB
    size = 16 * 256 * 4
    with remat.fake_world(4):
        group = dist.group.WORLD.group_name
        assert link.op_seconds(ops.all_reduce.default, (x, "sum", group), {}) == 1e-6 + 1.5 * size / 1e9
        assert link.op_seconds(ops.all_gather_into_tensor.default, (x, 4, group), {}) == 1e-6 + 0.75 * 4 * size / 1e9
        assert link.op_seconds(ops.reduce_scatter_tensor.default, (x, "sum", 4, group), {}) == 1e-6 + 0.75 * size / 1e9
        assert link.op_seconds(ops.all_to_all_single.default, (x, [4] * 4, [4] * 4, group), {}) == (
            1e-6 + 0.75 * size / 1e9)
        assert link.op_seconds(ops.wait_tensor.default, (x,), {}) == 0.0


@pytest.mark.parametrize("ranks", [2, 8])
def test_a_tensor_parallel_gpt_on_meta_pays_its_all_reduces_over_the_interconnect(ranks):
    """Each block's row-wise down projection all-reduces the block's output: ``2 (n - 1) / n`` of it over the link,
    plus its latency, in the block's forward and in its checkpoint price (the dropout after it saves a mask made
    from the all-reduced output, so a recomputation reaches it); a plan checkpointing every block sends 4 again
    and pays for them."""
    prof = _meta_profile(worker._gpt, ranks, **LINK)
    wire = LINK["interconnect_latency"] + 2 * (ranks - 1) / ranks * ACTIVATION / LINK["interconnect_bandwidth"]
    assert [(row.collectives, row.tail_collectives) for row in prof.rows] == [(1, 0)] * 4
    for row in prof.rows:
        (reduce,) = [n for n in prof.ops.blocks[row.name].nodes if n.op == "_c10d_functional.all_reduce.default"]
        assert reduce.kernel_time == pytest.approx(wire, rel=1e-12)
        assert row.forward_time == pytest.approx(row.matmul_time + wire, rel=1e-12)  # matmul_time: its FLOPs
        assert row.checkpoint_time == pytest.approx(row.matmul_time + wire, rel=1e-12)
        # keeps the matmuls' and the all-reduce's outputs, reruns the rest: priced as the selective point keeping them
        graph = prof.ops.blocks[row.name]
        kept = selective_option(row, graph, BlockPrices(graph).matmul_nodes())
        assert row.save_matmuls_time == pytest.approx(kept.extra_time, abs=1e-9)  # options: a 2**-32 s grid
        assert 0 < row.save_matmuls_time
    every = prof.price(dict.fromkeys([row.name for row in prof.rows], "checkpoint"))
    assert every.collectives_rerun == 4
    assert every.predicted_extra_time == pytest.approx(sum(row.checkpoint_time for row in prof.rows), rel=1e-4)
    assert any(f"{2 * 4} collectives in the step priced over an interconnect" in note for note in prof.notes)


def test_the_step_pays_every_collective_of_forward_and_backward():
    """4 all-reduces in forward (the down projections' outputs) and 4 in backward (the up projections' input
    gradients), each of a block's activation: the step's time moves by exactly their price."""
    fast = _meta_profile(worker._gpt, 2, interconnect_bandwidth=1e30, interconnect_latency=0.0)
    slow = _meta_profile(worker._gpt, 2, **LINK)
    wire = LINK["interconnect_latency"] + ACTIVATION / LINK["interconnect_bandwidth"]
    assert slow.step_time - fast.step_time == pytest.approx(8 * wire, rel=1e-9)
    assert [row.matmul_time for row in slow.rows] == [row.matmul_time for row in fast.rows]


def test_a_ranks_compute_on_meta_is_its_shards():
    """FLOPs counted on each rank's local shards: the MLP's matmuls (up and down, forward) are split over the ranks,
    attention is not; from 2 ranks to 8 a block's forward loses ``(1/2 - 1/8)`` of the MLP's FLOPs."""
    cfg = worker.GPT_CFG
    two, eight = (_meta_profile(worker._gpt, n, **LINK) for n in (2, 8))
    mlp = 2 * 2 * BATCH * cfg.seq_len * cfg.d_model * cfg.d_model * cfg.mlp_ratio  # up and down, whole
    for a, b in zip(two.rows, eight.rows):
        assert a.matmul_time - b.matmul_time == pytest.approx(mlp * (1 / 2 - 1 / 8) / 100e12, rel=1e-9)


def test_sequence_parallel_on_meta_pays_its_all_gathers_and_reduce_scatters():
    """Sequence parallel on meta (a DTensor's layer-norm backward there too): per block, the attention and MLP
    inputs' all-gathers, each ``(n - 1) / n`` of the gathered activation, and the output projections'
    reduce-scatters, each ``(n - 1) / n`` of the whole activation; every block checkpointed sends the 16 again, as
    the real two-rank run counts (test_tp_plan)."""
    prof = _meta_profile(worker._gpt_sequence_parallel, 2, **LINK)
    wire = LINK["interconnect_latency"] + 0.5 * ACTIVATION / LINK["interconnect_bandwidth"]
    for row in prof.rows:
        graph = prof.ops.blocks[row.name]
        priced = [n.kernel_time for n in graph.nodes
                  if n.op.split(".")[1] in ("all_gather_into_tensor", "reduce_scatter_tensor")]
        assert priced == pytest.approx([wire] * 4, rel=1e-12)
    every = prof.price(dict.fromkeys([row.name for row in prof.rows], "checkpoint"))
    assert every.collectives_rerun == 16


def test_the_defaults_are_stated_and_bad_links_are_refused_in_one_line():
    assert (DEFAULT_BANDWIDTH, DEFAULT_LATENCY) == (200e9, 10e-6)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    for keyword, bad, said in (("interconnect_bandwidth", 0, "interconnect_bandwidth must be the bytes per second"),
                               ("interconnect_bandwidth", "fast", "interconnect_bandwidth must be"),
                               ("interconnect_latency", -1e-6, "interconnect_latency must be the seconds")):
        with pytest.raises(ValueError, match=f"^remat.profile: {said}") as refused:
            remat.profile(model, x, **{keyword: bad})
        assert "\n" not in str(refused.value)


def test_a_recomputation_that_stops_before_a_collective_does_not_pay_it():
    """The Llama's recomputation stops at its last saved tensor, before the down projection's all-reduce: its
    forward pays the all-reduce, its checkpoint price does not, and a block inside a region (which reruns that
    tail for the next block) pays it in its tail."""
    from torch.distributed.device_mesh import init_device_mesh

    ids = torch.empty(4, 128, dtype=torch.long, device="meta")
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = worker._llama(mesh)
        prof = remat.profile(model, input_ids=ids, labels=ids, device="meta", **LINK)
    wire = LINK["interconnect_latency"] + 4 * 128 * 64 * 4 / LINK["interconnect_bandwidth"]  # 2 (n - 1) / n = 1
    for row in prof.rows:
        assert row.collectives == 0 and row.tail_collectives == 1, row
        assert row.forward_time == pytest.approx(row.matmul_time + wire, rel=1e-12)
        assert row.checkpoint_time == pytest.approx(row.matmul_time, rel=1e-12)
        assert row.tail_time == pytest.approx(wire, rel=1e-12)
