"""remat.profile and remat.plan on tensor- (and sequence-) parallel models, on every rank of a torchrun job (two
CPU ranks, gloo; the launch is conftest's ``two_rank_reports``, the ranks' work tests/tp_plan_worker.py), and a
plan's mesh and a sequence-sharded activation's bytes checked in one process."""


import pytest
import torch
import torch.distributed as dist

import remat
from remat.planning.basics import ranks
from remat.planning.solve.plan import describe_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

MODELS = ("gpt", "llama", "gpt_sequence_parallel")
BUDGETS = ("90%", "50%")
PLANS = (*BUDGETS, "every block", "floor")  # at each budget, every block checkpointed (prof.price), the lowest


@pytest.fixture(scope="module")
def per_rank(two_rank_report):
    return two_rank_report("tp_plan_worker")


@pytest.mark.parametrize("model", MODELS)
def test_every_rank_profiles_and_plans_alike(per_rank, model):
    """Every timed run of a block runs its all-reduce on every rank in the same order: no rank waits forever."""
    first, second = (rank[model] for rank in per_rank)
    assert first["profiled_peak"] == second["profiled_peak"]
    for budget in BUDGETS:
        assert first[budget]["decisions"] == second[budget]["decisions"]
        assert first[budget]["predicted_peak"] == second[budget]["predicted_peak"]
    assert set(first["50%"]["decisions"].values()) != {"keep"}


@pytest.mark.parametrize("model", MODELS)
def test_parameters_are_the_ranks_shards(per_rank, model):
    """Column- and row-wise layers hold half their weights on each of two ranks: fewer bytes than the whole."""
    for rank in per_rank:
        case = rank[model]
        assert case["param_bytes"] < case["whole_param_bytes"], case


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", PLANS)
def test_per_rank_peaks_are_predicted_at_every_step_and_gradients_are_bitwise(per_rank, model, budget):
    """Within 3%, not to the byte: gloo's thread may let go of an all-reduce's buffer after the step's peak."""
    for rank in per_rank:
        case = rank[model]
        assert all(abs(m - case["profiled_peak"]) <= 0.03 * case["profiled_peak"] for m in case["unplanned"]), case
        planned = case[budget]
        assert planned["bitwise"], planned
        assert len(planned["measured"]) == 3
        for measured in planned["measured"]:
            assert abs(measured - planned["predicted_peak"]) <= 0.03 * planned["predicted_peak"], planned


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("budget", PLANS)
def test_backward_sends_again_exactly_the_collectives_the_plan_says(per_rank, model, budget):
    """A planned backward runs the unplanned one's all-reduces plus those its recomputations send again, as many as
    the plan predicts and prints; none where every recomputed block keeps what crossed the wire."""
    for rank in per_rank:
        case, planned = rank[model], rank[model][budget]
        assert planned["reduces"] == [n + planned["rerun"] for n in case["unplanned_reduces"]], (case, planned)
        assert ("collectives again per step" in planned["printed"]) == (planned["rerun"] > 0), planned["printed"]


@pytest.mark.parametrize("model", MODELS)
def test_plans_keep_what_crossed_the_wire_wherever_that_fits(per_rank, model):
    """At 90% and 50% a plan that keeps every collective's output fits: none is sent again.  At the lowest peak
    any plan reaches, the GPTs' blocks must free their all-reduce's (or reduce-scatter's) output too: the plan sends
    those again and says why; the Llama's recomputation reaches no collective."""
    for rank in per_rank:
        case = rank[model]
        assert [case[budget]["rerun"] for budget in BUDGETS] == [0, 0], case
        floor = case["floor"]
        if model == "llama":
            assert floor["rerun"] == 0
            continue
        assert floor["rerun"] > 0, floor
        assert "no plan that keeps every collective's output fits the budget" in floor["printed"], floor["printed"]


