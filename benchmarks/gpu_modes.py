"""The workloads and the modes of ``benchmarks/gpu.py``: the models (a Hugging Face Llama or GPT-2 built from a
config), and every way of checkpointing them that the benchmark times, eager and compiled.

A mode is one row of the table: ``installed()`` sets it up around a step (untimed), ``step()`` is the timed
step.  Eager modes share the one model (layers wrapped, or a plan applied, around the step); compiled modes each
compile their own copy of the module tree.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat.planning.choices.baselines import spread
from remat.planning.choices.options import DEFAULT_ALLOW
from remat.planning.solve.head import head_chunk_count

PLAN_FRACTIONS = (0.7, 0.5, 0.3)
COMPILE_BUDGETS = (0.7, 0.5, 0.3)
SPREAD_SHARES = (25, 50, 75)  # percent of the layers an every-k row checkpoints, spread evenly
_WITH_OFFLOAD = (*DEFAULT_ALLOW, "offload")
# checkpointed layers beside kept layers whose largest saved tensors go to host memory, no op-level points
_KEPT_OFFLOAD = ("checkpoint", "checkpoint_offload", "keep_offload")
PLANS: dict[str, tuple[float | None, tuple[str, ...], str]] = {
    "plan-70": (0.7, DEFAULT_ALLOW, "remat plan 70%"),
    "plan-50": (0.5, DEFAULT_ALLOW, "remat plan 50%"),
    "plan-30": (0.3, DEFAULT_ALLOW, "remat plan 30%"),
    "plan-offload-50": (0.5, _WITH_OFFLOAD, "remat plan 50%, offload allowed"),
    "plan-offload-30": (0.3, _WITH_OFFLOAD, "remat plan 30%, offload allowed"),
    "plan-kept-offload-50": (0.5, _KEPT_OFFLOAD, "remat plan 50%, checkpoint / kept with offloads only"),
    "plan-kept-offload-30": (0.3, _KEPT_OFFLOAD, "remat plan 30%, checkpoint / kept with offloads only"),
    "plan-lowest": (None, _WITH_OFFLOAD, "remat plan at the lowest peak any plan reaches"),
}
"""The plans the table runs, by key: (budget as a fraction, None for the lowest any plan reaches; the options
allowed; the label)."""


# torchtitan's op-level SAC save list (matmuls, fused attention, reduce-scatter, max), as far as this torch has
# them. Every listed output is saved (torchtitan's older policy also recomputed every second mm).
TORCHTITAN_SAVE_LIST = (
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",
)
# what a Llama layer computes besides projections and attention: bandwidth-bound, cheap to rerun
ELEMENTWISE = ("_to_copy", "pow", "mean", "rsqrt", "mul", "add", "silu", "neg", "cat")


def _resolve_ops(names: tuple[str, ...]) -> set:
    ops = set()
    for name in names:
        namespace, packet, overload = name.split(".")
        with contextlib.suppress(AttributeError):  # an op this torch does not have
            ops.add(getattr(getattr(getattr(torch.ops, namespace), packet), overload))
    return ops


_SAVE_LIST = _resolve_ops(TORCHTITAN_SAVE_LIST)
_ELEMENTWISE = {getattr(torch.ops.aten, name) for name in ELEMENTWISE}
_SAVE, _RECOMPUTE = remat.CheckpointPolicy.MUST_SAVE, remat.CheckpointPolicy.PREFER_RECOMPUTE


def _save_listed(op: Any) -> remat.CheckpointPolicy:
    return _SAVE if op in _SAVE_LIST else _RECOMPUTE


def _save_every_op(op: Any) -> remat.CheckpointPolicy:
    return _SAVE


def _recompute_elementwise(op: Any) -> remat.CheckpointPolicy:
    return _RECOMPUTE if getattr(op, "overloadpacket", None) in _ELEMENTWISE else _SAVE


def _torch_sac(rule: Callable[[Any], Any]) -> Callable[..., Any]:
    """``torch.utils.checkpoint`` with selective checkpointing under ``rule(op)``."""

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
        # torch compares with its own enum: remat's equal-named member would read as "recompute"
        return torch_checkpoint.CheckpointPolicy[rule(op).name]

    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy_fn)
    return functools.partial(torch_checkpoint.checkpoint, use_reentrant=False, context_fn=context_fn)


def _remat_policy(rule: Callable[[Any], Any], name: str) -> Callable[..., Any]:
    return functools.partial(remat.checkpoint, use_reentrant=False, policy=remat.policies.Policy(op_rule=rule,
                                                                                                name=name))


# ---------------------------------------------------------------------------------------------- the workload


@dataclass
class Workload:
    """The model, its inputs and the device; ``step(model)`` is one training step's forward and backward, and
    ``optimizer`` (set by :func:`main`) steps the parameters after it."""

    model: nn.Module
    inputs: dict[str, Any]
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None

    def step(self, model: nn.Module | None = None, context: Callable[[], Any] = contextlib.nullcontext) -> None:
        with context():
            loss = (self.model if model is None else model)(**self.inputs).loss
        loss.backward()

    def twin(self) -> nn.Module:
        """A copy of the model's module tree that shares its parameters and buffers (for compiling)."""
        shared = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        return copy.deepcopy(self.model, shared)

    def free(self) -> None:
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def build(args: argparse.Namespace, device: torch.device) -> Workload:
    """The ``--model`` (Llama or GPT-2) at the sizes of ``args``, in ``args.dtype``, and its batch."""
    import transformers
    if args.model == "gpt2":
        config = transformers.GPT2Config(
            n_embd=args.hidden, n_layer=args.layers, n_head=args.heads, n_inner=args.intermediate,
            vocab_size=args.vocab, n_positions=max(args.seq, 1024), use_cache=False, attn_implementation="sdpa")
        model_class = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
            max_position_embeddings=max(args.seq, 2048), use_cache=False, attn_implementation="sdpa")
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    model.to(args.dtype).train()
    ids = torch.randint(args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    return Workload(model, {"input_ids": ids, "labels": ids, "use_cache": False}, device)


class _Through(nn.Module):
    """A decoder layer run as ``fn(layer, *args, **kwargs)`` (HF passes the layer keyword arguments)."""

    def __init__(self, layer: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.layer = layer
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.layer, *args, **kwargs)


def layers_of(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: a Llama's ``model.layers``, a GPT-2's ``transformer.h``."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _wrap_layers(model: nn.Module, fn: Callable[..., Any] | list[Callable[..., Any] | None]) -> list[nn.Module]:
    """Run every decoder layer through ``fn`` (or layer i through ``fn[i]``, left alone where None); returns the
    layers as they were."""
    layers = layers_of(model)
    originals = list(layers)
    fns = fn if isinstance(fn, list) else [fn] * len(originals)
    for i, layer in enumerate(originals):
        if fns[i] is not None:
            layers[i] = _Through(layer, fns[i])
    return originals


@contextlib.contextmanager
def _layers_through(model: nn.Module, fn: Callable[..., Any] | list[Callable[..., Any] | None]) -> Iterator[None]:
    originals = _wrap_layers(model, fn)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers_of(model)[i] = layer


@contextlib.contextmanager
def _ckpt_and_chunked_head(model: nn.Module, chunks: int) -> Iterator[None]:
    """Every layer through remat.checkpoint and the output layer and loss over ``chunks`` token chunks."""
    with _layers_through(model, functools.partial(remat.checkpoint, use_reentrant=False)):
        remat.chunk_lm_head(model, chunks)
        try:
            yield
        finally:
            remat.unchunk_lm_head(model)


@contextlib.contextmanager
def _planned(model: nn.Module, plan: remat.Plan) -> Iterator[None]:
    plan.apply(model)
    try:
        yield
    finally:
        plan.remove(model)


# ------------------------------------------------------------------------------------------------- the modes


@dataclass
class Mode:
    """One row: ``installed()`` sets the mode up around a step (untimed), ``step()`` is the timed step."""

    key: str
    label: str
    step: Callable[[], None]
    installed: Callable[[], Any] = contextlib.nullcontext
    refused: str | None = None  # why the mode cannot run (a plan the budget refused)


def eager_modes(work: Workload, plans: dict[str, remat.Plan | str]) -> list[Mode]:
    """Every eager mode on the one shared model (plans: by key, or the reason there is none)."""
    model, device_type = work.model, work.device.type
    count = len(layers_of(model))
    checkpoint = functools.partial(remat.checkpoint, use_reentrant=False)
    # the chunk count the planner's option takes: a chunk's logits about the size of the head's weight gradient
    chunks = head_chunk_count(work.inputs["input_ids"].numel(), model.get_output_embeddings().in_features)

    def through(key: str, label: str, fn: Callable[..., Any] | list[Callable[..., Any] | None]) -> Mode:
        return Mode(key, label, work.step, lambda: _layers_through(model, fn))

    def spread_mode(share: int) -> Mode:
        chosen = set(spread(round(count * share / 100), count))
        return through(f"spread-{share}", f"remat checkpoint, {len(chosen)} of {count} layers spread",
                       [checkpoint if i in chosen else None for i in range(count)])

    def around(key: str, label: str, context: Callable[[], Any]) -> Mode:
        return Mode(key, label, lambda: work.step(context=context))

    modes = [
        Mode("plain", "plain", work.step),
        through("torch-ckpt", "torch checkpoint, every layer",
                functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)),
        through("remat-ckpt", "remat checkpoint, every layer",
                functools.partial(remat.checkpoint, use_reentrant=False)),
        Mode("remat-ckpt-chunked-head", f"remat checkpoint, every layer + head in {chunks} chunks", work.step,
             lambda: _ckpt_and_chunked_head(model, chunks)),
        through("torch-sac", "torch SAC, torchtitan's save list (mm, SDPA)", _torch_sac(_save_listed)),
        through("remat-save-matmuls", "remat save_matmuls", functools.partial(
            remat.checkpoint, use_reentrant=False, policy=remat.policies.save_matmuls)),
        through("torch-save-all", "torch SAC saving every op", _torch_sac(_save_every_op)),
        through("remat-save-all", "remat policy saving every op", _remat_policy(_save_every_op, "save every op")),
        through("torch-elementwise", "torch SAC recomputing elementwise ops", _torch_sac(_recompute_elementwise)),
        through("remat-elementwise", "remat policy recomputing elementwise ops",
                _remat_policy(_recompute_elementwise, "recompute elementwise")),
        around("torch-save-on-cpu", "torch save_on_cpu(pin_memory=True)",
               lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
        around("remat-save-on-cpu", "remat save_on_cpu(pin_memory=True)",
               lambda: remat.save_on_cpu(pin_memory=True, device_type=device_type)),
        around("remat-offload", "remat offload()", lambda: remat.offload(device_type=device_type)),
        *(spread_mode(share) for share in SPREAD_SHARES),
        # The last layer keeps its inputs on the device: backward needs them first, with nothing to hide behind.
        through("remat-ckpt-offload", "remat checkpoint with offloaded inputs, every layer (the last kept)",
                [functools.partial(checkpoint, offload_inputs=True)] * (count - 1) + [checkpoint]),
    ]
    modes += [_plan_mode(work, key, plan) for key, plan in plans.items()]
    return modes


def _plan_mode(work: Workload, key: str, plan: remat.Plan | str) -> Mode:
    label = PLANS[key][2]
    if isinstance(plan, str):
        return Mode(key, label, work.step, refused=plan)
    return Mode(key, f"{label} ({_decision_counts(plan)})", work.step, lambda: _planned(work.model, plan))


def _plan_key(fraction: float) -> str:
    return f"plan-{fraction * 100:.0f}"


class _Inductor:
    """Inductor, as a backend object of one compiled mode's own.

    Dynamo keeps compiled code per code object and reuses an entry for another copy of the model whose
    guards pass (modules are not matched by identity) under an equal backend; ``torch.compile``'s default
    backends compare equal, so a copy compiled under another ``activation_memory_budget`` would silently run
    the first copy's graph. A distinct backend object per mode keeps each mode's graph its own.
    """

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs)


def compiled_modes(work: Workload, plans: dict[str, remat.Plan | str],
                   matched: dict[str, remat.Plan] | None = None) -> dict[str, Callable[[], Mode]]:
    """Builders of the compiled modes, by key (each compiles its own copy of the module tree when built);
    ``matched``: remat's plans at the peaks torch.compile's budgets reached, by :func:`matched_key`."""
    import torch._functorch.config as functorch_config

    def compiled(key: str, label: str, prepare: Callable[[nn.Module], Any] = lambda m: None,
                 installed: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], Mode]:
        def make() -> Mode:
            twin = work.twin()
            prepare(twin)
            program = torch.compile(twin, backend=_Inductor())
            return Mode(key, label, lambda: work.step(program), installed)

        return make

    builders = {"compiled-plain": compiled("compiled-plain", "torch.compile, plain")}
    for budget in COMPILE_BUDGETS:
        key = f"compiled-budget-{budget:g}"
        builders[key] = compiled(key, f"torch.compile, activation_memory_budget {budget:g}",
                                 installed=lambda b=budget: functorch_config.patch(activation_memory_budget=b))
    builders["compiled-remat-ckpt"] = compiled(
        "compiled-remat-ckpt", "torch.compile, remat checkpoint every layer",
        lambda m: _wrap_layers(m, functools.partial(remat.checkpoint, use_reentrant=False)))
    for fraction in PLAN_FRACTIONS:
        plan = plans.get(_plan_key(fraction))
        if plan is not None and not isinstance(plan, str):
            key = f"compiled-{_plan_key(fraction)}"
            builders[key] = compiled(key, f"torch.compile, remat plan {fraction:.0%} ({_decision_counts(plan)})",
                                     plan.apply)
    for key, plan in (matched or {}).items():
        budget = key.removeprefix("compiled-match-")
        builders[key] = compiled(key, f"torch.compile, remat plan at budget {budget}'s peak "
                                      f"({_decision_counts(plan)})", plan.apply)
    return builders


