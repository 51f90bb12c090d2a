"""Per-rank predicted vs measured peaks, and backward collectives, of plans made on every rank of a tensor-parallel
job: 1-D tensor parallel (sequence parallel too), or 2-D FSDP2 + tensor parallel.

Run by hand under torchrun (CPU, gloo):

    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/tp.py          # 2 x 2
    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/tp.py --tp 2   # 1-D
    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/tp.py --tp 2 \
        --models gpt_sp llama_sp                                                                    # sequence parallel
    PYTHONPATH=src OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 benchmarks/tp.py \
        --models gpt_part --budgets partitioned "at its peak"                                      # partitioned inputs

The mesh is ``(world / tp, tp)`` with dimensions ``("dp", "tp")``.  For each model (remat's GPT, a 4-layer Hugging
Face Llama), each block's MLP is split over the ``tp`` dimension (``ColwiseParallel`` on the up / gate
projections, ``RowwiseParallel`` on the down projection; ``gpt_sp`` and ``llama_sp``: tensor and sequence parallel,
:func:`_gpt_sp`, :func:`_llama_sp`); with more than one ``dp`` rank, every block and then
the root are sharded by FSDP2 over ``dp``.  Every rank profiles the model once (``remat.profile``, on every rank:
rank 0's profile on all), plans at each budget, applies the plan to a fresh model built the same way and trains 3
SGD steps, each measured with ``remat.measure_step``.  Ranks of one ``tp`` group share their batches.  Rank 0
prints one row per model, budget and rank: the plan's predicted peak, each step's measured peak, the largest
difference, the collectives (all-reduces, all-gathers, reduce-scatters) each backward ran, those the plan says its
recomputations send again, and whether the loss and gradient shards are bitwise those of the same model without
a plan.  The sequence-parallel models are for a 1-D mesh (``--tp`` the world size).  ``gpt_part``: remat's GPT with
3 blocks, MLP ratio 4, no dropout and batch 64, each block's input 1 MiB, planned with every block
``checkpoint_partitioned`` (budget ``partitioned``) and by the planner at that plan's peak (``at its peak``); its
"part" column counts those blocks.  The collectives column reads ``A+G``: all-reduces, functional all-gathers and
reduce-scatters (``A``), and c10d all-gathers (``G``: FSDP2's parameter gathers, and each partitioned input's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.planning.basics.units import format_bytes

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

STEPS = 3
GPT_CFG = GPTConfig(n_layers=4, d_model=64, n_heads=4, mlp_ratio=8, seq_len=64, vocab_size=16)
SP_GPT_CFG = GPTConfig(n_layers=4, d_model=64, n_heads=16, mlp_ratio=8, seq_len=64, vocab_size=16)
# gpt_part: each block's input 64 x 64 x 64 float32, 1 MiB, large enough to keep as shards (checkpoint_partitioned)
PART_GPT_CFG = GPTConfig(n_layers=3, d_model=64, n_heads=4, mlp_ratio=4, seq_len=64, vocab_size=16, dropout=0.0)
PART_BATCH = 64


_COLLECTIVES = (torch.ops._c10d_functional.all_reduce.default,
                torch.ops._c10d_functional.all_gather_into_tensor.default,
                torch.ops._c10d_functional.reduce_scatter_tensor.default)
_GATHERS = (torch.ops.c10d._allgather_base_.default,)  # FSDP2's parameter all-gathers and partitioned inputs'


class _CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.gathers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _COLLECTIVES:
            self.count += 1
        if func in _GATHERS:
            self.gathers += 1
        return func(*args, **(kwargs or {}))


def _gpt(mesh, config=GPT_CFG):
    torch.manual_seed(0)
    model = GPT(config)
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, model.blocks


def _gpt_sp(mesh):
    """Sequence parallel too (docs/integrations.md): the fused qkv whole, the rest split as torchtitan's Llama."""
    torch.manual_seed(0)
    model = GPT(SP_GPT_CFG)
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.blocks:
        parallelize_module(block, tp, {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
            "attn.proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))})
    return model, model.blocks


def _llama_model():
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _llama_sp(mesh):
    """Sequence parallel as torchtitan splits its Llama.  The residual stream stays a DTensor (the model builds its
    mask and rotary angles from the whole sequence's length), and the decoder layer calls attention with keyword
    arguments: its input's layouts are given by name."""
    model, tp = _llama_model(), mesh["tp"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    return model, model.model.layers


def _llama(mesh):
    model = _llama_model()
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                   "down_proj": RowwiseParallel()})
    return model, model.model.layers


MODELS = {"gpt": _gpt, "llama": _llama, "gpt_sp": _gpt_sp, "llama_sp": _llama_sp,
          "gpt_part": lambda mesh: _gpt(mesh, PART_GPT_CFG)}


def _built(name: str, mesh, plan=None):
    model, blocks = MODELS[name](mesh)
    if plan is not None:
        plan.apply(model)  # tensor parallel, then checkpointing, then FSDP2
    if mesh["dp"].size() > 1:
        for block in blocks:  # a planned block: its checkpoint wrapper, which the ModuleList holds now
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def _batches(name: str, mesh):
    generator = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))  # one batch per tp group
    if name == "gpt_part":
        return [synthetic_batch(PART_GPT_CFG, PART_BATCH, generator=generator) for _ in range(STEPS)]
    if name.startswith("gpt"):
        return [synthetic_batch(GPT_CFG, 8, generator=generator) for _ in range(STEPS)]
    return [(ids, ids) for ids in (torch.randint(0, 64, (4, 128), generator=generator) for _ in range(STEPS))]


