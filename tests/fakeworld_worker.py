"""A two-rank run (tests/two_ranks.py runs it under torchrun, gloo) that tests/test_fakeworld.py predicts from one
process: remat's GPT (FSDP2 resharded after forward, or kept gathered) and a tiny Hugging Face Llama (FSDP2),
``fully_shard`` per block then the root, each profiled on every rank and planned at 60%; the unplanned and the
planned steps are trained (SGD) and each step's peak measured (``remat.measure_step``) on every rank.

Rank 0 writes every rank's peaks and each plan's decisions to the JSON path :func:`run` is given; the test
prices the same decisions on the meta device in a fake world of 2 ranks (``remat.fake_world``) and compares.
"""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import remat
from remat.models import GPT, GPTConfig, synthetic_batch

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

GPT_CONFIG = GPTConfig(vocab_size=128, seq_len=64, d_model=64, n_heads=4, n_layers=4)
GPT_BATCH = 8
LLAMA_BATCH = (2, 64)
CASES = ("gpt", "gpt_kept", "llama")
STEPS = 2
BUDGET = "60%"


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)


def build(case: str, world_size: int):
    """The case's model, sharded for ``world_size`` ranks (``fully_shard`` per block, then the root); built on the
    device in use (the meta device in the test's fake world)."""
    torch.manual_seed(0)
    if case.startswith("gpt"):
        model = GPT(GPT_CONFIG)
        blocks = model.blocks
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(_llama_config())
        blocks = model.model.layers
    mesh = init_device_mesh("cpu", (world_size,))
    kept = case == "gpt_kept"
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=not kept)
    return fully_shard(model, mesh=mesh, reshard_after_forward=not kept)


def batch(case: str, generator: torch.Generator | None = None, device: str = "cpu"):
    """(args, kwargs, loss_fn) of one step of the case: this rank's data, or on ``device`` its shapes."""
    if case.startswith("gpt"):
        tokens, targets = (t.to(device) for t in synthetic_batch(GPT_CONFIG, GPT_BATCH, generator=generator))
        return (tokens,), {}, lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ids = torch.randint(0, _llama_config().vocab_size, LLAMA_BATCH, generator=generator).to(device)
    return (), {"input_ids": ids, "labels": ids}, None


def _peaks(model, batches) -> list[int]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks = []
    for step, (args, kwargs, loss_fn) in enumerate(batches):
        torch.manual_seed(step)

        def run(args=args, kwargs=kwargs, loss_fn=loss_fn):
            opt.zero_grad(set_to_none=True)
            output = model(*args, **kwargs)
            (output.loss if loss_fn is None else loss_fn(output)).backward()
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
    return peaks


def _case(case: str, rank: int) -> dict:
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    batches = [batch(case, generator) for _ in range(STEPS)]
    world = dist.get_world_size()
    model = build(case, world)
    args, kwargs, loss_fn = batches[0]
    plan = remat.profile(model, *args, loss_fn=loss_fn, **kwargs).plan(BUDGET)
    return {"unplanned": _peaks(model, batches), "decisions": plan.decisions, "segments": plan.segments,
            "planned": _peaks(plan.apply(build(case, world)), batches)}


def run(report_path: str) -> None:
    rank = dist.get_rank()
    mine = {case: _case(case, rank) for case in CASES}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
