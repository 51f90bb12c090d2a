"""One plan for every rank: remat.broadcast_plan under torchrun with two CPU processes (gloo; the launch is
conftest's ``two_rank_reports``)."""


import pytest
import torch.distributed as dist

import remat

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_every_rank_applies_rank_zeros_plan(two_rank_report):
    ranks = two_rank_report("broadcast_worker")
    assert len(ranks) == 2 and ranks[0] == ranks[1]
    assert ranks[0]["decisions"] == {"0": "checkpoint", "1": "keep", "2": "selective"}  # rank 0's own
    assert ranks[0]["again"] == ranks[0]["decisions"]
    assert ranks[0]["policies"]["2"]["ops"][0]["decision"] == "keep"
    assert ranks[0]["wrapped"] == ["0", "2"]


def test_without_a_process_group_the_plan_is_its_own():
    plan = remat.Plan({"a": "checkpoint"}, 1, 0.0, 1, 1, 0)
    assert remat.broadcast_plan(plan) is plan
    with pytest.raises(ValueError, match="no plan to broadcast"):
        remat.broadcast_plan(None)