def test_checkpointed_blocks_send_their_all_reduce_again_where_the_recomputation_reaches_it(per_rank):
    """The GPT's dropout after the down projection saves its mask, made from the all-reduced output: each of its 4
    checkpointed blocks reruns that all-reduce.  The Llama's recomputation stops before its down projection."""
    for rank in per_rank:
        assert rank["gpt"]["every block"]["rerun"] == 4
        assert rank["gpt"]["every block"]["reduces"] == [n + 4 for n in rank["gpt"]["unplanned_reduces"]]
        assert rank["llama"]["every block"]["rerun"] == 0


def test_sequence_parallel_keeps_what_crossed_the_wire(per_rank):
    """Sequence parallel: per block, the attention and MLP inputs' all-gathers and their output projections'
    reduce-scatters.  Every block checkpointed reruns the forward's 4 per block (4 blocks: 16 more in backward);
    every block ``save_matmuls`` keeps their outputs: backward runs exactly the unplanned model's collectives, and
    trains bitwise."""
    for rank in per_rank:
        case = rank["gpt_sequence_parallel"]
        assert case["every block"]["rerun"] == 16, case["every block"]
        assert case["every block"]["reduces"] == [n + 16 for n in case["unplanned_reduces"]]
        assert case["save_matmuls"]["bitwise"], case["save_matmuls"]
        assert case["save_matmuls"]["reduces"] == case["unplanned_reduces"], case


@pytest.mark.parametrize("model", MODELS)
def test_a_plan_refuses_a_model_on_another_mesh_in_one_line(per_rank, model):
    for rank in per_rank:
        unsharded, other = rank[model]["unsharded"], rank[model]["other_mesh"]
        assert unsharded.startswith("remat.Plan.apply: this plan was made for tensor parallel on a mesh of shape "
                                    "(2,) over 2 ranks and the model is not tensor parallel"), unsharded
        assert other.startswith("remat.Plan.apply: this plan was made for tensor parallel on a mesh of shape (2,) "
                                "over 2 ranks and the model is tensor parallel on a mesh of shape (2,) (tp) over 2 "
                                "ranks;"), other
        assert "\n" not in unsharded and "\n" not in other


def test_a_split_output_layer_is_planned_without_the_chunked_head(per_rank):
    for rank in per_rank:
        case = rank["split_output_layer"]
        assert case["head"] is False and case["chunks"] == 0, case
        assert set(case["decisions"].values()) != {"keep"}, case


def test_a_plan_made_without_a_mesh_refuses_a_tensor_parallel_model(monkeypatch):
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = remat.Plan(decisions={"0": "checkpoint", "1": "keep"}, predicted_peak=0, predicted_extra_time=0.0,
                      budget=0, baseline_peak=0, param_bytes=0, meta=describe_model(model, ["0", "1"]))
    assert plan.meta["mesh"] is None
    import remat.planning.solve.plan as plan_module

    monkeypatch.setattr(plan_module, "mesh_of", lambda _: {"shape": [2], "dims": ["tp"], "world size": 2})
    with pytest.raises(ValueError, match=r"made for a model not tensor parallel .* and the model is tensor parallel "
                                         r"on a mesh of shape \(2,\) \(tp\) over 2 ranks"):
        plan.apply(model)


def test_a_plan_without_a_recorded_mesh_applies_as_before():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    meta = describe_model(model, ["0", "1"])
    del meta["mesh"]  # a plan saved before meshes were recorded
    plan = remat.Plan(decisions={"0": "checkpoint", "1": "keep"}, predicted_peak=0, predicted_extra_time=0.0,
                      budget=0, baseline_peak=0, param_bytes=0, meta=meta)
    plan.apply(model)
    assert isinstance(model[0], remat.ActivationWrapper)


def test_a_model_without_dtensor_parameters_is_on_no_mesh():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4))
    assert not ranks.on_mesh(model) and ranks.mesh_of(model) is None


