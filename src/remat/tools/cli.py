"""The ``remat`` command: demo, profile, plan, check, bench.

It starts without torch: ``remat --help`` and mistakes in the arguments answer at once, and each command
imports what it needs (torch, the planner, rich) when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..planning.basics.units import Budget, parse_budget
from . import ranked
from .arguments import add_optimizer_argument, at_least, fraction_below_one, writable_file

if TYPE_CHECKING:
    import torch

__all__ = ["main"]

_ALLOWED = ("checkpoint", "save_matmuls", "selective", "offload", "checkpoint_offload", "keep_offload",
            "checkpoint_partitioned")
_ALLOW = ("checkpoint", "save_matmuls", "selective", "checkpoint_offload", "keep_offload", "checkpoint_partitioned")
"""``remat.planning.choices.options.ALLOWED`` and ``DEFAULT_ALLOW``, written out so that parsing the arguments needs
no torch (test_cli checks that they agree)."""
_FROM_GRAPHS = {"selective", "checkpoint_partitioned"}  # options drawn from the op graphs, as remat.plan asks them


class UserError(Exception):
    """A mistake in the command line or in the user's code it points at: one line, no traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake in the arguments told in one line, without the usage (``--help`` shows it)."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _console():
    try:
        from rich.console import Console
    except ImportError as error:
        raise UserError("the remat command needs rich: pip install 'remat[cli]'") from error
    console = Console()
    return console if console.is_terminal else Console(width=130)  # piped: do not fold tables to 80 columns


def _progress(console):
    """A progress bar that leaves nothing behind; none where the output is not a terminal (a piped bar would
    leave a blank line, before an error too)."""
    from rich.progress import Progress

    return Progress(console=console, transient=True, disable=not console.is_terminal)


