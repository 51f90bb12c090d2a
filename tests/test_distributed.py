"""DDP and FSDP2 with remat checkpointing, under torchrun with two CPU processes (gloo; the launch is conftest's
``two_rank_reports``)."""

import json

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_ddp_and_fsdp2_gradients_equal_single_process(two_rank_reports):
    out, reports = two_rank_reports
    assert out.returncode == 0, out.stderr[-4000:]
    worst = json.loads(reports["dist_worker"].read_text())
    assert set(worst) == {"ddp", "ddp_static_graph", "ddp_find_unused", "fsdp2"}
    for label, diff in worst.items():
        assert diff < 1e-5, (label, diff)  # all-reduce sums in another order than one process: rounding only


def test_chunked_loss_under_ddp_and_fsdp2_equals_single_process(two_rank_reports):
    out, reports = two_rank_reports
    assert out.returncode == 0, out.stderr[-4000:]
    worst = json.loads(reports["dist_chunked_worker"].read_text())
    assert set(worst) == {"ddp", "fsdp2"}
    for label, diff in worst.items():
        assert diff < 1e-5, (label, diff)  # chunk sums and the all-reduce add in another order: rounding only