def _layer_norm_bytes(sequence_parallel: bool) -> list[int]:
    """The bytes each op of two LayerNorm blocks makes, as the op graph records them, on 8 positions of a sequence
    of 16: sequence parallel in a fake world of two ranks (the blocks see DTensors), or plain on the 8."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from remat.planning.measure.opgraph import profile_ops

    model = nn.Sequential(nn.Sequential(nn.LayerNorm(16)), nn.Sequential(nn.LayerNorm(16)))
    x = torch.randn(2, 8, 16, requires_grad=True)
    if sequence_parallel:
        mesh = init_device_mesh("cpu", (2,))
        for block in model:  # its input, this rank's half of the sequence, read as Shard(1); a DTensor out
            parallelize_module(block, mesh, {"0": SequenceParallel()})
    graphs = profile_ops(model, x, modules=["0", "1"], timing="estimate").blocks
    return [node.out_bytes for name in ("0", "1") for node in graphs[name].nodes if node.kind == "compute"]


def test_the_op_graph_counts_a_sequence_sharded_activation_as_the_ranks_part():
    """A DTensor's own storage reads as the whole tensor's bytes: the op graph counts the local part."""
    plain = _layer_norm_bytes(False)
    with remat.fake_world(2):
        sharded = _layer_norm_bytes(True)
    assert plain and sharded == plain, (sharded, plain)


def _meta_gpt_profile(model: str) -> remat.Profile:
    """The two-rank run's tensor- (or sequence-) parallel GPT built on the meta device in a fake world of two ranks,
    profiled as the run profiles it (the output let go of once the loss is computed)."""
    import tp_plan_worker as worker
    from torch.distributed.device_mesh import init_device_mesh

    tokens, targets = _meta_batch(worker.GPT_CFG, 8)
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            built = worker._gpt(mesh) if model == "gpt" else worker._gpt_sequence_parallel(mesh)
        return remat.profile(built, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), device="meta", hold_output=False)


def _meta_batch(config, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and targets on the meta device laid out as the run's (two slices of one batch): a view of an input
    counts its storage from then on, as ``measure_step`` does, so the meta step must make the same views."""
    from remat.models import synthetic_batch

    return synthetic_batch(config, batch, device="meta")


@pytest.mark.parametrize("model", ["gpt", "gpt_sequence_parallel"])
def test_meta_in_a_fake_world_of_two_predicts_each_real_ranks_peak_and_collectives(per_rank, model):
    """One process plans the tensor- (and sequence-) parallel GPT for two ranks: its unplanned peak and those of the
    real run's plans made of whole-block options (every block checkpointed among them) within 3% of each rank's
    measured peak at every step, and each plan sends again as many collectives as the real backward did."""
    prof = _meta_gpt_profile(model)
    compared = 0
    for rank in per_rank:
        case = rank[model]
        assert all(abs(m - prof.peak_bytes) <= 0.03 * m for m in case["unplanned"]), (prof.peak_bytes, case)
        for budget in PLANS:
            real = case[budget]
            if not set(real["decisions"].values()) <= {"keep", "checkpoint", "save_matmuls"}:
                continue  # a selective decision needs its op-level policy, which the report does not carry
            on_meta = prof.price(real["decisions"])
            assert on_meta.collectives_rerun == real["rerun"], (budget, real)
            assert all(abs(m - on_meta.predicted_peak) <= 0.03 * m for m in real["measured"]), (budget, real)
            compared += 1
    assert compared >= 2  # every block checkpointed, on each rank


