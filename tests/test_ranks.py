"""remat.plan on every rank of a torchrun job (two CPU ranks, gloo; the launch is conftest's ``two_rank_reports``,
the ranks' work tests/ranks_worker.py), and the rank and wrapper questions answered in one process."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.planning.basics import ranks
from remat.planning.basics.units import format_bytes
from remat.planning.solve.plan import describe_model

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WRAPPERS = ("fsdp2", "fsdp2_kept", "ddp")


@pytest.fixture(scope="module")
def per_rank(two_rank_report):
    return two_rank_report("ranks_worker")


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_every_rank_plans_alike_without_hanging(per_rank, wrapper):
    first, second = (rank[wrapper] for rank in per_rank)
    assert first["decisions"] == second["decisions"]
    assert first["predicted_peak"] == second["predicted_peak"]
    assert "checkpoint" in first["decisions"].values()


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_plan_applied_after_or_before_wrapping_trains_bitwise(per_rank, wrapper):
    for rank in per_rank:
        assert rank[wrapper]["applied_after"], rank[wrapper]
        assert rank[wrapper]["applied_before"], rank[wrapper]
        assert rank[wrapper]["left_after_remove"] == []


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_per_rank_peaks_are_predicted_at_every_step(per_rank, wrapper):
    """What one rank holds: its shards, the units FSDP2 gathers (and keeps gathered), DDP's gradient buckets,
    activations; remat.measure_step's peak of every SGD step, unplanned and planned, on every rank.

    Within 3%, not to the byte: gloo's thread lets go of a collective's buffer when it is done with it, so a
    step may now and then still hold one block's all-gather buffer at its peak (about 1.6% of these steps)."""
    for rank in per_rank:
        case = rank[wrapper]
        for measured, predicted in [*((m, case["profiled_peak"]) for m in case["unplanned_peaks"]),
                                    *((m, case["predicted_peak"]) for m in case["planned_peaks"])]:
            assert abs(measured - predicted) <= 0.03 * predicted, case


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_check_plan_holds_on_every_rank(per_rank, wrapper):
    for rank in per_rank:
        assert rank[wrapper]["checked"] == [True, True]
        if wrapper == "ddp":
            assert rank[wrapper]["model_given"] == "checked"
        else:  # FSDP2 refuses to be deep-copied: the check builds its copies with the factory
            assert rank[wrapper]["model_given"] == (
                "remat.check_plan: GPT is sharded by FSDP2, which cannot be copied; pass a function that builds and "
                "shards it instead of the model, e.g. remat.check_plan(build_model, plan, ...).")


def test_a_rank_with_another_batch_shape_is_told_which_and_how(per_rank):
    for rank in per_rank:
        message = rank["desynchronised"]
        assert message.startswith("remat.profile: rank 1 differs from rank 0 in inputs: arg 0 4x64 there, arg 0 8x64 "
                                  "on rank 0;"), message
        assert "\n" not in message


def test_gpt2_under_fsdp2_plans_every_rank_alike_trains_bitwise_and_refuses_naming_the_smallest_peak(per_rank):
    """Hugging Face GPT-2 (its output layer tied to the token embedding, dropout in training, Conv1D) sharded by
    FSDP2: planned at 50% on every rank, each SGD step (holding the output through backward) within 3% of the
    prediction and bitwise equal to the unplanned run; 30% refused with the smallest peak any plan reaches, which
    is no more than the 50% plan's."""
    first, second = (rank["gpt2"] for rank in per_rank)
    assert first["decisions"] == second["decisions"] and first["predicted_peak"] == second["predicted_peak"]
    assert "checkpoint" in first["decisions"].values()
    for case in (first, second):
        assert case["applied_after"], case
        for measured, predicted in [*((m, case["profiled_peak"]) for m in case["unplanned_peaks"]),
                                    *((m, case["predicted_peak"]) for m in case["planned_peaks"])]:
            assert abs(measured - predicted) <= 0.03 * predicted, case
        smallest = case["refused"]["smallest"]
        assert smallest <= case["predicted_peak"]
        assert "the smallest peak any plan reaches is " in case["refused"]["message"]
        assert f"({format_bytes(smallest)} whole step)" in case["refused"]["message"]
        assert sum(case["refused"]["parts"].values()) == smallest
        assert "gathered parameters" in case["refused"]["message"]


def test_a_refusal_splits_the_smallest_peak_alike_on_every_rank(per_rank):
    """Refused at 1%: the smallest peak split into the rank's states, gathered parameters (FSDP2's alone),
    activations and the head, summing to it, the same on both ranks (rank 0's profile)."""
    for wrapper in ("fsdp2", "fsdp2_kept", "ddp"):
        first, second = (rank[wrapper]["floor"] for rank in per_rank)
        assert first == second, wrapper
        assert sum(first["parts"].values()) == first["smallest"], first
        assert (first["parts"]["gathered"] > 0) == (wrapper != "ddp"), first
    kept, resharded = (per_rank[0][wrapper]["floor"]["parts"] for wrapper in ("fsdp2_kept", "fsdp2"))
    assert kept["gathered"] > resharded["gathered"]  # every unit kept gathered from its forward to its backward


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_original_class_reads_fsdp2_classes_as_the_written_one():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    dynamic = type("FSDP_Block", (fsdp.FSDPModule, _Block), {})  # what fully_shard makes of a _Block
    block = _Block()
    block.__class__ = dynamic
    assert ranks.original_class(block) is _Block
    assert ranks.original_class(_Block()) is _Block


