"""Plans for N ranks made in one process: Llama-3-shaped models sharded by FSDP2 (or split by tensor parallel) on the
meta device in a fake world.

Run by hand (CPU, no process group needed):

    PYTHONPATH=src python benchmarks/fakeworld.py                    # 8B-shaped on 8 ranks, 70B on 64, 8B TP on 8
    PYTHONPATH=src python benchmarks/fakeworld.py --models 8b --budget 40GiB

Each model is a Hugging Face ``LlamaForCausalLM`` built on the meta device in bfloat16 (Llama 3 8B's shape:
hidden 4096, 32 layers, intermediate 14336, 32 heads, 8 key/value heads, vocabulary 128256; 70B's: hidden 8192,
80 layers, intermediate 28672, 64 heads, 8 key/value heads), sharded as torchtitan does (``fully_shard`` per
decoder layer, then the root) in ``remat.fake_world(N)``, and profiled with ``device="meta"`` at sequence 8192,
batch 1 per rank, the loss from ``labels``, then planned for one rank's device (8B: 40 GiB, 70B: 70 GiB, or
``--budget``).  ``8b-tp``: the 8B shape split by tensor parallel over 8 ranks instead (``ColwiseParallel`` on each
layer's q, k, v, gate and up projections, ``RowwiseParallel`` on o and down, as torchtitan splits its Llama), every
rank the same batch, the all-reduces priced over the default interconnect
(:mod:`remat.planning.measure.interconnect`), at 20 GiB.  Printed per model: the time to profile and to plan, the
profile (one rank's step) and the plan, all peaks per rank.
"""

from __future__ import annotations

import argparse
import time

import torch

import remat

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

SHAPES = {
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "ranks": 8, "budget": "40GiB"},
    "70b": {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
            "num_key_value_heads": 8, "ranks": 64, "budget": "70GiB"},
}
SHAPES["8b-tp"] = {**SHAPES["8b"], "budget": "20GiB", "tensor_parallel": True}
SEQ = 8192


def _llama(shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {k: v for k, v in shape.items() if k not in ("ranks", "budget", "tensor_parallel")}
    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=SEQ, rope_theta=500000.0, use_cache=False,
                      tie_word_embeddings=False, dtype=torch.bfloat16, **sizes)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if shape.get("tensor_parallel"):
        return _split(model, shape["ranks"])
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _split(model, ranks: int):
    """Each decoder layer's projections split over a mesh of ``ranks`` (the job's GPUs; nothing runs on it here)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (ranks,))
    columns, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    for layer in model.model.layers:
        where = {name: f"{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}" for name in (*columns, *rows)}
        parallelize_module(layer, mesh, {**{where[n]: ColwiseParallel() for n in columns},
                                         **{where[n]: RowwiseParallel() for n in rows}})
    return model


def _plan_for(name: str, budget: str | None) -> None:
    shape = SHAPES[name]
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    started = time.perf_counter()
    with remat.fake_world(shape["ranks"]):
        with torch.device("meta"):
            model = _llama(shape)
        prof = remat.profile(model, input_ids=ids, labels=ids, device="meta")
    profiled = time.perf_counter() - started
    plan = prof.plan(budget or shape["budget"])
    planned = time.perf_counter() - started - profiled
    how = "tensor parallel" if shape.get("tensor_parallel") else "FSDP2"
    print(f"== Llama-3-{name.upper()}-shaped, {shape['ranks']} ranks ({how}), sequence {SEQ}, batch 1 per rank: "
          f"profiled in {profiled:.1f} s, planned in {planned:.2f} s ({profiled + planned:.1f} s in all)")
    print(prof)
    print(plan)
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--budget", default=None,
                        help="per rank: a size (40GiB) or a fraction (50%%); default 40GiB for 8b, 70GiB for 70b, "
                             "20GiB for 8b-tp")
    options = parser.parse_args()
    for name in options.models:
        _plan_for(name, options.budget)


if __name__ == "__main__":
    main()