@pytest.mark.parametrize("model", ["gpt", "gpt_sequence_parallel"])
def test_what_crossed_the_wire_is_counted_where_a_plan_keeps_it(model):
    """In a fake world of two ranks collectives complete in line (no process group's thread holds their buffers), so
    a step's bytes are deterministic: the step without a plan, every block ``save_matmuls`` (which keeps the
    all-reduces', all-gathers' and reduce-scatters' outputs beside the matmuls'), every block checkpointed and every
    block but the last keeping what crossed the wire and rerunning the rest peak where predicted, to 1 KiB
    (decisions fixed, not a budget's: which a budget takes follows this machine's timings).  Sequence parallel's
    embedding makes a DTensor of the token ids, a view of the batch's storage (8 x 65 int64: the targets' too),
    which ``measure_step`` counts from there on: so must the profile."""
    import tp_plan_worker as worker
    from torch.distributed.device_mesh import init_device_mesh

    from remat.planning.choices.options import selective_option
    from remat.planning.measure.prices import wire_nodes
    from remat.planning.solve.solver import plan_of

    build = {"gpt": worker._gpt, "gpt_sequence_parallel": worker._gpt_sequence_parallel}[model]
    tokens, targets = worker._batches(model)[0]
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        prof = remat.profile(build(mesh), tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), repeats=1, hold_output=False)
        blocks = [row.name for row in prof.rows]
        wired = [(p, selective_option(row, prof.ops.blocks[row.name], wire_nodes(prof.ops.blocks[row.name])))
                 for p, row in enumerate(prof.rows[:-1])]
        assert all(option.resends == 0 for _, option in wired)
        plans = [prof.price(dict.fromkeys(blocks, "save_matmuls")), prof.price(dict.fromkeys(blocks, "checkpoint")),
                 plan_of(prof, wired, prof.peak_bytes)]
        cases = [(build(mesh), {}, prof.peak_bytes)] + [(plan.apply(build(mesh)), plan.decisions, plan.predicted_peak)
                                                        for plan in plans]
        for trained, decisions, predicted in cases:
            opt = torch.optim.SGD(trained.parameters(), lr=0.1)

            def step(trained=trained, opt=opt):
                opt.zero_grad()
                trained.loss(tokens, targets).backward()
                opt.step()

            measured = remat.measure_step(step, trained, opt).peak_total
            assert abs(measured - predicted) <= 1024, (decisions, measured, predicted)


def test_partitioned_inputs_train_bitwise_at_the_predicted_peak_with_one_all_gather_each(per_rank):
    """Every block ``checkpoint_partitioned`` (priced by name, saved, loaded and applied): each rank keeps half of
    each block's 1 MiB input and gathers it back in backward; its backward runs the unplanned all-reduces and one
    all-gather per block, none sent again, gradients bitwise, and each step's per-rank peak is the prediction.

    Within 1.5%: no recomputation here reruns a collective, so no buffer gloo's thread lets go of late enters the
    prediction; the shard held beside the gathered input in the first block's backward is 2.9% of the peak.  Above
    it, a step may hold one gathered input (1 MiB) more: gloo's thread lets go of an all-gather's output after the
    all-gather has returned, now and then after the step's peak (:func:`_holds`)."""
    for rank in per_rank:
        case = rank["partitioned"]
        assert case["partitioned"] == {f"blocks.{i}": 512 << 10 for i in range(3)}, case["partitioned"]
        planned = case["every block"]
        assert set(planned["decisions"].values()) == {"checkpoint_partitioned"}, planned
        assert planned["bitwise"], planned
        assert planned["rerun"] == 0
        assert planned["reduces"] == [n + 3 for n in case["unplanned_reduces"]], (case["unplanned_reduces"], planned)
        assert len(planned["measured"]) == 3
        assert _holds(planned["measured"], planned["predicted_peak"], 0.015), planned
        assert "one shard per tensor-parallel rank, all-gathered in backward" in planned["printed"], planned["printed"]


def test_partitioned_inputs_keep_the_all_reduce_the_recomputation_reaches(per_rank):
    """With dropout after the down projection a block's recomputation reaches its all-reduce: the option keeps its
    output beside the shards, so backward runs the unplanned all-reduces and one all-gather per block, bitwise."""
    for rank in per_rank:
        case = rank["partitioned"]["dropout"]
        assert set(case["decisions"].values()) == {"checkpoint_partitioned"}, case
        assert case["bitwise"] and case["rerun"] == 0, case
        assert case["reduces"] == [n + 3 for n in case["unplanned_reduces"]], case


def test_a_second_profile_reads_the_all_gather_time_the_first_kept(per_rank):
    """Two profiles of models whose blocks' inputs make the same 512 KiB shards on the same group: the second reads
    the time the first measured and kept in the timings file (rank 0 reads it and hands it to every rank)."""
    for rank in per_rank:
        first, second = rank["partitioned"]["gather_times"]
        assert first == second > 0, rank["partitioned"]["gather_times"]
    assert len({tuple(rank["partitioned"]["gather_times"]) for rank in per_rank}) == 1