def test_one_process_profiles_alone_and_keeps_its_own_values():
    model = nn.Sequential(_Block())
    alone = ranks.Ranks.of(model)
    assert alone.model is model and not alone.together
    alone.agree("remat.profile", {"inputs": {"arg 0": "2x4"}})
    marker = object()
    assert alone.same(marker) is marker


def test_a_plan_checks_an_fsdp2_model_by_the_class_it_was_written_as():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    model = nn.Sequential(_Block(), _Block())
    plan = remat.Plan(decisions={"0": "checkpoint", "1": "keep"}, predicted_peak=0, predicted_extra_time=0.0,
                      budget=0, baseline_peak=0, param_bytes=0, meta=describe_model(model, ["0", "1"]))
    for module in model:  # what fully_shard per block, then the root, makes of the classes
        module.__class__ = type("FSDP_Block", (fsdp.FSDPModule, _Block), {})
    model.__class__ = type("FSDPSequential", (fsdp.FSDPModule, nn.Sequential), {})
    plan.apply(model)
    assert isinstance(model[0], remat.ActivationWrapper) and not isinstance(model[1], remat.ActivationWrapper)
    plan.remove(model)
    assert not isinstance(model[0], remat.ActivationWrapper)


class _Marked(nn.Module):
    """A block whose forward marks a profiler region, as FSDP2's hooks around a sharded block do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.profiler.record_function("marked"):
            return torch.relu(self.lin(x))


def test_a_block_that_marks_profiler_regions_is_profiled_and_timed():
    model = nn.Sequential(_Marked(), _Marked())
    prof = remat.profile(model, torch.randn(4, 8), loss_fn=lambda out: out.sum(), modules=["0", "1"], repeats=1)
    graph = prof.ops.blocks["0"]
    assert not any(node.op.startswith("profiler.") for node in graph.nodes)
    assert graph.forward_time > 0


@pytest.mark.parametrize("wrapper", ("fsdp2_bf16", "fsdp2_offload", "fsdp2_int"))
def test_fsdp2_settings_plan_every_rank_to_the_byte_and_train_bitwise(per_rank, wrapper):
    """bfloat16 parameters reduced in float32, CPU offload (on the CPU: the shards are on the host already, nothing
    moves) and blocks resharded to one rank after forward (FSDP2 reads 1 as False): planned at 60%, applied after
    wrapping; every SGD step of every rank within 3% of the prediction, gradients bitwise, nothing warned."""
    first, second = (rank[wrapper] for rank in per_rank)
    assert first["decisions"] == second["decisions"] and "checkpoint" in first["decisions"].values()
    for case in (first, second):
        assert case["applied_after"], case
        assert case["warned"] == []
        for measured, predicted in [*((m, case["profiled_peak"]) for m in case["unplanned_peaks"]),
                                    *((m, case["predicted_peak"]) for m in case["planned_peaks"])]:
            assert abs(measured - predicted) <= 0.03 * predicted, case


def test_settings_no_run_has_checked_are_named_in_one_line_each():
    """CPU offload is named only where the shards' home is off the CPU (an accelerator's mesh, stood in for by the
    groups' device: no accelerator here); a block resharded to fewer ranks after forward holds (benchmarks/ranks.py
    on 4 ranks), not named.  A fake world of 4 ranks, one process."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    with remat.fake_world(4), torch.device("meta"):
        mesh = init_device_mesh("cpu", (4,))
        model = nn.Sequential(_Block(), _Block())
        for block in model:
            fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=2,
                             offload_policy=fsdp.CPUOffloadPolicy(pin_memory=False))
        fsdp.fully_shard(model, mesh=mesh)
        on_cpu = ranks.unverified_settings(model)
        for block in model:
            block._get_fsdp_state()._fsdp_param_group.device = torch.device("meta")
        off_cpu = ranks.unverified_settings(model)
    assert on_cpu == []
    assert off_cpu == ["CPUOffloadPolicy (0, 1): the plan counts the parameter and gradient shards kept on the host "
                       "as device memory, an upper bound of the device's peak"]
    assert ranks.unverified_settings(nn.Sequential(_Block())) == []


def test_a_block_resharded_to_fewer_ranks_is_recorded_without_fsdp2s_post_forward_copy():
    """reshard_after_forward=N copies a block's shard for N ranks in FSDP2's post-forward hook, which a recomputation
    (FSDP2's hooks inert) does not run, nor the block's timed runs: its op graph is the one of a block resharded to
    the whole world (else the timed runs ran fewer ops than recorded, and the profile failed)."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh

    from remat.models import GPT, GPTConfig

    graphs = {}
    for after in (True, 2):
        with remat.fake_world(4):
            with torch.device("meta"):
                model = GPT(GPTConfig(vocab_size=128, seq_len=16, d_model=32, n_heads=2, n_layers=2))
                tokens = torch.zeros(2, 16, dtype=torch.long)
            mesh = init_device_mesh("cpu", (4,))
            for block in model.blocks:
                fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=after)
            fsdp.fully_shard(model, mesh=mesh)
            prof = remat.profile(model, tokens, loss_fn=lambda logits: logits.float().mean(), device="meta")
        graphs[after] = [node.op for node in prof.ops.blocks["blocks.0"].nodes]
    assert graphs[2] == graphs[True]
