"""remat on the GPU: every way of checkpointing a Hugging Face Llama, timed on the device, side by side.

Run by hand on a machine with CUDA (most of the time goes to compiling: every compiled mode compiles its own
graphs):

    python benchmarks/gpu.py                                   # the full table, gpu_results.json
    python benchmarks/gpu.py --modes 'plan-*' --no-compile     # plain and the eager plans only
    python benchmarks/gpu.py --layers 4 --batch 2 --seq 1024   # a smaller model
    python benchmarks/gpu.py --device cpu --tiny --rounds 2 --warmup 1   # a smoke run of the whole script

The model is ``LlamaForCausalLM`` built from a config (random weights, no downloads; default hidden 2048,
12 layers, 16 heads, intermediate 5632, vocab 32000, bf16, SDPA attention, batch 4 x seq 2048,
``use_cache=False``).  One training step is forward + backward of ``model(input_ids=ids, labels=ids).loss``.
Every mode runs once per round, the order rotated each round, ``--rounds`` rounds after ``--warmup`` (eager
modes in one phase, compiled ones in a second, both with plain eager as the reference of "x plain").

* Training: after the step of every mode in every round (warm-up rounds included) the optimizer
  (``--optimizer``: AdamW with ``foreach`` by default, SGD with momentum, or fused AdamW; one for the model,
  whose parameters every mode shares) steps the parameters, outside the timed span, as a training loop does
  between steps; one untimed step before the first round creates its state. The optimizer's time is left
  out: it is the same in every mode, and the plans' predicted extra time prices forward and backward only.
* Time: CUDA events around the step (on the CPU the CPU's clock: this thread's CPU time with one torch
  thread, ``OMP_NUM_THREADS=1``, else perf_counter); the median over rounds, and the median of per-round
  ratios to plain.
* Peak: ``torch.cuda.max_memory_allocated`` above the step's start (gradients included, as they are
  ``None`` at the start; the optimizer's state, which exists before the step, is not); on the CPU the
  profiler's allocation events (``remat.planning.memory.profiled_peak``), from the same start. Both compare
  with ``plan.predicted_peak - plan.param_bytes``, which counts neither parameters nor optimizer state.
* Eager modes share one model: layers are wrapped (``model.model.layers[i]`` replaced by a module that calls
  ``fn(layer, *args, **kwargs)``) or a plan applied before the step, and restored after it.  Compiled modes
  each compile their own copy of the module tree (sharing the parameters); torch.compile's
  ``activation_memory_budget`` is patched around every step of its mode, so it is in effect when the graph
  compiles at the first call (and at any recompilation).
* ``remat-ckpt-chunked-head``: every layer checkpointed and the output layer and loss over token chunks
  (``remat.chunk_lm_head``, the chunk count the planner's option uses): the logits are never whole.
* remat's plans at 70/50/30% come from one ``remat.profile`` and are shown with predicted vs measured peak
  and extra time; compiled, a plan is applied and the model then compiled (remat lowers its wrappers into
  the compiler's own rematerialization under dynamo).

A row that runs out of memory reads OOM; the other rows go on.  Without CUDA (and without ``--device cpu``)
the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import functools
import gc
import pickle
import statistics
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat.planning.head import head_chunk_count
from remat.planning.memory import profiled_peak
from remat.planning.optimizers import make_optimizer
from remat.planning.timing import Clock
from remat.tools.arguments import add_optimizer_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_report, beside this file however it is loaded
from gpu_report import Row, mib, print_header, report, save, summarize  # noqa: E402

PLAN_FRACTIONS = (0.7, 0.5, 0.3)
COMPILE_BUDGETS = (0.7, 0.5, 0.3)
FULL = {"hidden": 2048, "layers": 12, "heads": 16, "intermediate": 5632, "vocab": 32000, "batch": 4, "seq": 2048}
TINY = {"hidden": 32, "layers": 8, "heads": 2, "intermediate": 88, "vocab": 128, "batch": 4, "seq": 128}
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
OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


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
    import transformers
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 2048), use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
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


def _wrap_layers(model: nn.Module, fn: Callable[..., Any]) -> list[nn.Module]:
    """Run every decoder layer through ``fn``; returns the layers as they were."""
    layers = model.model.layers
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _Through(layer, fn)
    return originals


@contextlib.contextmanager
def _layers_through(model: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    originals = _wrap_layers(model, fn)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            model.model.layers[i] = layer


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


# ---------------------------------------------------------------------------------------- timing and memory


def _timed(device: torch.device, fn: Callable[[], None]) -> float:
    """Seconds ``fn()`` takes on the device: CUDA events on a GPU, the CPU's clock on the CPU (host = device)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return Clock(device).time(fn)[1]