def test_the_planner_takes_partitioned_inputs_where_no_plan_without_them_fits(per_rank):
    """At the every-block plan's own peak no plan of the other options fits: the solver's plan keeps some block's
    input as shards (one all-gather more in backward for each), trains bitwise and peaks as predicted."""
    for rank in per_rank:
        case = rank["partitioned"]
        assert case["without it"] == "refused", case["without it"]
        planned = case["at its peak"]
        partitioned = [name for name, decision in planned["decisions"].items() if decision == "checkpoint_partitioned"]
        assert partitioned, planned["decisions"]
        assert planned["bitwise"] and planned["rerun"] == 0, planned
        assert planned["reduces"] == [n + len(partitioned) for n in case["unplanned_reduces"]], planned
        assert _holds(planned["measured"], planned["predicted_peak"], 0.03), planned


_GATHERED = 1 << 20  # a partitioned block's input, whole: what one all-gather in backward allocates


def _holds(measured: list[int], predicted: int, share: float) -> bool:
    """Every step within ``share`` of the prediction, or above it by at most one all-gather's output more, which
    gloo's thread may not have let go of yet at the step's peak (never below)."""
    return all(-share * predicted <= m - predicted <= share * predicted + _GATHERED for m in measured)


def _meta_partitioned_profile() -> remat.Profile:
    """The two-rank run's GPT with 1 MiB block inputs, built on the meta device in a fake world of two ranks."""
    import tp_plan_worker as worker
    from torch.distributed.device_mesh import init_device_mesh

    tokens, targets = _meta_batch(worker.PARTITIONED_CFG, worker.PARTITIONED_BATCH)
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            built = worker._gpt(mesh, worker.PARTITIONED_CFG)
        return remat.profile(built, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), device="meta", hold_output=False)


def test_meta_in_a_fake_world_of_two_prices_partitioned_inputs_over_the_interconnect(per_rank):
    """On the meta device the same rule finds each block's 1 MiB input, and its all-gather is priced over the modelled
    interconnect (10 us + half of the gathered 1 MiB over 200 GB/s); every block ``checkpoint_partitioned`` is
    predicted at the real two-rank run's predicted peak, and within 1.5% of each rank's measured one; a plan at that
    peak takes the option."""
    from remat.planning.measure.gathers import PartitionedInputs
    from remat.planning.measure.interconnect import Interconnect

    prof = _meta_partitioned_profile()
    gather = Interconnect().seconds("all_gather_into_tensor", 1 << 20, 2)
    assert gather == pytest.approx(10e-6 + (512 << 10) / 200e9)
    assert prof.partitioned == {f"blocks.{i}": PartitionedInputs(whole=1 << 20, shard=512 << 10, gathered=1 << 20,
                                                                 gather_time=gather, world=2) for i in range(3)}
    every = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows})
    checkpointed = prof.price({row.name: "checkpoint" for row in prof.rows})  # no dropout: no collective kept
    assert every.predicted_extra_time - checkpointed.predicted_extra_time == pytest.approx(3 * gather, rel=1e-4)
    for rank in per_rank:
        real = rank["partitioned"]["every block"]
        assert every.predicted_peak == real["predicted_peak"], (every.predicted_peak, real)
        assert all(abs(m - every.predicted_peak) <= 0.015 * m for m in real["measured"]), (every.predicted_peak, real)
    assert "checkpoint_partitioned" in prof.plan(every.predicted_peak).decisions.values()


def test_a_partitioned_plan_refuses_a_model_without_a_mesh_in_one_line(per_rank):
    for rank in per_rank:
        refused = rank["partitioned"]["unsharded"]
        assert refused.startswith("remat.Plan.apply: this plan was made for tensor parallel on a mesh of shape (2,)")
        assert "\n" not in refused