def _budget(text: str) -> Budget:
    """A fraction (0.5 or 50%) or a size (8GiB), read as Python reads it (:func:`parse_budget`)."""
    try:
        return parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# ---- demo -------------------------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    import torch
    from rich.table import Table

    from ..models import GPTConfig
    from .demo import plot, run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                        n_heads=args.heads, n_layers=args.layers, dropout=args.dropout)
    except ValueError as error:
        raise UserError(str(error)) from error
    if cfg.d_model % cfg.n_heads:
        raise UserError(f"--d-model ({cfg.d_model}) must be a multiple of --heads ({cfg.n_heads})")
    console = _console()
    console.print(
        f"[bold]remat demo[/]: GPT with {cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"sequence {cfg.seq_len}, batch {args.batch_size}, dropout {cfg.dropout}; {args.steps} training steps "
        f"per mode ({args.optimizer}) on {torch.get_num_threads()} CPU thread(s); plan budget {args.budget}."
    )
    with _progress(console) as progress:
        task = progress.add_task("profiling and training", total=args.steps * 4)
        results, prof, plan = run_demo(cfg, args.batch_size, args.steps, args.seed, args.budget,
                                       on_step=lambda: progress.advance(task), optimizer=args.optimizer)
    base = results[0]
    table = Table(title="one training step (forward + backward) of the demo GPT")
    for column in ("mode", "peak above params", "whole peak", "step time", "overhead", "max |Δloss|", "max |Δgrad|"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        table.add_row(r.name, f"{_mib(r.peak_above_params)} ({r.peak_above_params / base.peak_above_params:.0%})",
                      _mib(r.peak_total), f"{r.step_time * 1e3:,.1f} ms", f"{r.step_time / base.step_time - 1:+.0%}",
                      f"{r.max_loss_diff(base):.3g}", f"{r.max_grad_diff(base):.3g}")
    console.print(table)
    console.print(f"{results[-1].name}, per block (kept: bytes held from forward to backward):")
    console.print(str(plan), markup=False, highlight=False)
    console.print(
        "Peaks are MemTracker's whole-step figures (parameters, gradients, activations and tensors recomputed "
        f"in backward; the {args.optimizer} optimizer's state is not counted, as the plan does not count it); "
        "step time is the median after the first step, the optimizer's step left out."
    )
    if args.plot:
        plot(results, prof, args.plot, plan)
        console.print(f"plot written to {args.plot}")
    return 0


# ---- user models ------------------------------------------------------------------------------------
def _load(spec: str, what: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep and "." in spec.strip("."):
        module_part, _, name = spec.rpartition(".")
        raise UserError(f"{what} must look like package.module:function, got {spec!r}; did you mean "
                        f"{module_part}:{name}?")
    if not sep or not module_name or not attr:
        raise UserError(f"{what} must look like package.module:function, got {spec!r}")
    sys.path.insert(0, ".")  # let people name a module in the working directory
    # The import system caches what a folder held when last read: a module written since (a generated model
    # file, a test's) would otherwise be missed within the same second.
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        raise UserError(f"cannot import {module_name!r} for {what} {spec!r}: {reason}") from error
    finally:
        sys.path.pop(0)
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UserError(f"{module_name!r} has no {attr!r} (from {what} {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{spec!r} is not callable; {what} must name a function or class")
    return target


def _call(fn: Callable[..., Any], what: str, spec: str) -> Any:
    try:
        return fn()
    except Exception as error:
        hint = ranked.factory_hint(error)
        raise UserError(f"{what} {spec!r} raised {type(error).__name__}: {error}{hint}") from error


def _model_and_inputs(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple, dict]:
    import torch

    factory = _load(args.model, "MODULE:FACTORY")
    device = getattr(args, "device", None)
    if device == "meta":
        with torch.device("meta"):
            model = _call(factory, "the factory", args.model)
    else:
        model = _call(factory, "the factory", args.model)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"the factory {args.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    kwargs: dict = {}
    if args.inputs:
        inputs = _call(_load(args.inputs, "--inputs"), "the inputs function", args.inputs)
        if isinstance(inputs, dict):  # keyword inputs, as a Hugging Face model takes them
            inputs, kwargs = (), inputs
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        _check_inputs_returned(args.inputs, inputs, kwargs)
        if device == "meta":
            inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
            kwargs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    elif args.input_shape:
        inputs = tuple(torch.randn(*shape, device=device or "cpu") for shape in args.input_shape)
    else:
        raise UserError("give the model's inputs: --input-shape 8,128 (random floats) or --inputs MODULE:FN")
    return model, inputs, kwargs


def _check_inputs_returned(spec: str, inputs: tuple, kwargs: dict) -> None:
    """Refuse what an --inputs function returned when no tensor is in it (None, a list of numbers, arrays)."""
    import torch

    from ..engine.replay import tensor_leaves

    given = (*inputs, *kwargs.values())
    if any(type(v).__module__ == "numpy" for v in given):
        raise UserError(f"the inputs function {spec!r} returned NumPy arrays; return tensors (torch.from_numpy(array))")
    if not any(isinstance(t, torch.Tensor) for t in tensor_leaves((inputs, kwargs))):
        got = ", ".join(type(v).__name__ for v in given) or "nothing"
        raise UserError(f"the inputs function {spec!r} returned no tensor ({got}); return the input tensor, a tuple "
                        "of them, or a dict of keyword inputs such as {'input_ids': ids, 'labels': ids}")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is comma-separated integers like 8,128; got {text!r}") from None
    if not shape or min(shape) <= 0:
        raise argparse.ArgumentTypeError(f"a shape is positive integers like 8,128; got {text!r}")
    return shape


def _profile_of(args: argparse.Namespace):
    from ..planning.workflow import profile

    model, inputs, kwargs = _model_and_inputs(args)
    _check_forward(model, inputs, kwargs, args)
    with _running_the_model(args):
        return profile(model, *inputs, modules=args.modules, device=getattr(args, "device", None),
                       fresh_timings=getattr(args, "fresh_timings", False), hold_output=not args.drop_output,
                       ops=bool(_FROM_GRAPHS & set(getattr(args, "allow", ()))), **kwargs)


@contextlib.contextmanager
def _running_the_model(args: argparse.Namespace) -> Iterator[None]:
    """Where the library runs the user's model: its refusals and the model's failures become one line, and its
    warnings are printed once each in the command's terms (after a failure they would only bury its line)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except ValueError as error:
            raise UserError(_in_command_terms(_unprefixed(str(error)))) from error
        except (RuntimeError, TypeError) as error:
            if str(error).startswith("remat."):  # remat's own check of the inputs, already in one line
                raise UserError(_in_command_terms(_unprefixed(str(error)))) from error
            if ranked.another_rank_failed(error):
                raise UserError("another rank failed (its line says why), so this one stops too") from error
            first_line = str(error).strip().splitlines()[0]
            floats = "; --input-shape gives random floats: for token ids give --inputs" if args.input_shape else ""
            raise UserError(f"running the model on the given inputs failed ({type(error).__name__}: {first_line}); "
                            f"check --input-shape / --inputs against the model's forward{floats}") from error
    _print_warnings(args.command, caught)


def _check_forward(model: torch.nn.Module, inputs: tuple, kwargs: dict, args: argparse.Namespace) -> None:
    """Refuse inputs that do not fit the model's forward before anything runs, saying how to give them."""
    import inspect

    from ..planning.workflow import forward_mismatch

    problem = forward_mismatch(model, inputs, kwargs)
    if not problem:
        return
    if args.inputs:
        raise UserError(f"{problem}; make --inputs {args.inputs} return a tuple for positional inputs or a dict for "
                        "keyword inputs")
    required = [name for name, p in inspect.signature(model.forward).parameters.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    example = "{" + ", ".join(f"'{name}': ..." for name in required) + "}"
    raise UserError(f"{problem}; --input-shape gives positional float inputs only: for other inputs give --inputs "
                    f"MODULE:FN returning a dict of keyword inputs, e.g. {example}")


def _print_warnings(command: str, caught: list[warnings.WarningMessage]) -> None:
    """The profile's warnings, once each, as one line in the command's terms."""
    from ..planning.workflow import SummedLossWarning

    lines: dict[str, None] = {}
    if ranked.rank():  # under torchrun: every rank profiled alike, rank 0 says it
        return
    for warning in caught:
        if isinstance(warning.message, SummedLossWarning):
            if not warning.message.labels_missing:
                continue  # a plain output: its sum is the command's loss (see --help)
            text = ("the model returned no loss (no labels among its inputs), so the profile backpropagates the sum "
                    "of its outputs, not your training loss; return labels from --inputs, e.g. "
                    "{'input_ids': ids, 'labels': ids}")
        else:
            text = _unprefixed((str(warning.message).strip().splitlines() or [""])[0])
        lines[f"remat {command}: warning: {text}"] = None
    for line in lines:
        print(line, file=sys.stderr)


def _unprefixed(message: str) -> str:
    """A library message without its ``remat.profile: `` prefix: the command names itself."""
    import re

    return re.sub(r"^remat\.[\w.]+(\([^)]*\))?: ", "", message)


def _in_command_terms(message: str) -> str:
    """A library message with its Python spelling of the blocks to plan (``modules=[...]``) as the command
    line spells it."""
    return message.replace("modules=[...]", "--modules NAME [NAME ...] (qualified module names)")


def _profile_cmd(args: argparse.Namespace) -> int:
    prof = _profile_of(args)
    if args.json:
        print(json.dumps(prof.to_dict(), indent=2))
    else:
        print(prof)
        for note in prof.notes:
            print(f"note: {note}")
    return 0


def _plan_cmd(args: argparse.Namespace) -> int:
    from ..planning.solve.solver import InfeasibleBudget

    if args.output and len(args.budget) > 1:
        raise UserError("-o writes one plan: give a single --budget with it")
    prof = _profile_of(args)  # one profile serves every budget
    made = 0
    for index, budget in enumerate(args.budget):
        if len(args.budget) > 1:
            print(("\n" if index else "") + f"== budget {budget} ==")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                plan = prof.plan(budget, allow=tuple(args.allow))
            except InfeasibleBudget as error:
                if len(args.budget) == 1:
                    raise UserError(_in_command_terms(str(error))) from error
                print(f"refused: {_in_command_terms(str(error))}")
                continue
            except ValueError as error:  # options this device cannot have, and nothing else asked for
                raise UserError(_unprefixed(str(error))) from error
        if not made:  # the options' warning, once for every budget (a refusal states it)
            _print_warnings(args.command, caught)
        made += 1
        print(plan)
        if args.output and ranked.rank() == 0:  # every rank made the same plan: one writes it
            plan.save(args.output)
            print(f"plan written to {args.output}; apply it with remat.Plan.load({args.output!r}).apply(model)")
    if args.front:
        with warnings.catch_warnings(record=True):  # the options' warning is printed with the first plan
            print(f"\nremat's plans beside every-k and offloaded inputs:\n{prof.front(allow=tuple(args.allow))}")
    if not made:
        raise UserError("no budget could be met; the messages above give the smallest peak any plan reaches")
    return 0


def _load_plan(path: str):
    """The plan file ``path``, loaded; a missing file, or one that is not a plan, is told alike in every command."""
    from ..planning.solve.plan import Plan, PlanFileError

    try:
        return Plan.load(path)
    except PlanFileError as error:
        raise UserError(_unprefixed(str(error))) from error
    except OSError as error:
        raise UserError(f"cannot read the plan {path} ({error.strerror or error}); make one with "
                        f"`remat plan ... -o {path}`") from error


def _check_cmd(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    from ..planning.check import check_plan

    model, inputs, kwargs = _model_and_inputs(args)
    _check_forward(model, inputs, kwargs, args)
    console = _console()
    with _running_the_model(args), _progress(console) as progress:
        task = progress.add_task(f"{args.steps} steps with and without the plan", total=args.steps)
        built = ranked.built_once(model, lambda: _call(_load(args.model, "MODULE:FACTORY"), "the factory", args.model))
        result = check_plan(built, plan, *inputs, steps=args.steps,
                            optimizer=args.optimizer, on_step=lambda row: progress.advance(task), **kwargs)
    results = ranked.gathered(result)  # under torchrun: every rank's check, on every rank
    per_rank = " on every rank" if len(results) > 1 else ""
    console.print(ranked.check_table(
        results, f"{args.steps} {args.optimizer} steps of {args.model} with and without {args.plan}{per_rank} "
                 "(peaks above parameters and buffers; forward + backward times)"))
    for index, each in enumerate(results):
        prefix = f"rank {index}: " if len(results) > 1 else ""
        for note in each.notes:
            console.print(f"{prefix}note: {note}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"{prefix}{each.verdict()}", markup=False, highlight=False, soft_wrap=True)
    return 0 if all(each.holds for each in results) else 1


def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"the number of steps is a positive integer like 4; got {text!r}")
    return steps


def _show_cmd(args: argparse.Namespace) -> int:
    plan = _load_plan(args.plan)
    meta = plan.meta
    if meta.get("model"):
        shapes = ", ".join(f"{name} {shape}" for name, shape in meta.get("inputs", {}).items())
        print(f"a plan for {meta['model']}" + (f" at inputs {shapes}" if shapes else ""))
    print(plan)
    return 0


def _bench_cmd(args: argparse.Namespace) -> int:
    from .bench import run

    run(args)
    return 0


# ---- parser -----------------------------------------------------------------------------------------
_EXAMPLES = {
    "demo": """examples:
  remat demo                         # 4 blocks, d_model 128, 5 steps per mode, plot in remat_demo.png
  remat demo --budget 35%            # a tighter plan
  remat demo --layers 2 --steps 2 --seq-len 64 --plot /tmp/demo.png   # a quick look
""",
    "profile": """examples:
  remat profile mypkg.models:build --input-shape 8,128
  remat profile mypkg.models:build --inputs mypkg.data:batch --json
  remat profile mypkg.models:build_huge --inputs mypkg.data:batch --device meta
""",
    "plan": """examples:
  remat plan mypkg.models:build --input-shape 8,128 --budget 50%
  remat plan mypkg.models:build --inputs mypkg.data:batch --budget 8GiB -o plan.json
  remat plan mypkg.models:build --inputs mypkg.data:batch --budget 30% 50% 70%   # one profile
  torchrun --nproc_per_node 2 -m remat plan mypkg.models:build_sharded --inputs mypkg.data:batch --budget 70%
  (--inputs may return a tuple of positional inputs or a dict of keyword inputs, e.g. input_ids and labels)
""",
    "check": """examples:
  remat check mypkg.models:build --plan plan.json --input-shape 8,128
  remat check mypkg.models:build --plan plan.json --inputs mypkg.data:batch --steps 8 --optimizer sgd
  torchrun --nproc_per_node 2 -m remat check mypkg.models:build_sharded --plan plan.json --inputs mypkg.data:batch
  (exit status: 0 when the plan holds, 1 when it does not, 2 for a mistake in the command line)
""",
    "show": """examples:
  remat show plan.json
""",
    "bench": """examples:
  remat bench                              # every case: tiny, gpt, conv, wide
  remat bench --cases tiny --repeats 21
""",
}


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and its inputs, read by :func:`_model_and_inputs` (every command that runs a user's model)."""
    parser.add_argument("model", metavar="MODULE:FACTORY", help="a function (or class) that returns the model")
    parser.add_argument("--input-shape", type=_shape, action="append", metavar="SHAPE",
                        help="one random float input of this shape (repeat for several inputs)")
    parser.add_argument("--inputs", metavar="MODULE:FN",
                        help="a function returning the input, a tuple of inputs, or a dict of keyword inputs")


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its inputs, and what to profile (``profile`` and ``plan``)."""
    _add_model_arguments(parser)
    parser.add_argument("--modules", nargs="+", metavar="NAME",
                        help="candidate modules by qualified name (default: the repeated blocks, or where the model "
                             "has none its children in order, planned as a chain of segments)")
    parser.add_argument("--device", choices=["meta"], help="profile on the meta device: no allocation")
    parser.add_argument("--fresh-timings", action="store_true",
                        help="measure op times again instead of reusing this machine's (REMAT_CACHE_DIR)")
    parser.add_argument("--drop-output", action="store_true", help="for a loop that drops the output after its loss")


_LOSS = ("The step's loss is the output's .loss (a Hugging Face model given labels by --inputs) or else the sum "
         "of the output. The output is held until backward ends, as in the usual loop, or let go of once the loss is "
         "computed with --drop-output (check: as the plan was made).")


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    """The command line's parser; ``bench``'s options (which import torch) only when ``argv`` runs it."""
    parser = _Parser(prog="remat", description="Activation checkpointing for PyTorch.")
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=description, epilog=_EXAMPLES[name],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
        return sub

    demo = command("demo", "train the built-in GPT under each checkpointing mode and compare",
                   "Train the built-in GPT-style model on synthetic tokens (no downloads) with no checkpointing, "
                   "every block checkpointed, every block with save_matmuls, and the planner's plan at a budget, "
                   "from identical weights and batches; print peak memory, step time and the largest "
                   "loss/gradient difference, and plot memory by block and over one step.")
    demo.add_argument("--layers", type=at_least(2, "the planner chooses among repeated blocks"), default=4,
                      help="transformer blocks (default 4, at least 2)")
    demo.add_argument("--d-model", type=at_least(1), default=128, help="model width (default 128)")
    demo.add_argument("--heads", type=at_least(1), default=4, help="attention heads (default 4)")
    demo.add_argument("--seq-len", type=at_least(1), default=256, help="tokens per sequence (default 256)")
    demo.add_argument("--vocab-size", type=at_least(2), default=512, help="vocabulary size (default 512)")
    demo.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per step (default 8)")
    demo.add_argument("--dropout", type=fraction_below_one, default=0.1, help="dropout probability (default 0.1)")
    demo.add_argument("--steps", type=at_least(1), default=5, help="training steps per mode (default 5)")
    demo.add_argument("--budget", type=_budget, default="50%",
                      help="the plan's budget: a fraction of the no-checkpointing peak above parameters "
                           "(0.5 or 50%%, the default) or a size (200MiB)")
    demo.add_argument("--plot", type=writable_file, default="remat_demo.png",
                      help="PNG to write (default remat_demo.png; '' for none)")
    demo.add_argument("--seed", type=int, default=0, help="seed for weights, data and dropout")
    demo.add_argument("--threads", type=at_least(0), default=0, help="torch CPU threads (default 0: torch's)")
    add_optimizer_argument(demo)
    demo.set_defaults(run=_demo)

    prof = command("profile", "profile a model: activation memory and time per block",
                   "Run one training step of MODULE:FACTORY's model (no checkpointing) and print, per candidate "
                   "block, the activations it keeps for backward, its input/output bytes and forward time. "
                   f"{_LOSS}")
    _add_profile_arguments(prof)
    prof.add_argument("--json", action="store_true", help="print JSON instead of a table")
    prof.set_defaults(run=_profile_cmd)

    plan = command("plan", "the cheapest checkpointing plan that fits a memory budget",
                   "Profile MODULE:FACTORY's model and print the plan (keep / checkpoint / save_matmuls / selective "
                   "(chosen op outputs kept) / offload per block, or a segment: consecutive layers of an "
                   "nn.Sequential checkpointed as one region) with the least recomputation whose predicted peak "
                   f"fits --budget. {_LOSS}")
    _add_profile_arguments(plan)
    plan.add_argument("--budget", type=_budget, required=True, nargs="+",
                      help="a fraction of the unplanned peak above parameters (0.5 or 50%%) or the whole-step peak "
                           "as a size (8GiB, 512MB); a bare number below 1 MiB is refused (did you mean 50%%?); "
                           "several budgets are planned from one profile")
    plan.add_argument("--allow", nargs="+", default=list(_ALLOW), choices=list(_ALLOWED),
                      help="options the plan may use (selective: keep chosen op outputs of a block, recompute "
                           "the rest; on an accelerator only: offload, move a block's activations, or chosen op "
                           "outputs, to host memory; checkpoint_offload, checkpoint with the block's inputs in host "
                           "memory; default: all but offload)")
    plan.add_argument("--front", action="store_true", help="also print remat's plans beside the rules' points")
    plan.add_argument("-o", "--output", type=writable_file, help="write the plan as JSON")
    plan.set_defaults(run=_plan_cmd)

    check = command("check", "check a plan on its model: measured vs predicted peak, time and gradients",
                    "Train MODULE:FACTORY's model for a few steps (the same inputs each step, an optimizer stepping "
                    "between them) with the plan applied and without it, from identical weights and seeds, and "
                    "print per step the peak memory and time predicted, measured and without the plan, and whether "
                    "the gradients are bitwise equal. The plan holds when every step peaks within 3% of the "
                    "predicted peak with equal gradients (exit 0; else 1); extra time off its prediction by more "
                    f"than 20% is a warning, not a failure. {_LOSS}")
    _add_model_arguments(check)
    check.add_argument("--plan", required=True, metavar="PLAN.JSON", help="a plan written by remat plan -o")
    check.add_argument("--steps", type=_steps, default=4, help="training steps (default 4)")
    add_optimizer_argument(check)
    check.set_defaults(run=_check_cmd)

    show = command("show", "print a plan saved by `remat plan -o`",
                   "Read a plan written by `remat plan -o PLAN.json` (or Plan.save) and print it, as `remat plan` "
                   "printed it, with what it was made for.")
    show.add_argument("plan", metavar="PLAN.json", help="a plan file")
    show.set_defaults(run=_show_cmd)

    bench = command("bench", "benchmark remat against torch.utils.checkpoint and no checkpointing",
                    "Time a training step of each case under no checkpointing, torch.utils.checkpoint and remat "
                    "(both variants), interleaved, and print ratios and peak memory.")
    if next((a for a in argv if not a.startswith("-")), None) == "bench":
        from .bench import add_arguments

        add_arguments(bench)
    bench.set_defaults(run=_bench_cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``remat`` command.

    Example:
        >>> main(["demo", "--layers", "2", "--steps", "2", "--seq-len", "32", "--plot", ""])
        0
    """
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    try:
        if args.command not in ("profile", "plan", "check"):
            return args.run(args)
        with ranked.process_group(), ranked.speaking():  # under torchrun: every rank runs it, rank 0 prints
            return args.run(args)
    except UserError as error:
        if args.debug:
            raise
        print(f"remat {args.command}: error{ranked.where()}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if args.debug:
            raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(f"remat {args.command}{ranked.where()}: {type(error).__name__}: {first_line} (run with --debug for the "
              "traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