def _loss(name, model, tokens, targets):
    return model.loss(tokens, targets) if name.startswith("gpt") else model(input_ids=tokens, labels=targets).loss


def _trained(name, model, batches):
    """Each step's peak (remat.measure_step), backward collectives (all-reduces, functional all-gathers and
    reduce-scatters; c10d all-gathers), loss and local gradient shards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks, reduces, results = [], [], []
    for step, (tokens, targets) in enumerate(batches):
        torch.manual_seed(step)

        def run(tokens=tokens, targets=targets):
            opt.zero_grad(set_to_none=True)
            loss = _loss(name, model, tokens, targets)
            with _CountCollectives() as counter:
                loss.backward()
            reduces.append(f"{counter.count}+{counter.gathers}")
            results.append([loss.detach(), *(getattr(p.grad, "_local_tensor", p.grad).clone()
                                             for p in model.parameters())])
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
    return peaks, reduces, results


def _rows(name: str, mesh, budgets: list[str]) -> list[dict]:
    batches = _batches(name, mesh)
    model = _built(name, mesh)
    tokens, targets = batches[0]
    if name.startswith("gpt"):
        prof = remat.profile(model, tokens, loss_fn=lambda logits: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten()), hold_output=False)
    else:
        prof = remat.profile(model, input_ids=tokens, labels=targets, hold_output=False)
    peaks, reduces, expected = _trained(name, model, batches)
    rows = [{"budget": "none", "predicted": prof.peak_bytes, "measured": peaks, "reduces": reduces, "rerun": 0,
             "bitwise": True}]
    partitioned = prof.price({row.name: "checkpoint_partitioned" for row in prof.rows}) if prof.partitioned else None
    for budget in budgets:
        try:  # "partitioned": every block checkpoint_partitioned; "at its peak": the planner at that plan's peak
            plan = (partitioned if budget == "partitioned" else
                    prof.plan(partitioned.predicted_peak if budget == "at its peak" else budget))
        except remat.InfeasibleBudget as refused:
            rows.append({"budget": budget, "refused": refused.smallest})
            continue
        peaks, reduces, got = _trained(name, _built(name, mesh, plan), batches)
        bitwise = all(torch.equal(a, b) for want, have in zip(expected, got) for a, b in zip(want, have))
        rows.append({"budget": budget, "predicted": plan.predicted_peak, "measured": peaks, "reduces": reduces,
                     "rerun": plan.collectives_rerun, "bitwise": bitwise,
                     "checkpointed": sum(d != "keep" for d in plan.decisions.values()),
                     "partitioned": sum(d == "checkpoint_partitioned" for d in plan.decisions.values())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=list(MODELS))
    parser.add_argument("--budgets", nargs="+", default=["90%", "50%"],
                        help="budgets; 'partitioned': every block checkpoint_partitioned (gpt_part), 'at its peak': "
                             "the planner at that plan's peak")
    parser.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    options = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // options.tp, options.tp), mesh_dim_names=("dp", "tp"))
    if rank == 0:
        print(f"mesh {world // options.tp} x {options.tp} (dp, tp), gloo, {STEPS} SGD steps")
        print(f"{'model':<8} {'budget':<11} {'rank':>4} {'blocks':>6} {'part':>4} {'predicted':>11} "
              f"{'measured per step':<36} {'worst':>7} {'(bytes)':>10} {'collectives':>17} {'again':>5} "
              f"{'bitwise':>7}")
    for name in options.models:
        mine = _rows(name, mesh, options.budgets)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank != 0:
            continue
        for index in range(len(mine)):
            for who, rows in enumerate(every):
                row = rows[index]
                if "refused" in row:
                    print(f"{name:<8} {row['budget']:<11} {who:>4} refused: the smallest peak any plan reaches is "
                          f"{format_bytes(row['refused'])}")
                    continue
                worst = max((m - row["predicted"] for m in row["measured"]), key=abs)
                steps = " ".join(format_bytes(m) for m in row["measured"])
                reduces = ",".join(map(str, row["reduces"]))
                print(f"{name:<8} {row['budget']:<11} {who:>4} {row.get('checkpointed', 0):>6} "
                      f"{row.get('partitioned', 0):>4} {format_bytes(row['predicted']):>11} {steps:<36} "
                      f"{worst / row['predicted']:>+7.1%} {worst:>+8} B {reduces:>17} {row['rerun']:>5} "
                      f"{str(row['bitwise']):>7}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads may still drop the last tensors: no interpreter finalization to race with


if __name__ == "__main__":
    main()