def test_a_partitioned_decision_needs_a_tensor_parallel_model():
    """A plan made by hand, with no mesh recorded, names the block and what is missing instead of failing inside."""
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = remat.Plan(decisions={"0": "checkpoint_partitioned", "1": "keep"}, predicted_peak=0,
                      predicted_extra_time=0.0, budget=0, baseline_peak=0, param_bytes=0,
                      meta=describe_model(model, ["0", "1"]))
    with pytest.raises(ValueError) as refused:
        plan.apply(model)
    assert str(refused.value) == (
        "remat.Plan.apply: the plan keeps `0`'s inputs as shards across tensor-parallel ranks (checkpoint_partitioned) "
        "and this Sequential is not tensor parallel; apply it to the tensor-parallel model it was made for, or plan "
        "this model.")
    assert not isinstance(model[0], remat.ActivationWrapper)  # refused before anything is wrapped


def test_the_group_of_a_mesh_of_more_dimensions_is_refused_in_one_line():
    """Parameters distributed over a whole 2-D mesh: which ranks hold equal activations is not decidable."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with remat.fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate(), Shard(0)]))
        with pytest.raises(ValueError, match=r"^remat: Linear's tensor-parallel parameters are spread over a 2-D mesh "
                                             r"\(2, 2\); partitioned inputs need tensor parallel on a 1-D mesh"):
            ranks.tensor_parallel_group(model)
        one = init_device_mesh("cpu", (4,))
        flat = nn.Linear(4, 4)
        flat.weight = nn.Parameter(distribute_tensor(flat.weight.detach(), one, [Shard(0)]))
        assert ranks.tensor_parallel_group(flat) is one.get_group()


def test_on_a_whole_2d_mesh_the_group_is_the_dimension_fsdp2_leaves_that_shards_parameters():
    """Parameters distributed over a whole (dp, tp) mesh and sharded by FSDP2 over ``dp`` (``dp_mesh_dims``): the
    inputs are gathered over ``tp``, the one dimension left on which a parameter is sharded; FSDP2 over both, or
    over ``dp`` with every parameter replicated over ``tp``, leaves it undecided: refused in one line."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def built(mesh, tp_placement, data_parallel):
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
        for layer in model:
            for name in ("weight", "bias"):
                whole = getattr(layer, name).detach()
                setattr(layer, name, nn.Parameter(distribute_tensor(whole, mesh, [Replicate(), tp_placement])))
        return fully_shard(model, mesh=mesh, dp_mesh_dims=data_parallel)

    with remat.fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = built(mesh, Shard(0), DataParallelMeshDims(shard="dp"))
        assert ranks.tensor_parallel_group(model) is mesh.get_group("tp")
        for undecided in (built(mesh, Replicate(), DataParallelMeshDims(shard=("dp", "tp"))),
                          built(mesh, Replicate(), DataParallelMeshDims(shard="dp"))):
            with pytest.raises(ValueError, match=r"^remat: Sequential's tensor-parallel parameters are spread over a "
                                                 r"2-D mesh \(2, 2\); .* fully_shard names \(dp_mesh_dims=...\), "
                                                 r"leaving one that shards parameters: plan without "
                                                 r"checkpoint_partitioned\.$"):
                ranks.tensor_parallel_group(undecided)


def test_fsdp2_and_tensor_parallel_on_a_2x2_mesh_price_partitioned_inputs_over_tp_on_meta():
    """The GPT with 1 MiB block inputs, its MLPs split over ``tp`` and its blocks sharded by FSDP2 over ``dp``, on
    the meta device in a fake world of four ranks: the inputs are gathered over the two ranks of ``tp``, and every
    block ``checkpoint_partitioned`` is predicted at 17,976,968 bytes, the peak the real four-rank run predicted
    and measured on every rank at every step (BENCHMARKS.md, benchmarks/tp.py --models gpt_part); a plan at that
    peak takes the option."""
    import tp_plan_worker as worker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tokens, targets = _meta_batch(worker.PARTITIONED_CFG, worker.PARTITIONED_BATCH)
    with remat.fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = worker._gpt(mesh["tp"], worker.PARTITIONED_CFG)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        assert ranks.tensor_parallel_group(model) is mesh["tp"].get_group()
        prof = remat.profile(model, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), device="meta", hold_output=False)
    assert {name: (entry.shard, entry.world) for name, entry in prof.partitioned.items()} == {
        f"blocks.{i}": (512 << 10, 2) for i in range(3)}
    every = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows})
    assert every.predicted_peak == 17_976_968
    assert "checkpoint_partitioned" in prof.plan(every.predicted_peak).decisions.values()


