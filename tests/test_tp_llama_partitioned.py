"""``checkpoint_partitioned`` on Hugging Face decoder layers: a tiny transformers Llama split by tensor parallel in
attention and the MLP, whose layers are each handed the rotary tables beside the hidden states (of 1 MiB both,
tests/tp_llama_worker.py).  The option shards a layer's activations only, so each layer has it: priced on the meta
device in a fake world of two ranks, and trained on two CPU ranks (gloo) at its predicted peak, bitwise."""


import pytest
import torch
import torch.distributed as dist

import remat

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

LAYERS = ("model.layers.0", "model.layers.1")


@pytest.fixture(scope="module")
def per_rank(two_rank_report):
    return two_rank_report("tp_llama_worker")


def _meta_profile() -> remat.Profile:
    """The two-rank run's Llama built on the meta device in a fake world of two ranks, profiled as the run does."""
    pytest.importorskip("transformers")
    import tp_llama_worker as worker
    from torch.distributed.device_mesh import init_device_mesh

    ids = torch.empty(worker.BATCH, worker.SEQUENCE, dtype=torch.long, device="meta")
    with remat.fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            built = worker.llama(mesh)
        # laid out as the run's (one row expanded): a view of an input counts its storage, as measure_step does
        positions = torch.arange(worker.SEQUENCE, device="meta").expand(worker.BATCH, worker.SEQUENCE)
        return remat.profile(built, input_ids=ids, position_ids=positions, labels=ids,
                             device="meta", hold_output=False)


def test_meta_in_a_fake_world_of_two_gives_each_decoder_layer_partitioned_hidden_states():
    """Each layer's 1 MiB hidden states are kept as a 512 KiB shard; its 1 MiB rotary tables (which every layer
    is handed, and which require no grad) are not, so the layer's sharded inputs are its own and it has the
    option, its all-gathers priced over the modelled interconnect; it keeps its attention's all-reduce, which a
    checkpointed layer sends again."""
    from remat.planning.measure.gathers import PartitionedInputs
    from remat.planning.measure.interconnect import Interconnect

    prof = _meta_profile()
    gather = Interconnect().seconds("all_gather_into_tensor", 1 << 20, 2)
    assert prof.partitioned == dict.fromkeys(LAYERS, PartitionedInputs(
        whole=1 << 20, shard=512 << 10, gathered=1 << 20, gather_time=gather, world=2))
    every = prof.price(dict.fromkeys(LAYERS, "checkpoint_partitioned"))
    assert every.collectives_rerun == 0 < prof.price(dict.fromkeys(LAYERS, "checkpoint")).collectives_rerun


def test_every_decoder_layer_partitioned_trains_bitwise_at_its_peak_with_one_all_gather_each(per_rank):
    """Every layer ``checkpoint_partitioned`` on two ranks: loss and local gradient shards bitwise those of the TP
    model without a plan, each step's per-rank peak within 3% of the prediction (that of the meta profile too),
    and one all-gather per layer in each backward (none without a plan)."""
    on_meta = _meta_profile().price(dict.fromkeys(LAYERS, "checkpoint_partitioned")).predicted_peak
    for rank in per_rank:
        assert rank["partitioned"] == dict.fromkeys(LAYERS, [1 << 20, 512 << 10])
        assert rank["decisions"] == dict.fromkeys(LAYERS, "checkpoint_partitioned")
        assert rank["bitwise"]
        assert rank["predicted_peak"] == on_meta, (rank["predicted_peak"], on_meta)
        # above: at most one gathered input (1 MiB) more, which gloo's thread may let go of after the step's peak
        assert all(-0.03 * m <= m - rank["predicted_peak"] <= 0.03 * m + (1 << 20) for m in rank["measured"]), rank
        assert rank["gathers"] == [len(LAYERS)] * 3 and rank["unplanned_gathers"] == [0] * 3
