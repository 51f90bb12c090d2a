"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): remat.profile and plan on tensor-parallel
models, on every rank.

The built-in GPT (``ColwiseParallel`` on each block's ``mlp.up``, ``RowwiseParallel`` on ``mlp.down``), a tiny
Hugging Face Llama (``gate_proj`` / ``up_proj`` column-wise, ``down_proj`` row-wise), and the GPT tensor and
sequence parallel (:func:`_gpt_sequence_parallel`), on a 1-D mesh of the two ranks.
Every rank profiles once, plans at 90% and 50% and at the smallest peak any plan reaches, and prices every block
checkpointed; each plan trains three SGD
steps beside the same TP model without a plan: losses and local gradient shards compared bitwise, each step's
per-rank peak measured by ``remat.measure_step``, the collectives each backward runs counted (the sequence-parallel
GPT also trains with every block ``save_matmuls``).  Then the plan is
applied to the model without tensor parallel, and to one on a mesh with named dimensions; last, the Llama with its
output layer split too; and a GPT whose blocks' inputs are large enough to keep as shards
(:func:`_partitioned`: every block ``checkpoint_partitioned``, saved and loaded, and the plan at that plan's own
peak, where no plan without the option fits).
Rank 0 writes every rank's results (gathered) to the JSON path :func:`run` is given.
"""

import json
import os

import torch
import torch.distributed as dist
from helpers import train_counting
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.choices.options import DEFAULT_ALLOW

GPT_CFG = GPTConfig(n_layers=4, d_model=64, n_heads=4, mlp_ratio=8, seq_len=64, vocab_size=16)
# More heads: attention's bytes grow, its collectives' do not, so the buffers gloo's thread may let go of after a
# step's peak stay well under 3% of it.
SEQUENCE_PARALLEL_CFG = GPTConfig(n_layers=4, d_model=64, n_heads=16, mlp_ratio=8, seq_len=64, vocab_size=16)
# Each block's input is 64 x 64 x 64 float32: 1 MiB, the smallest input PartitionInputs keeps as shards.  Without
# dropout a recomputation stops before the down projection's all-reduce (whose 1 MiB buffer gloo's thread may let go
# of late, which a rerun of it would bring into the prediction).
PARTITIONED_CFG = GPTConfig(n_layers=3, d_model=64, n_heads=4, mlp_ratio=4, seq_len=64, vocab_size=16, dropout=0.0)
# dropout after the down projection: the recomputation reaches its all-reduce, whose output the option keeps
PARTITIONED_DROPOUT_CFG = GPTConfig(n_layers=3, d_model=64, n_heads=4, mlp_ratio=4, seq_len=64, vocab_size=16,
                                    dropout=0.1)
PARTITIONED_BATCH = 64
STEPS = 3
BUDGETS = ("90%", "50%")


_COLLECTIVES = (torch.ops._c10d_functional.all_reduce.default,
                torch.ops._c10d_functional.all_gather_into_tensor.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default,
                torch.ops.c10d._allgather_base_.default)  # a partitioned input's all-gather in backward


def _gpt(mesh, config=GPT_CFG):
    torch.manual_seed(0)
    model = GPT(config)
    if mesh is not None:
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _gpt_sequence_parallel(mesh):
    """Tensor and sequence parallel, as torchtitan splits its Llama: between the blocks' projections the residual
    stream is a half of the sequence per rank; each LayerNorm runs on its half (``SequenceParallel``), attention
    and MLP all-gather their input (``PrepareModuleInput``, ``Shard(1)`` to ``Replicate``) and their row-wise
    output projections reduce-scatter back to halves.  The fused ``qkv`` stays whole on every rank (its columns are
    q, k and v of all heads: a column-wise half would not be whole heads), so attention's output projection splits
    its input's columns itself (``RowwiseParallel(input_layouts=Replicate())``)."""
    torch.manual_seed(0)
    model = GPT(SEQUENCE_PARALLEL_CFG)
    if mesh is None:
        return model
    parallelize_module(model, mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    gathered_plain = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)  # the whole qkv's input: a plain tensor
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "ln1": SequenceParallel(), "attn": gathered_plain,
            "attn.proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp": gathered,
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))})
    return model


def _llama(mesh):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if mesh is not None:
        for layer in model.model.layers:
            parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                 "down_proj": RowwiseParallel()})
    return model


def _batches(name):
    generator = torch.Generator().manual_seed(7)  # tensor parallel: every rank the same batch
    if name == "partitioned":
        return [synthetic_batch(PARTITIONED_CFG, PARTITIONED_BATCH, generator=generator) for _ in range(STEPS)]
    if name.startswith("gpt"):
        return [synthetic_batch(GPT_CFG, 8, generator=generator) for _ in range(STEPS)]
    return [(ids, ids) for ids in (torch.randint(0, 64, (4, 128), generator=generator) for _ in range(STEPS))]


def _loss(name, model, tokens, targets):
    if name.startswith("gpt"):
        return model.loss(tokens, targets)
    return model(input_ids=tokens, labels=targets).loss


def _train(name, model, batches):
    """Losses, local gradient shards, per-rank peaks (remat.measure_step) and backward collectives per step."""
    return train_counting(model, batches, lambda m, batch: _loss(name, m, *batch), _COLLECTIVES)


def _bitwise(expected, got) -> bool:
    return all(torch.equal(a, b) for a, b in zip(expected[0], got[0])) and all(
        torch.equal(a, b) for want, have in zip(expected[1], got[1]) for a, b in zip(want, have))


def _refusal(plan, model) -> str:
    try:
        plan.apply(model)
    except ValueError as error:
        return str(error)
    plan.remove(model)
    return "applied"