def test_an_input_is_kept_as_a_shard_by_one_rule():
    """What the profile counts as a block's sharded input is what the hooks shard: plain tensors of 1 MiB and more,
    contiguous, not parameters nor leaves that require grad (and, as a plan installs them, tensors that require
    grad only); a shard is a padded 1/world share."""
    from torch import nn

    from remat.policies.partition import shard_bytes

    big = torch.zeros(1 << 18) + 1  # 1 MiB, made by an op
    assert shard_bytes(big, 2) == 1 << 19 and shard_bytes(big, 3) == -(-(1 << 18) // 3) * 4
    assert shard_bytes(big, 1) is None and shard_bytes(big[: 1 << 17], 2) is None  # one rank; under 1 MiB
    assert shard_bytes(nn.Parameter(torch.zeros(1 << 18)), 2) is None
    assert shard_bytes(torch.zeros(1 << 18, requires_grad=True), 2) is None
    assert shard_bytes(torch.zeros(2, 1 << 18).t(), 2) is None  # not contiguous
    # what a plan's hooks shard: activations (they require grad), not a rotary table, a mask or position ids
    hidden = torch.zeros(1 << 18, requires_grad=True) + 1
    assert shard_bytes(hidden, 2, activations_only=True) == 1 << 19
    assert shard_bytes(big, 2, activations_only=True) is None


def test_partitioned_inputs_alone_on_a_model_without_a_mesh_are_refused_in_one_line():
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    prof = remat.profile(model, torch.randn(8, 32), loss_fn=lambda out: out.sum(), repeats=1)
    assert prof.partitioned == {}
    with pytest.raises(ValueError) as refused:
        prof.plan("60%", allow=("checkpoint_partitioned",))
    assert str(refused.value) == (
        "remat.plan: checkpoint_partitioned needs a tensor-parallel model profiled on every rank under torchrun (or on "
        "the meta device in remat.fake_world), whose blocks take inputs of 1 MiB or more that every rank holds in "
        "full; this profile has none: allow checkpoint, save_matmuls or selective.")
    with pytest.raises(ValueError) as priced:
        prof.price({"0": "checkpoint_partitioned"})
    assert str(priced.value).startswith(
        "remat.plan_for: `0` has no option 'checkpoint_partitioned' here (the profile found no input of its own of "
        "1 MiB or more that every tensor-parallel rank holds in full); it has checkpoint")
    with pytest.warns(UserWarning, match=r"^remat.profile: interconnect_bandwidth and interconnect_latency price "
                                         r"collectives on the meta device only"):
        remat.profile(model, torch.randn(8, 32), loss_fn=lambda out: out.sum(), repeats=1,
                      interconnect_bandwidth=25e9)


def test_print_names_the_blocks_that_send_collectives_again_or_their_count_in_a_deep_model():
    def printed(counts):
        names = [f"blocks.{i}" for i in range(len(counts))]
        plan = remat.Plan(decisions=dict.fromkeys(names, "checkpoint"), predicted_peak=10, predicted_extra_time=0.0,
                          budget=10, baseline_peak=20, param_bytes=0,
                          blocks={n: {"kept": 1, "extra_time": 0.0, "collectives": c} for n, c in zip(names, counts)})
        return str(plan)

    assert "sends 4 collectives again per step (blocks.0 1, blocks.1 1, blocks.2 2)," in printed([1, 1, 2])
    assert "sends 32 collectives again per step (1 in each of 32 blocks)," in printed([1] * 32)
    assert "(blocks.0 1, blocks.1 2, blocks.2 1, blocks.3 1, and 2 more blocks)," in printed([1, 2, 1, 1, 1, 1])
