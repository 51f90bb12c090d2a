"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): a tiny Hugging Face Llama split by tensor
parallel in attention and the MLP (q / k / v / gate / up column-wise, o / down row-wise), every decoder layer
``checkpoint_partitioned`` (``prof.price``): each layer is handed the rotary tables too (one row per sequence, as
position ids given per sequence make them), of 1 MiB here as the hidden states are, and only the hidden states are
kept as shards.  Three SGD steps beside the same TP model
without a plan: losses and local gradient shards compared bitwise, each step's per-rank peak
(``remat.measure_step``) and the all-gathers each backward runs.  Rank 0 writes every rank's results (gathered)
to the JSON path :func:`run` is given.
"""

import json

import torch
import torch.distributed as dist
from helpers import split_decoder_layers, train_counting
from torch.distributed.device_mesh import init_device_mesh

import remat

BATCH, SEQUENCE, STEPS = 4, 512, 3  # hidden states and each rotary table: 4 x 512 x 128 x 4 B = 1 MiB
POSITIONS = torch.arange(SEQUENCE).expand(BATCH, SEQUENCE)


def llama(mesh):
    """Hidden 128, two layers, one head of 128 per rank."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=SEQUENCE, use_cache=False)
    torch.manual_seed(0)
    return split_decoder_layers(transformers.LlamaForCausalLM(config).train(), mesh)


def _train(model, batches):
    """Losses, local gradient shards, per-rank peaks and backward all-gathers per step."""
    return train_counting(model, batches, lambda m, ids: m(input_ids=ids, position_ids=POSITIONS, labels=ids).loss,
                          {torch.ops.c10d._allgather_base_.default})  # dist.all_gather_into_tensor


def run(report_path: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(7)  # tensor parallel: every rank the same batch
    batches = [torch.randint(0, 64, (BATCH, SEQUENCE), generator=generator) for _ in range(STEPS)]
    expected = _train(llama(mesh), batches)
    prof = remat.profile(llama(mesh), input_ids=batches[0], position_ids=POSITIONS, labels=batches[0], repeats=1,
                         hold_output=False)
    plan = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows})
    got = _train(plan.apply(llama(mesh)), batches)
    bitwise = all(torch.equal(a, b) for a, b in zip(expected[0], got[0])) and all(
        torch.equal(a, b) for want, have in zip(expected[1], got[1]) for a, b in zip(want, have))
    mine = {"partitioned": {name: [entry.whole, entry.shard] for name, entry in prof.partitioned.items()},
            "decisions": plan.decisions, "predicted_peak": plan.predicted_peak, "measured": got[2],
            "bitwise": bitwise, "gathers": got[3], "unplanned_gathers": expected[3]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
