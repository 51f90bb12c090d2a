"""A two-rank check (tests/two_ranks.py runs it under torchrun, gloo): remat.plan called on every rank of a GPT
sharded by FSDP2 (per block, then the root; resharded after forward or not) and wrapped in DDP, the plan applied
after wrapping (and, for FSDP2, before it), three SGD steps compared with the same wrapped model without a plan;
remat.check_plan on every rank; then a rank whose batch has another shape than rank 0's.  FSDP2's other settings
(bfloat16 parameters with float32 reduction, CPU offload, blocks resharded to one rank after forward) are
profiled, planned, applied after wrapping and trained the same way, lighter.  A Hugging Face GPT-2 (tied
embeddings, dropout, Conv1D) under FSDP2 is planned at 50% and refused at 30%.

Rank 0 writes what every rank saw (gathered) to the JSON path :func:`run` is given.
"""

import json
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import remat
from remat.models import GPT, GPTConfig, synthetic_batch

try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

CFG = GPTConfig(vocab_size=128, seq_len=64, d_model=64, n_heads=4, n_layers=4)
BATCH = 8  # per rank: activations well above one block's gathered parameters (see test_ranks)
STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _wrapped(model, wrapper: str, blocks=None):
    if wrapper == "ddp":
        return DDP(model)
    # On the CPU by name: FSDP2's default mesh takes the accelerator where there is one.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    settings = {"reshard_after_forward": wrapper != "fsdp2_kept", **SETTINGS.get(wrapper, {})}
    # fsdp2_int: each block keeps a whole copy per rank from forward to backward (FSDP2 reads 1 as False)
    per_block = {**settings, "reshard_after_forward": 1} if wrapper == "fsdp2_int" else settings
    for block in model.blocks if blocks is None else blocks(model):
        fully_shard(block, mesh=mesh, **per_block)
    return fully_shard(model, mesh=mesh, **settings)


