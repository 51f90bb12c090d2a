"""A refusal says what its smallest peak is made of, per rank: the rank's states (parameters, gradients, buffers,
their shards where sharded, DDP's buckets), FSDP2's gathered parameters, activations and the output layer and loss,
in bytes that sum to the smallest peak exactly (``refused.parts``) and, the largest first, in its one line."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.choices.chain import chain_options
from remat.planning.solve.accounting import Accounting

PARTS = {"states", "gathered", "activations", "head"}


def _refused(prof: remat.Profile, budget: object = 0.05) -> remat.InfeasibleBudget:
    with pytest.raises(remat.InfeasibleBudget) as refused:
        prof.plan(budget)
    line = str(refused.value)
    assert "\n" not in line
    return refused.value


def _gpt_profile(vocab: int, width: int, batch: int = 2) -> remat.Profile:
    cfg = GPTConfig(n_layers=3, d_model=width, seq_len=64, vocab_size=vocab)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, batch)
    return remat.profile(model, tokens, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()),
                         ops=False)


def _sharded_profile(width: int, batch: int, seq_len: int, world: int, reshard: bool) -> remat.Profile:
    """remat's GPT sharded by FSDP2 (per block, then the root) for ``world`` ranks, profiled on the meta device as
    rank 0 of a fake world."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    cfg = GPTConfig(n_layers=4, d_model=width, n_heads=4, seq_len=seq_len, vocab_size=128)
    tokens, targets = (t.to("meta") for t in synthetic_batch(cfg, batch))
    with remat.fake_world(world):
        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            fsdp.fully_shard(block, reshard_after_forward=reshard)
        fsdp.fully_shard(model, reshard_after_forward=reshard)
        return remat.profile(model, tokens, device="meta",
                             loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()))