def _case(name, build, mesh, named_mesh) -> dict:
    batches = _batches(name)
    expected = _train(name, build(mesh), batches)
    model = build(mesh)
    tokens, targets = batches[0]
    if name.startswith("gpt"):
        prof = remat.profile(model, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), repeats=1, hold_output=False)
    else:  # the loop keeps the loss, not the output
        prof = remat.profile(model, input_ids=tokens, labels=targets, repeats=1, hold_output=False)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's shape is the whole tensor's
    result = {"param_bytes": prof.param_bytes, "whole_param_bytes": whole, "profiled_peak": prof.peak_bytes,
              "unplanned": expected[2], "unplanned_reduces": expected[3]}
    plans = {budget: prof.plan(budget) for budget in BUDGETS}
    plans["every block"] = prof.price(dict.fromkeys(plans["90%"].decisions, "checkpoint"))  # decisions fixed
    try:
        prof.plan("1%")
    except remat.InfeasibleBudget as refused:  # the lowest peak: below what keeping every collective's output needs
        plans["floor"] = prof.plan(refused.smallest)
    for budget, plan in plans.items():
        got = _train(name, plan.apply(build(mesh)), batches)
        result[budget] = {"decisions": plan.decisions, "predicted_peak": plan.predicted_peak, "measured": got[2],
                          "bitwise": _bitwise(expected, got), "reduces": got[3],
                          "rerun": plan.collectives_rerun, "printed": str(plan)}
    if name == "gpt_sequence_parallel":  # every block save_matmuls by hand: what crossed the wire is kept
        model = build(mesh)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = remat.checkpoint_wrapper(block, policy=remat.policies.save_matmuls)
        got = _train(name, model, batches)
        result["save_matmuls"] = {"bitwise": _bitwise(expected, got), "reduces": got[3]}
    result["unsharded"] = _refusal(plan, build(None))
    result["other_mesh"] = _refusal(plan, build(named_mesh))
    return result


def _split_output_layer(mesh) -> dict:
    """The Llama with its output layer split too (column-wise, logits gathered): planned without the chunked head,
    whose loss reads the output layer's weight outside its forward."""
    model = _llama(mesh)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    tokens, targets = _batches("llama")[0]
    prof = remat.profile(model, input_ids=tokens, labels=targets, repeats=1, hold_output=False)
    plan = prof.plan("50%")
    plan.apply(model)
    model(input_ids=tokens, labels=targets).loss.backward()
    return {"head": prof.head is not None, "chunks": plan.head_chunks, "decisions": plan.decisions}


def _partitioned(mesh, folder) -> dict:
    """Every block ``checkpoint_partitioned`` (priced by name, saved and loaded), and the plan at that plan's own
    peak: trained beside the TP model without a plan."""
    batches = _batches("partitioned")
    expected = _train("gpt", _gpt(mesh, PARTITIONED_CFG), batches)
    tokens, targets = batches[0]
    prof = remat.profile(_gpt(mesh, PARTITIONED_CFG), tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten()), repeats=1, hold_output=False)
    every = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows})
    path = f"{folder}/partitioned-{dist.get_rank()}.json"
    every.save(path)
    plans = {"every block": remat.Plan.load(path), "at its peak": prof.plan(every.predicted_peak)}
    result = {"partitioned": {name: entry.shard for name, entry in prof.partitioned.items()},
              "unplanned": expected[2], "unplanned_reduces": expected[3]}
    for name, plan in plans.items():
        got = _train("gpt", plan.apply(_gpt(mesh, PARTITIONED_CFG)), batches)
        result[name] = {"decisions": plan.decisions, "predicted_peak": plan.predicted_peak, "measured": got[2],
                        "bitwise": _bitwise(expected, got), "reduces": got[3], "rerun": plan.collectives_rerun,
                        "printed": str(plan)}
    others = [option for option in DEFAULT_ALLOW if option != "checkpoint_partitioned"]
    try:  # no plan without the option fits at its peak: the solver takes it on its own there
        result["without it"] = prof.plan(every.predicted_peak, allow=others).decisions
    except remat.InfeasibleBudget:
        result["without it"] = "refused"
    result["unsharded"] = _refusal(every, _gpt(None, PARTITIONED_CFG))
    first = prof.partitioned["blocks.0"]
    # with dropout the recomputation reaches the all-reduce: the op-level policy beside the shards keeps its output
    expected = _train("gpt", _gpt(mesh, PARTITIONED_DROPOUT_CFG), batches)
    prof = remat.profile(_gpt(mesh, PARTITIONED_DROPOUT_CFG), tokens, loss_fn=lambda logits: (
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())), repeats=1, hold_output=False)
    plan = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows})
    got = _train("gpt", plan.apply(_gpt(mesh, PARTITIONED_DROPOUT_CFG)), batches)
    result["dropout"] = {"bitwise": _bitwise(expected, got), "reduces": got[3], "unplanned_reduces": expected[3],
                         "rerun": plan.collectives_rerun, "decisions": plan.decisions}
    # the same 512 KiB shards on the same group: the second profile reads the all-gather's time the first kept
    result["gather_times"] = [first.gather_time, prof.partitioned["blocks.0"].gather_time]
    return result


def run(report_path: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    named = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    mine = {"gpt": _case("gpt", _gpt, mesh, named), "llama": _case("llama", _llama, mesh, named),
            "gpt_sequence_parallel": _case("gpt_sequence_parallel", _gpt_sequence_parallel, mesh, named),
            "split_output_layer": _split_output_layer(mesh),
            "partitioned": _partitioned(mesh, os.path.dirname(report_path))}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