def _measured(device: torch.device, fn: Callable[[], None]) -> tuple[float, int | None]:
    """Device seconds of ``fn()`` and, on CUDA, its peak allocated bytes above what was live at its start."""
    if device.type != "cuda":
        return _timed(device, fn), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = _timed(device, fn)
    torch.cuda.synchronize(device)
    return seconds, torch.cuda.max_memory_allocated(device) - before


def copy_bandwidths(device: torch.device, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Bytes per second of pinned device->host and host->device copies and of a device->device copy.

    Example:
        >>> copy_bandwidths(torch.device("cuda"), 256 << 20)["D2H"] / 1e9   # GB/s
    """
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(on_device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    result = {}
    for name, (dst, src) in {"D2H": (host, on_device), "H2D": (on_device, host), "D2D": (other, on_device)}.items():
        dst.copy_(src, non_blocking=True)
        result[name] = nbytes / statistics.median(
            _timed(device, lambda d=dst, s=src: d.copy_(s, non_blocking=True)) for _ in range(repeats))
    return result


# ------------------------------------------------------------------------------------------------- the modes


@dataclass
class Mode:
    """One row: ``installed()`` sets the mode up around a step (untimed), ``step()`` is the timed step."""

    key: str
    label: str
    step: Callable[[], None]
    installed: Callable[[], Any] = contextlib.nullcontext
    refused: str | None = None  # why the mode cannot run (a plan the budget refused)


def eager_modes(work: Workload, plans: dict[float, remat.Plan | str]) -> list[Mode]:
    """Every eager mode on the one shared model (plans: by fraction, or the reason there is none)."""
    model, device_type = work.model, work.device.type
    ids = work.inputs["input_ids"]
    chunks = head_chunk_count(ids.numel(), model.get_output_embeddings().in_features)

    def through(key: str, label: str, fn: Callable[..., Any]) -> Mode:
        return Mode(key, label, work.step, lambda: _layers_through(model, fn))

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
    ]
    modes += [_plan_mode(work, fraction, plan) for fraction, plan in plans.items()]
    return modes


def _plan_mode(work: Workload, fraction: float, plan: remat.Plan | str) -> Mode:
    key = _plan_key(fraction)
    if isinstance(plan, str):
        return Mode(key, f"remat plan {fraction:.0%}", work.step, refused=plan)
    return Mode(key, f"remat plan {fraction:.0%} ({_decision_counts(plan)})", work.step,
                lambda: _planned(work.model, plan))


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


def compiled_modes(work: Workload, plans: dict[float, remat.Plan | str]) -> dict[str, Callable[[], Mode]]:
    """Builders of the compiled modes, by key (each compiles its own copy of the module tree when built)."""
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
    for fraction, plan in plans.items():
        if not isinstance(plan, str):
            key = f"compiled-{_plan_key(fraction)}"
            builders[key] = compiled(key, f"torch.compile, remat plan {fraction:.0%} ({_decision_counts(plan)})",
                                     plan.apply)
    return builders


def _decision_counts(plan: remat.Plan) -> str:
    counts: dict[str, int] = {}
    for decision in plan.decisions.values():
        counts[decision] = counts.get(decision, 0) + 1
    return ", ".join(f"{n} {decision}" for decision, n in sorted(counts.items(), key=lambda kv: -kv[1]))


EAGER_KEYS = ["plain", "torch-ckpt", "remat-ckpt", "remat-ckpt-chunked-head", "torch-sac", "remat-save-matmuls",
              "torch-save-all", "remat-save-all", "torch-elementwise", "remat-elementwise", "torch-save-on-cpu",
              "remat-save-on-cpu", "remat-offload", *(_plan_key(f) for f in PLAN_FRACTIONS)]
COMPILED_KEYS = ["compiled-plain", *(f"compiled-budget-{b:g}" for b in COMPILE_BUDGETS), "compiled-remat-ckpt",
                 *(f"compiled-{_plan_key(f)}" for f in PLAN_FRACTIONS)]


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


# ------------------------------------------------------------------------------------------ running a phase


def _attempt(work: Workload, mode: Mode) -> tuple[float, int | None] | str:
    """One timed step of ``mode``, then the optimizer's untimed step: (seconds, peak), or why it failed (the
    model is left as it was)."""
    work.model.zero_grad(set_to_none=True)
    failure = None
    try:
        with mode.installed():
            measured = _measured(work.device, mode.step)
        if work.optimizer is not None:
            work.optimizer.step()
        return measured
    except OOM_ERRORS:
        failure = "OOM"
    except Exception as error:  # a row that fails is reported; the rest of the table still runs
        traceback.print_exc()
        failure = f"failed: {type(error).__name__}"
    finally:
        work.model.zero_grad(set_to_none=True)
    work.free()  # after the except block, so the traceback's frames (and their tensors) are gone
    return failure


def run_phase(work: Workload, modes: list[Mode], rounds: int, warmup: int, name: str) -> dict[str, Row]:
    """Every mode once per round, the order rotated each round (seeded alike); CPU peaks measured after."""
    rows = {m.key: Row(m.key, m.label, failure=m.refused) for m in modes}
    runnable = [m for m in modes if m.refused is None]
    for round_index in range(warmup + rounds):
        print(f"{name}: round {round_index + 1}/{warmup + rounds}", file=sys.stderr, flush=True)
        shift = round_index % len(runnable)
        for mode in runnable[shift:] + runnable[:shift]:
            row = rows[mode.key]
            if row.failure is not None:
                continue
            torch.manual_seed(round_index)
            outcome = _attempt(work, mode)
            if isinstance(outcome, str):
                row.failure = outcome
                continue
            seconds, peak = outcome
            if round_index >= warmup:
                row.seconds[round_index] = seconds
                if peak is not None:
                    row.peak = max(row.peak or 0, peak)
    if work.device.type != "cuda":
        for mode in runnable:
            if rows[mode.key].failure is None:
                work.model.zero_grad(set_to_none=True)
                with mode.installed():
                    rows[mode.key].peak = profiled_peak(mode.step)
        work.model.zero_grad(set_to_none=True)
    return rows


def _profile_plans(work: Workload, fractions: list[float], repeats: int,
                   save_to: str | None = None) -> dict[float, remat.Plan | str]:
    """Plans at ``fractions`` from one profile."""
    prof = remat.profile(work.model, repeats=repeats, **work.inputs)
    if save_to:
        # the profile holds no tensors: re-planning from it elsewhere (a CPU machine) uses this device's prices
        with open(save_to, "wb") as f:
            pickle.dump(prof, f)
    plans: dict[float, remat.Plan | str] = {}
    for fraction in fractions:
        try:
            plans[fraction] = prof.plan(fraction)
            print(f"\nplan {fraction:.0%}:\n{plans[fraction]}")
        except remat.InfeasibleBudget as error:
            plans[fraction] = f"refused: the smallest plan peaks at {mib(error.smallest - error.param_bytes)} MiB"
    del prof
    work.free()
    return plans


def header(work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    device = work.device
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "remat": remat.__version__,
        "model": {k: getattr(args, k) for k in FULL} | {"dtype": str(args.dtype).removeprefix("torch."),
                                                      "parameters": sum(p.numel() for p in work.model.parameters())},
        "rounds": args.rounds, "warmup": args.warmup, "optimizer": args.optimizer,
    }
    if device.type == "cuda":
        info["bandwidth"] = copy_bandwidths(device, args.copy_mib << 20)
    return info


# ------------------------------------------------------------------------------------------------------ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in FULL:
        parser.add_argument(f"--{name}", type=int, help=f"default {FULL[name]} ({TINY[name]} with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", nargs="+", help="mode names or shell patterns (plain always runs); "
                        f"modes: {' '.join(EAGER_KEYS + COMPILED_KEYS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the torch.compile rows (default: on CUDA only)")
    add_optimizer_argument(parser)
    parser.add_argument("--profile-repeats", type=int, default=5, help="remat.profile's repeats")
    parser.add_argument("--copy-mib", type=int, default=512, help="bytes per bandwidth copy, MiB")
    parser.add_argument("--json", default="gpu_results.json", help="where to write the results")
    parser.add_argument("--save-profile", help="pickle remat.profile's result here (to re-plan from it elsewhere)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda (or cuda:N) or cpu, got {args.device!r}")
    for name, value in (TINY if args.tiny else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def _set_recompile_limit(limit: int) -> None:
    """Every compiled mode compiles the same forward code for another module tree: one cache entry each."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu.py: skipped, no CUDA device here (for a smoke run on the CPU: --device cpu --tiny)")
        return 0
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # events record on the current device's stream
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    compile_rows = args.compile if args.compile is not None else device.type == "cuda"
    keys = select(args.modes, compile_rows)
    work = build(args, device)
    info = header(work, args)
    print_header(info)
    sys.stdout.flush()

    fractions = [f for f in PLAN_FRACTIONS if {_plan_key(f), f"compiled-{_plan_key(f)}"} & set(keys)]
    plans = _profile_plans(work, fractions, args.profile_repeats, args.save_profile) if fractions else {}
    work.optimizer = make_optimizer(args.optimizer, work.model.parameters())
    work.step()  # the optimizer's state exists from the first measured step on, as in a training loop
    work.optimizer.step()
    work.free()
    eager = [m for m in eager_modes(work, plans) if m.key in keys]
    rows = run_phase(work, eager, args.rounds, args.warmup, "eager")
    for fraction, plan in plans.items():
        row = rows.get(_plan_key(fraction))
        if row is not None and not isinstance(plan, str):
            row.predicted_peak = plan.predicted_peak - plan.param_bytes
            row.predicted_extra, row.predicted_step = plan.predicted_extra_time, plan.step_time
    entries = summarize(rows, rows["plain"])
    work.free()
    # The eager table is printed (and saved) before the compiled phase starts: compiling every mode takes
    # minutes, and a run cut short there still leaves the eager rows.
    report(entries, info, args.json)

    builders = [b for key, b in compiled_modes(work, plans).items() if key in keys] if compile_rows else []
    if builders:
        _set_recompile_limit(64)
        modes = [Mode("plain", "plain", work.step)] + [build_mode() for build_mode in builders]
        compiled_rows = run_phase(work, modes, args.rounds, args.warmup, "compiled")
        compiled = [e for e in summarize(compiled_rows, compiled_rows["plain"]) if e["key"] != "plain"]
        del modes, builders, compiled_rows
        work.free()
        print("\ncompiled (each row's ratio is to plain eager, run in the same rounds):")
        report(compiled, info, None)
        entries += compiled
        save(entries, info, args.json)
    failed = [e["label"] for e in entries if (e["failure"] or "").startswith("failed")]
    if failed:
        print(f"\nfailed rows (tracebacks above): {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
