"""The routes a distributed job takes, on two CPU ranks under torchrun (gloo; the launch is conftest's
``two_rank_reports``, the ranks' work tests/ecosystem_worker.py): the ``remat`` command given a factory that shards
its model with FSDP2, torchtitan's order (checkpointing, then compile per block, then ``fully_shard``), and
Hugging Face's Trainer (DDP on the CPU); and the command's rank questions answered in one process."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

from remat.tools import ranked

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def per_rank(two_rank_report):
    return two_rank_report("ecosystem_worker")


@pytest.mark.parametrize("wrapper", ["command", "command_ddp"])
def test_remat_plan_under_torchrun_plans_every_rank_and_rank_0_prints(per_rank, wrapper):
    first, second = (rank[wrapper]["plan"] for rank in per_rank)
    assert first["status"] == second["status"] == 0
    assert "plan written to" in first["stdout"] and "checkpoint" in first["stdout"]
    assert second["stdout"] == ""


@pytest.mark.parametrize("wrapper", ["command", "command_ddp"])
def test_remat_check_under_torchrun_reports_every_rank_on_rank_0(per_rank, wrapper):
    """A factory that shards its model with FSDP2 (which cannot be copied: the check's second copy comes from the
    factory) or wraps it in DDP; every rank's steps in rank 0's table, each rank's verdict after it."""
    steps = 2 if wrapper == "command" else 1
    first, second = (rank[wrapper]["check"] for rank in per_rank)
    assert first["status"] == second["status"] == 0, first["stdout"]
    assert second["stdout"] == ""
    table = first["stdout"]
    assert "on every rank" in table and any(line.startswith("┃ rank") for line in table.splitlines())
    rows = [line.split("│")[1:3] for line in table.splitlines() if line.startswith("│")]
    assert [(rank.strip(), step.strip()) for rank, step in rows] == [
        (str(rank), str(step)) for rank in (0, 1) for step in range(1, steps + 1)]
    for rank in (0, 1):
        assert f"rank {rank}: the plan holds: {steps} sgd steps peaked within 3% of the predicted" in table


def test_torchtitan_order_checkpoint_compile_then_shard_trains_bitwise(per_rank):
    for rank in per_rank:
        case = rank["torchtitan"]
        assert case["bitwise"], case
        assert [name == "CheckpointWrapper" for name in case["blocks"]] == [
            decision != "keep" for decision in case["decisions"].values()]


def test_trainer_trains_a_plan_applied_before_it_wraps_the_model_bitwise(per_rank):
    for rank in per_rank:
        case = rank["trainer"]
        assert case["wrapped_in"] == "DistributedDataParallel"
        assert case["planned"] == sum(decision != "keep" for decision in case["decisions"].values()) > 0
        assert case["losses"] == case["expected_losses"]
        assert case["parameters_equal"]
    assert per_rank[0]["trainer"]["decisions"] == per_rank[1]["trainer"]["decisions"]


def test_without_torchrun_the_command_runs_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not ranked.launched()
    with ranked.process_group(), ranked.speaking() as speaks:
        assert speaks and not dist.is_initialized()
    assert ranked.rank() == 0 and ranked.where() == ""
    assert ranked.gathered("mine") == ["mine"]


def test_a_rank_names_itself_and_knows_a_peer_that_left(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert ranked.launched() and ranked.where() == " on rank 1"
    assert ranked.another_rank_failed(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:11969"))
    assert not ranked.another_rank_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    twice = ValueError("trying to initialize the default process group twice!")
    assert ranked.factory_hint(twice).startswith("; the command sets up torchrun's process group before it calls")
    assert ranked.factory_hint(ValueError("no weights here")) == ""


def test_the_check_gets_the_built_model_first_then_new_ones():
    made = []

    def factory():
        made.append(nn.Linear(2, 2))
        return made[-1]

    first = factory()
    build = ranked.built_once(first, factory)
    assert build() is first
    second = build()
    assert second is made[-1] and second is not first
    assert isinstance(second.weight, torch.Tensor)
