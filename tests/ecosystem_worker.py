"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo) of the routes a distributed job takes:

* the ``remat`` command on every rank: ``remat plan`` and ``remat check`` given a factory that builds a GPT and
  shards it with FSDP2 (per block, then the root), or wraps it in DDP, in the process group the command runs in;
  rank 0 prints every rank's check;
* torchtitan's order: that plan applied to a new (unsharded) GPT, each block compiled (``aot_eager``), then
  ``fully_shard`` per block and the root; three SGD steps against the same compiled, sharded GPT without it;
* Hugging Face's ``Trainer`` on the CPU (DDP over gloo: accelerate keeps FSDP for accelerators): a Llama planned
  wrapped in DDP as the Trainer will wrap it, the plan applied before the Trainer wraps it, three SGD steps
  against the same Trainer without it.

Rank 0 writes what every rank saw (gathered) to the JSON path :func:`run` is given.
"""

import contextlib
import copy
import io
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.models import GPT, GPTConfig, synthetic_batch
from remat.tools.cli import main

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

CFG = GPTConfig(vocab_size=128, seq_len=64, d_model=64, n_heads=4, n_layers=4)
BATCH = 8
STEPS = 3


class LossGPT(GPT):
    """The built-in GPT returning its next-token loss: the command's loss is the model's output."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(super().forward(tokens).flatten(0, 1), targets.flatten())


def _built() -> LossGPT:
    torch.manual_seed(0)
    return LossGPT(CFG)


def _sharded(model: LossGPT, compile_blocks: bool = False) -> LossGPT:
    """fully_shard per block and the root, on the CPU by name; each block compiled first, as torchtitan does."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, block in model.blocks.named_children():
        if compile_blocks:
            block = torch.compile(block, backend="aot_eager", fullgraph=True)
            model.blocks.register_module(name, block)
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_gpt() -> LossGPT:
    """The factory ``remat plan`` / ``remat check`` are given: the model as it is trained, sharded."""
    return _sharded(_built())


def ddp_gpt() -> DDP:
    """The same GPT wrapped in DDP: the command profiles the module it wraps, its gradient buckets counted."""
    return DDP(_built())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # every rank its own data
    return [synthetic_batch(CFG, BATCH, generator=generator) for _ in range(STEPS)]


def batch() -> dict:
    tokens, targets = _batches()[0]
    return {"tokens": tokens, "targets": targets}


def _command(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(argv))
    return {"status": status, "stdout": out.getvalue()}


def _the_command(folder: str, factory: str, steps: int) -> dict:
    plan_file = os.path.join(folder, f"{factory}.json")
    made = _command("plan", f"ecosystem_worker:{factory}", "--inputs", "ecosystem_worker:batch", "--budget", "70%",
                    "-o", plan_file)
    dist.barrier()  # rank 0 wrote the plan
    checked = _command("check", f"ecosystem_worker:{factory}", "--inputs", "ecosystem_worker:batch", "--plan",
                       plan_file, "--steps", str(steps), "--optimizer", "sgd")
    return {"plan": made, "check": checked, "plan_file": plan_file}


def _train(model, batches) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step, (tokens, targets) in enumerate(batches):
        torch.manual_seed(step)  # dropout draws alike in both runs
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def _torchtitan_order(plan_file: str) -> dict:
    plan = remat.Plan.load(plan_file)
    batches = _batches()
    expected = _train(_sharded(_built(), compile_blocks=True), batches)
    model = plan.apply(_built())  # activation checkpointing first, then compile, then fully_shard
    got = _train(_sharded(model, compile_blocks=True), batches)
    wrapped = [type(block._orig_mod).__name__ for block in model.blocks]
    equal = all(torch.equal(a, b) for a, b in zip(*(run[0] for run in (expected, got)))) and all(
        torch.equal(a, b) for want, have in zip(expected[1], got[1]) for a, b in zip(want, have))
    return {"decisions": plan.decisions, "blocks": wrapped, "bitwise": equal,
            "losses": [float(loss) for loss in got[0]]}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4))


def _trainer_run(model, folder: str, data: list[dict]) -> tuple[list[float], list[torch.Tensor], str]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=folder, use_cpu=True, per_device_train_batch_size=2, max_steps=STEPS,
                             optim="sgd", learning_rate=0.1, logging_steps=1, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, [p.detach().clone() for p in model.parameters()], type(trainer.model_wrapped).__name__


def _hugging_face_trainer(folder: str) -> dict:
    ids = torch.randint(0, 256, (4 * STEPS, 32), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row, "labels": row} for row in ids]  # the Trainer gives each rank its rows
    model = _llama()
    rows = ids[:2]  # one rank's batch: 2 rows
    plan = remat.plan(DDP(copy.deepcopy(model)), input_ids=rows, labels=rows, budget="80%")  # as the Trainer trains
    # The same model without checkpointing: its loss in the plan's chunks, if any (the same sums, bitwise).
    unplanned = _llama() if plan.head_chunks < 2 else remat.chunk_lm_head(_llama(), plan.head_chunks)
    expected = _trainer_run(unplanned, folder, data)
    got = _trainer_run(plan.apply(model), folder, data)
    return {"decisions": plan.decisions, "head_chunks": plan.head_chunks, "wrapped_in": got[2],
            "planned": sum(isinstance(m, remat.ActivationWrapper) for m in model.modules()),
            "losses": got[0], "expected_losses": expected[0],
            "parameters_equal": all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))}


def run(report_path: str) -> None:
    with tempfile.TemporaryDirectory() as mine:
        folder = [mine]
        dist.broadcast_object_list(folder, src=0)  # one folder for both ranks: rank 0's
        command = _the_command(folder[0], "fsdp2_gpt", steps=2)
        report = {"command": command, "command_ddp": _the_command(folder[0], "ddp_gpt", steps=1),
                  "torchtitan": _torchtitan_order(command["plan_file"]), "trainer": _hugging_face_trainer(mine)}
        dist.barrier()  # rank 0's folder stays until every rank has read the plan
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
