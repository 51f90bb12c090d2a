"""DDP and FSDP2 with remat checkpointing, under torchrun with two CPU processes (gloo; the launch is conftest's
``two_rank_reports``)."""


import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_ddp_and_fsdp2_gradients_equal_single_process(two_rank_report):
    worst = two_rank_report("dist_worker")
    assert set(worst) == {"ddp", "ddp_static_graph", "ddp_find_unused", "fsdp2"}
    for label, diff in worst.items():
        assert diff < 1e-5, (label, diff)  # all-reduce sums in another order than one process: rounding only


def test_chunked_loss_under_ddp_and_fsdp2_equals_single_process(two_rank_report):
    worst = two_rank_report("dist_chunked_worker")
    assert set(worst) == {"ddp", "fsdp2"}
    for label, diff in worst.items():
        assert diff < 1e-5, (label, diff)  # chunk sums and the all-reduce add in another order: rounding only


def test_tensor_parallel_blocks_keep_what_crossed_the_wire(two_rank_report):
    """Checkpointing a TP block reruns its all-reduce in backward (torch's drop-in semantics, 3 blocks: 3 -> 6
    a step); save_matmuls and save_collectives keep the collective's output, so backward runs as many
    all-reduces as without checkpointing. Every mode's loss and gradient shards are bitwise the plain TP
    model's at each of two SGD steps."""
    results = two_rank_report("tp_worker")
    plain = results["plain"]["all_reduce"]
    assert plain == [3, 3]  # each block's up projection's input gradient
    assert results["checkpoint"]["all_reduce"] == [6, 6]
    for mode in ("save_matmuls", "save_collectives", "save_collectives_and_names", "partitioned"):
        assert results[mode]["all_reduce"] == plain, (mode, results[mode])
    assert all(result["bitwise"] for result in results.values()), results


def test_partitioned_inputs_keep_a_slice_per_rank_and_gather_in_backward(two_rank_report):
    """partition_inputs: each rank keeps half of every block's input (which both ranks hold in full under TP),
    backward all-gathers each once a step, the forward's peak falls, and gradients stay bitwise."""
    results = two_rank_report("tp_worker")
    partitioned = results["partitioned"]
    assert partitioned["kept"] * 2 == partitioned["whole"] > 0
    assert partitioned["gathers"] == 3 * 2  # 3 blocks, 2 steps
    assert all(a < b for a, b in zip(partitioned["forward_peaks"], results["save_collectives"]["forward_peaks"]))
    assert partitioned["bitwise"]
    assert partitioned["inplace_refused"]  # an input changed in place after the save: refused, not wrong gradients