def budget_key(budget: float) -> str:
    """The compiled mode of torch.compile's ``activation_memory_budget`` (1 is its default: compiled-plain)."""
    return "compiled-plain" if budget == 1 else f"compiled-budget-{budget:g}"


def matched_key(budget: float) -> str:
    """The compiled mode of remat's plan at the peak :func:`budget_key`'s mode reached."""
    return f"compiled-match-{budget:g}"


def _decision_counts(plan: remat.Plan) -> str:
    counts: dict[str, int] = {}
    for decision in plan.decisions.values():
        counts[decision] = counts.get(decision, 0) + 1
    return ", ".join(f"{n} {decision}" for decision, n in sorted(counts.items(), key=lambda kv: -kv[1]))


EAGER_KEYS = ["plain", "torch-ckpt", "remat-ckpt", "remat-ckpt-chunked-head", "torch-sac", "remat-save-matmuls",
              "torch-save-all", "remat-save-all", "torch-elementwise", "remat-elementwise", "torch-save-on-cpu",
              "remat-save-on-cpu", "remat-offload", *(f"spread-{share}" for share in SPREAD_SHARES),
              "remat-ckpt-offload", *PLANS]
COMPILED_KEYS = ["compiled-plain", *(f"compiled-budget-{b:g}" for b in COMPILE_BUDGETS), "compiled-remat-ckpt",
                 *(f"compiled-{_plan_key(f)}" for f in PLAN_FRACTIONS),
                 *(f"compiled-match-{b:g}" for b in (1, *COMPILE_BUDGETS))]


def select(patterns: list[str] | None, compile_rows: bool) -> list[str]:
    """The mode keys ``patterns`` (names or shell patterns) pick, plain always first."""
    known = EAGER_KEYS + (COMPILED_KEYS if compile_rows else [])
    if not patterns:
        return known
    every = EAGER_KEYS + COMPILED_KEYS
    unknown = [p for p in patterns if not fnmatch.filter(every, p)]
    if unknown:
        raise SystemExit(f"gpu.py: no mode matches {', '.join(unknown)}; the modes are: {' '.join(every)}")
    chosen = {k for p in patterns for k in fnmatch.filter(known, p)}
    return ["plain", *(k for k in known if k in chosen and k != "plain")]
