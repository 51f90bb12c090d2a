"""Plans for N ranks from one process: a model sharded by FSDP2 on the meta device in a fake world
(``remat.fake_world``), profiled as rank 0 of N; its peaks against those a real two-rank run measured
(tests/fakeworld_worker.py, in conftest's one ``two_rank_reports`` launch)."""


import pytest
import torch
import torch.distributed as dist

import remat
from remat.planning.basics import fakeworld, ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

fsdp = pytest.importorskip("torch.distributed.fsdp")
import fakeworld_worker as worker  # noqa: E402  (the two-rank run this file predicts)


@pytest.fixture(scope="module")
def measured(two_rank_report):
    return two_rank_report("fakeworld_worker")


def _meta_profile(case: str) -> remat.Profile:
    args, kwargs, loss_fn = worker.batch(case, torch.Generator().manual_seed(0), device="meta")
    with remat.fake_world(2):
        with torch.device("meta"):
            model = worker.build(case, 2)
        return remat.profile(model, *args, loss_fn=loss_fn, device="meta", **kwargs)


@pytest.mark.parametrize("case", worker.CASES)
def test_meta_in_a_fake_world_of_two_predicts_each_real_ranks_peak(measured, case):
    """Unplanned, and planned at 60% (the plan the real ranks made, priced on the meta profile): every step of
    every rank within 3% of the prediction (gloo's thread may hold one block's all-gather buffer a little longer,
    see test_ranks)."""
    prof = _meta_profile(case)
    assert any("fake world of 2 ranks" in note for note in prof.notes)
    assert prof.grad_bytes == prof.param_bytes  # one rank's gradient shards: each unit's reduce-scatter output once
    for rank in measured:
        mine = rank[case]
        planned = prof.price(mine["decisions"], mine["segments"]).predicted_peak
        assert any(decision != "keep" for decision in mine["decisions"].values())
        for predicted, peaks in ((prof.peak_bytes, mine["unplanned"]), (planned, mine["planned"])):
            for peak in peaks:
                assert abs(peak - predicted) <= 0.03 * peak, (case, predicted, peaks)


def test_the_fake_world_is_one_process_and_is_gone_afterwards():
    with remat.fake_world(8):
        assert fakeworld.fake_ranks() == 8
        assert dist.get_world_size() == 8
        assert not ranks.distributed()  # no rank to agree with: the profile is this process's alone
    assert not dist.is_initialized()
    assert fakeworld.fake_ranks() == 0


def test_a_fake_world_inside_a_process_group_is_refused_in_one_line():
    with remat.fake_world(2):
        with pytest.raises(ValueError, match=r"^remat.fake_world: a process group already exists \(fake, 2 ranks\)"):
            with remat.fake_world(4):
                pass
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="world_size must be a whole number of ranks"):
            with remat.fake_world(bad):
                pass
    assert not dist.is_initialized()


def test_a_meta_model_sharded_by_fsdp2_trains_on_meta_and_leaves_fsdp2_as_it_was():
    refusal = fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params
    with remat.fake_world(4):
        with torch.device("meta"):
            model = worker.build("gpt", 4)
        (tokens,), _, loss_fn = worker.batch("gpt", device="meta")
        with fakeworld.meta_sharded(model):
            loss_fn(model(tokens)).backward()
        shard = ranks.local(model.blocks[0].attn.qkv.weight.grad)
    assert shard.device.type == "meta"
    assert shard.shape[0] == model.blocks[0].attn.qkv.weight.shape[0] // 4
    assert fsdp._fully_shard._fsdp_param_group.FSDPParamGroup._validate_no_meta_params is refusal
    assert not hasattr(torch, "meta")