def _tensor_parallel_profile() -> remat.Profile:
    """remat's GPT with each block's MLP split over 2 ranks (column-wise, then row-wise), profiled as rank 0 of a
    fake world."""
    tp = pytest.importorskip("torch.distributed.tensor.parallel")
    from torch.distributed.device_mesh import init_device_mesh

    cfg = GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=64, vocab_size=128)
    tokens, targets = synthetic_batch(cfg, 8)
    with remat.fake_world(2):
        torch.manual_seed(0)
        model = GPT(cfg)
        mesh = init_device_mesh("cpu", (2,))
        for block in model.blocks:
            tp.parallelize_module(block.mlp, mesh, {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
        return remat.profile(model, tokens, ops=False,
                             loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten()))


def _assert_parts_are_the_smallest_peak(prof: remat.Profile, refused: remat.InfeasibleBudget) -> None:
    assert set(refused.parts) == PARTS and min(refused.parts.values()) >= 0
    assert sum(refused.parts.values()) == refused.smallest
    assert prof.plan(refused.smallest).predicted_peak <= refused.smallest  # the peak split is one a plan reaches
    # a part is what the step held then: a rank never holds less than its parameters' shards and buffers
    assert refused.parts["states"] >= prof.param_bytes + prof.buffer_bytes


# ---- the parts sum to the smallest peak, and every stretch's to its bytes ------------------------------
@pytest.mark.parametrize("kind", ["plain, large vocabulary", "plain, wide blocks", "FSDP2 resharded",
                                  "FSDP2 kept gathered", "tensor parallel"])
def test_the_parts_sum_to_the_smallest_peak_and_each_stretch_to_its_bytes(kind):
    prof = {"plain, large vocabulary": lambda: _gpt_profile(2000, 64),
            "plain, wide blocks": lambda: _gpt_profile(64, 256),
            "FSDP2 resharded": lambda: _sharded_profile(64, 8, 64, 2, True),
            "FSDP2 kept gathered": lambda: _sharded_profile(64, 8, 64, 2, False),
            "tensor parallel": _tensor_parallel_profile}[kind]()
    for segment in prof.segments:
        assert sum(segment.parts.values()) == segment.peak, segment
        assert sum(segment.start_parts.values()) == segment.start, segment
    refused = _refused(prof)
    _assert_parts_are_the_smallest_peak(prof, refused)
    assert (refused.parts["gathered"] > 0) == kind.startswith("FSDP2")  # only FSDP2 gathers parameters
    # the stretches a refusal reads its moment from are those the solver takes the highest of
    accounting = Accounting(prof)
    for p, options in enumerate(chain_options(prof)):
        for option in options:
            if p + option.span <= len(prof.rows):
                highest = max(value for value, _, _ in accounting.stretches(p, option, 0))
                assert highest == accounting.option_peak(p, option, 0), (p, option.name, option.span)


# ---- what dominates, by model ---------------------------------------------------------------------------
def test_a_plain_model_has_no_gathered_part_and_names_what_dominates_first():
    head = _refused(_gpt_profile(2000, 64))  # a large vocabulary: the logits' gradients
    assert head.parts["gathered"] == 0
    assert max(head.parts, key=head.parts.get) == "head"
    assert ", in the output layer and loss's backward" in str(head)
    assert "backward, which no block option changes (remat.chunked_lm_loss computes them in chunks): 3.9 MiB output " \
           "layer and loss, 1.6 MiB parameters and gradients. Raise" in str(head)
    assert "activations" not in str(head)  # under 5% of the peak: folded away (refused.parts has them)
    assert 0 < head.parts["activations"] < 0.05 * head.smallest
    wide = _refused(_gpt_profile(64, 256))  # wide blocks, a small batch: the parameters and gradients
    assert wide.parts["gathered"] == 0
    assert max(wide.parts, key=wide.parts.get) == "states"
    assert "17.3 MiB parameters and gradients, 2.4 MiB activations. " in str(wide)
    assert "gathered" not in str(wide) and "sharded" not in str(wide)


def test_fsdp2_kept_gathered_with_a_small_batch_is_dominated_by_its_gathered_parameters():
    """Eight ranks, every unit kept gathered from forward to backward: a rank holds an eighth of the parameters
    and gradients, and every block's whole parameters at the end of the forward."""
    prof = _sharded_profile(256, 1, 16, 8, False)
    refused = _refused(prof)
    _assert_parts_are_the_smallest_peak(prof, refused)
    assert max(refused.parts, key=refused.parts.get) == "gathered"
    assert refused.parts["gathered"] > 2 * refused.parts["states"]
    assert ", in the forward before `blocks.3`: 18.3 MiB gathered parameters, 1.5 MiB sharded states. Raise" in str(
        refused)  # the activations, under 5%, folded away


def test_fsdp2_with_a_large_batch_is_dominated_by_its_activations():
    prof = _sharded_profile(64, 8, 64, 2, True)
    refused = _refused(prof)
    _assert_parts_are_the_smallest_peak(prof, refused)
    assert max(refused.parts, key=refused.parts.get) == "activations"
    assert refused.parts["gathered"] > 0  # the unit running: FSDP2 frees it, no plan does
    line = str(refused)
    assert line.index("activations") < line.index("sharded states") < line.index(". Raise")


def test_ddp_gradient_buckets_are_counted_with_the_states():
    """DDP on one rank (gloo, in this process): its gradient buckets, held through every step, are part of the
    rank's states; every other part as the model's own."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(3)])
    x = torch.randn(32, 64)
    plain = _refused(remat.profile(model, x, loss_fn=lambda out: out.pow(2).mean(), ops=False))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        buckets = remat.planning.basics.ranks.gradient_buckets(wrapped)
        refused = _refused(remat.profile(wrapped, x, loss_fn=lambda out: out.pow(2).mean(), ops=False))
    finally:
        dist.destroy_process_group()
    assert buckets > 0 and refused.smallest == plain.smallest + buckets
    assert refused.parts == {**plain.parts, "states": plain.parts["states"] + buckets}


# ---- the line ---------------------------------------------------------------------------------------------
def test_the_line_names_the_parts_of_five_percent_or_more_largest_first():
    mib = 2**20
    parts = {"states": 6 * mib, "gathered": 11 * mib, "activations": 5 * mib, "head": mib // 2}
    refused = remat.InfeasibleBudget(budget=10 * mib, smallest=sum(parts.values()), param_bytes=2 * mib,
                                     where="in the backward of `blocks.3`", parts=parts)
    assert ("in the backward of `blocks.3`: 11.0 MiB gathered parameters, 6.0 MiB sharded states, 5.0 MiB "
            "activations. Raise") in str(refused)
    assert refused.parts == parts and refused.reasons["parts"] == parts
    unknown = remat.InfeasibleBudget(budget=10 * mib, smallest=20 * mib, where="in the backward of `blocks.3`")
    assert unknown.parts == {} and "in the backward of `blocks.3`. Raise" in str(unknown)