SETTINGS_CHECKED = ("fsdp2_bf16", "fsdp2_offload", "fsdp2_int")
SETTINGS = {"fsdp2_bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
            "fsdp2_offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)}}  # pinning needs an accelerator


def _batches(rank: int, batch: int = BATCH):
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    return [synthetic_batch(CFG, batch, generator=generator) for _ in range(STEPS)]


def _loss_fn(targets):
    return lambda logits: torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(model, batches):
    """Losses, this rank's gradients (local shards) and peaks (remat.measure_step) of STEPS SGD steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, peaks = [], [], []
    for step, (tokens, targets) in enumerate(batches):
        torch.manual_seed(step)  # dropout draws alike in both runs

        def run(tokens=tokens, targets=targets):
            opt.zero_grad()
            loss = _loss_fn(targets)(model(tokens))
            loss.backward()
            losses.append(loss.detach())
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
        # after the measured step: copies made inside it would count a second set of gradients at its end
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
    return losses, grads, peaks


def _bitwise(expected, got) -> bool:
    (want_losses, want_grads, _), (losses, grads, _) = expected, got
    return all(torch.equal(a, b) for a, b in zip(want_losses, losses)) and all(
        torch.equal(a, b) for want, have in zip(want_grads, grads) for a, b in zip(want, have))


def _case(wrapper: str, rank: int, budget: str) -> dict:
    batches = _batches(rank)
    expected = _train(_wrapped(_gpt(), wrapper), batches)
    model = _wrapped(_gpt(), wrapper)
    tokens, targets = batches[0]
    prof = remat.profile(model, tokens, loss_fn=_loss_fn(targets))
    try:
        prof.plan("1%")
        floor = {}
    except remat.InfeasibleBudget as refused:  # what the smallest peak is made of on this rank
        floor = {"smallest": refused.smallest, "parts": refused.parts}
    plan = prof.plan(budget)
    after = _train(plan.apply(model), batches)
    plan.remove(model)
    unwrapped_names = [name for name, _ in model.named_modules() if "_checkpoint_wrapped_module" in name]
    before = _bitwise(expected, _train(_wrapped(plan.apply(_gpt()), wrapper), batches))
    checked = remat.check_plan(lambda: _wrapped(_gpt(), wrapper), plan, tokens, loss_fn=_loss_fn(targets), steps=2,
                               optimizer="sgd")
    try:
        remat.check_plan(model, plan, tokens, loss_fn=_loss_fn(targets), steps=1, optimizer="sgd")
        copied = "checked"
    except ValueError as error:
        copied = str(error)
    return {"decisions": plan.decisions, "predicted_peak": plan.predicted_peak,
            "applied_after": _bitwise(expected, after), "applied_before": before, "left_after_remove": unwrapped_names,
            "checked": [checked.peaks_hold, checked.grads_equal], "model_given": copied,
            "profiled_peak": prof.peak_bytes, "unplanned_peaks": expected[2], "planned_peaks": after[2],
            "floor": floor}


def _setting_case(wrapper: str, rank: int, budget: str) -> dict:
    """An FSDP2 setting: profiled on every rank, planned, applied after wrapping, trained against the same wrapped
    model without a plan; what remat.profile warned of."""
    batches = _batches(rank)
    expected = _train(_wrapped(_gpt(), wrapper), batches)
    model = _wrapped(_gpt(), wrapper)
    tokens, targets = batches[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = remat.profile(model, tokens, loss_fn=_loss_fn(targets), hold_output=False)  # as _train steps
    plan = prof.plan(budget)
    after = _train(plan.apply(model), batches)
    return {"decisions": plan.decisions, "predicted_peak": plan.predicted_peak,
            "applied_after": _bitwise(expected, after),
            "profiled_peak": prof.peak_bytes, "unplanned_peaks": expected[2], "planned_peaks": after[2],
            "warned": [str(w.message) for w in caught if "reshard_after_forward" in str(w.message)
                       or "CPUOffloadPolicy" in str(w.message)]}


def _desynchronised(rank: int) -> str:
    tokens, targets = _batches(rank, batch=BATCH if rank == 0 else BATCH // 2)[0]
    try:
        remat.plan(_wrapped(_gpt(), "fsdp2"), tokens, loss_fn=_loss_fn(targets), budget="70%")
    except ValueError as error:
        return str(error)
    return "no error"


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=4, n_head=4, use_cache=False)
    torch.manual_seed(0)
    return _wrapped(GPT2LMHeadModel(cfg).train(), "fsdp2", blocks=lambda model: model.transformer.h)


def _train_gpt2(model, batches):
    """As :func:`_train`, the step holding the model's output until backward ends."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, peaks = [], [], []
    for step, ids in enumerate(batches):
        torch.manual_seed(step)

        def run(ids=ids):
            opt.zero_grad()
            output = model(input_ids=ids, labels=ids)
            output.loss.backward()
            losses.append(output.loss.detach())
            del output
            opt.step()

        peaks.append(remat.measure_step(run, model, opt).peak_total)
        # after the measured step: copies made inside it would count a second set of gradients at its end
        grads.append([getattr(p.grad, "_local_tensor", p.grad).clone() for p in model.parameters()])
    return losses, grads, peaks


def _gpt2_case(rank: int) -> dict:
    """GPT-2 under FSDP2 (resharded after forward): planned at 50%, trained against the same model without a
    plan; refused at 30%."""
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 512, (2, 64), generator=generator) for _ in range(STEPS)]
    expected = _train_gpt2(_gpt2(), batches)
    prof = remat.profile(_gpt2(), input_ids=batches[0], labels=batches[0])
    plan = prof.plan("50%")
    after = _train_gpt2(plan.apply(_gpt2()), batches)
    try:
        prof.plan("30%")
        refused = {}
    except remat.InfeasibleBudget as error:
        refused = {"smallest": error.smallest, "message": str(error), "parts": error.parts}
    return {"decisions": plan.decisions, "predicted_peak": plan.predicted_peak,
            "applied_after": _bitwise(expected, after), "profiled_peak": prof.peak_bytes,
            "unplanned_peaks": expected[2], "planned_peaks": after[2], "refused": refused}


def run(report_path: str) -> None:
    rank = dist.get_rank()
    mine = {wrapper: _case(wrapper, rank, "70%") for wrapper in ("fsdp2", "fsdp2_kept", "ddp")}
    mine.update({wrapper: _setting_case(wrapper, rank, "60%") for wrapper in SETTINGS_CHECKED})
    mine["gpt2"] = _gpt2_case(rank)
    mine["desynchronised"] = _desynchronised(rank)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(gathered, f)
