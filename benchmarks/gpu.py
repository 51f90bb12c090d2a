"""remat on the GPU: every way of checkpointing a Hugging Face Llama, timed on the device, side by side.

Run by hand on a machine with CUDA (most of the time goes to compiling: every compiled mode compiles its own
graphs):

    python benchmarks/gpu.py                                   # the full table, gpu_results.json
    python benchmarks/gpu.py --quick                           # every eager row, fewer rounds, no compiling
    python benchmarks/gpu.py --quick --model gpt2 --json gpt2.json   # the second model
    python benchmarks/gpu.py --modes 'plan-*' --no-compile     # plain and the eager plans only
    python benchmarks/gpu.py --layers 4 --batch 2 --seq 1024   # a smaller model
    python benchmarks/gpu.py --device cpu --tiny --rounds 2 --warmup 1   # a smoke run of the whole script

The model (``--model``) is ``LlamaForCausalLM`` built from a config (random weights, no downloads; default
hidden 2048, 12 layers, 16 heads, intermediate 5632, vocab 32000, batch 4 x seq 2048) or ``GPT2LMHeadModel``
(GPT-2 medium's width: hidden 1024, 16 layers, 16 heads, vocab 50257, batch 8 x seq 1024); bf16, SDPA
attention, ``use_cache=False``.  One training step is forward + backward of
``model(input_ids=ids, labels=ids).loss``.  The modes and the models are in ``gpu_modes.py``: besides the
shared paths (torch's and remat's checkpoint, selective policies, offload), every-k rows (25/50/75% of the
layers checkpointed, spread evenly), checkpoint with offloaded inputs (every layer but the last), and plans at
70/50/30%, at 50/30% with offload allowed, at 50/30% mixing only checkpointed layers and kept layers whose
largest saved tensors go to host memory (``keep_offload``), and at the lowest peak any plan reaches; before the
table, remat's predicted front beside the rules' points.
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
  profiler's allocation events (``remat.planning.basics.memory.profiled_peak``), from the same start. Both compare
  with ``plan.predicted_peak - plan.param_bytes``, which counts neither parameters nor optimizer state.
* Eager modes share one model: layers are wrapped (``model.model.layers[i]`` replaced by a module that calls
  ``fn(layer, *args, **kwargs)``) or a plan applied before the step, and restored after it.  Compiled modes
  each compile their own copy of the module tree (sharing the parameters); torch.compile's
  ``activation_memory_budget`` is patched around every step of its mode, so it is in effect when the graph
  compiles at the first call (and at any recompilation).
* remat's plans at 70/50/30% come from one ``remat.profile`` and are shown with predicted vs measured peak
  and extra time; compiled, a plan is applied and the model then compiled (remat lowers its wrappers into
  the compiler's own rematerialization under dynamo).
* The compiled front: for each of torch.compile's ``activation_memory_budget`` values (1, its default, and
  0.7/0.5/0.3) one untimed step measures the peak it reaches, and remat plans for that peak (checkpoint,
  save_matmuls and selective options: what lowers into the compiler) and runs compiled beside it
  (``compiled-match-<budget>``); a last table says, per budget, whether remat's point is as fast and as small.

A row that runs out of memory reads OOM; the other rows go on.  Without CUDA (and without ``--device cpu``)
the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import remat
from remat.planning.basics.memory import profiled_peak
from remat.planning.basics.optimizers import make_optimizer
from remat.planning.measure.timing import Clock
from remat.tools.arguments import add_optimizer_argument

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_report, beside this file however it is loaded
from gpu_modes import (  # noqa: E402
    COMPILE_BUDGETS,
    COMPILED_KEYS,
    EAGER_KEYS,
    PLANS,
    Mode,
    Workload,
    budget_key,
    build,
    compiled_modes,
    eager_modes,
    matched_key,
    select,
)
from gpu_report import Row, mib, print_header, report, save, summarize  # noqa: E402

# Sizes by model: the Llama of the measured tables, and GPT-2 medium's width at 16 layers.
FULL = {"llama": {"hidden": 2048, "layers": 12, "heads": 16, "intermediate": 5632, "vocab": 32000, "batch": 4,
                  "seq": 2048},
        "gpt2": {"hidden": 1024, "layers": 16, "heads": 16, "intermediate": 4096, "vocab": 50257, "batch": 8,
                 "seq": 1024}}
TINY = {"hidden": 32, "layers": 8, "heads": 2, "intermediate": 88, "vocab": 128, "batch": 4, "seq": 128}
OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


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


def _profile_plans(work: Workload, keys: list[str], repeats: int,
                   save_to: str | None = None) -> tuple[dict[str, remat.Plan | str], remat.Profile]:
    """The plans of ``keys`` (:data:`gpu_modes.PLANS`) from one profile, or why one was refused; the profile
    (it holds no tensors)."""
    prof = remat.profile(work.model, repeats=repeats, hold_output=False, **work.inputs)  # as its step: .loss.backward()
    if save_to:
        # the profile holds no tensors: re-planning from it elsewhere (a CPU machine) uses this device's prices
        with open(save_to, "wb") as f:
            pickle.dump(prof, f)
    plans: dict[str, remat.Plan | str] = {}
    for key in keys:
        fraction, allow, label = PLANS[key]
        try:
            if fraction is None:
                lowest = min(prof.front(allow=allow).plans, key=lambda point: point.peak)
                plans[key] = prof.plan(lowest.peak, allow=allow)
            else:
                plans[key] = prof.plan(fraction, allow=allow)
            print(f"\n{label}:\n{plans[key]}")
        except remat.InfeasibleBudget as error:
            plans[key] = f"refused: the smallest plan peaks at {mib(error.smallest - error.param_bytes)} MiB"
    if keys:
        print(f"\nremat's plans beside the rules, predicted:\n{prof.front(allow=PLANS[keys[-1]][1])}")
    work.free()
    return plans, prof


# Options remat lowers into the compiler's own rematerialization (offloading copies are eager-only).
_COMPILED_ALLOW = ("checkpoint", "save_matmuls", "selective")


def _matched_plans(work: Workload, prof: remat.Profile, modes: list[Mode], keys: list[str]
                   ) -> dict[str, remat.Plan]:
    """remat's plan at the peak each of torch.compile's budgets reaches (one untimed step of that mode, which
    also compiles it), for the keys of ``keys`` among :func:`gpu_modes.matched_key`'s."""
    by_key = {mode.key: mode for mode in modes}
    plans = {}
    for budget in (1, *COMPILE_BUDGETS):
        key, reference = matched_key(budget), by_key.get(budget_key(budget))
        if key not in keys:
            continue
        if reference is None:
            print(f"{key}: skipped, it needs {budget_key(budget)} in --modes", file=sys.stderr)
            continue
        measured = _attempt(work, reference)
        if isinstance(measured, str):
            continue
        peak = measured[1]
        if peak is None:  # the CPU: the profiler's allocation events
            with reference.installed():
                peak = profiled_peak(reference.step)
            work.model.zero_grad(set_to_none=True)
        try:
            plans[key] = prof.plan(prof.param_bytes + prof.buffer_bytes + peak, allow=_COMPILED_ALLOW)
        except remat.InfeasibleBudget as error:
            print(f"{key}: no plan reaches {mib(peak)} MiB ({error})", file=sys.stderr)
    return plans


def _compiled_front(entries: list[dict[str, Any]]) -> str:
    """Per budget of torch.compile: its point, remat's compiled plan at that peak, and which is left of which."""
    by_key = {e["key"]: e for e in entries}
    lines = ["| torch.compile budget | its ms / MiB | remat at its peak: ms / MiB | remat dominates |",
             "|---|---|---|---|"]
    for budget in (1, *COMPILE_BUDGETS):
        theirs, ours = by_key.get(budget_key(budget)), by_key.get(matched_key(budget))
        if not theirs or not ours or "median_ms" not in theirs or "median_ms" not in ours:
            continue
        both = theirs["peak"] is not None and ours["peak"] is not None
        dominates = both and ours["median_ms"] <= theirs["median_ms"] and ours["peak"] <= theirs["peak"]
        lines.append(f"| {budget:g} | {theirs['median_ms']:.1f} / {mib(theirs['peak'] or 0)} | "
                     f"{ours['median_ms']:.1f} / {mib(ours['peak'] or 0)} | {'yes' if dominates else 'no'} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def header(work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    device = work.device
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "remat": remat.__version__,
        "model": {k: getattr(args, k) for k in TINY} | {"family": args.model,
                                                      "dtype": str(args.dtype).removeprefix("torch."),
                                                      "parameters": sum(p.numel() for p in work.model.parameters())},
        "rounds": args.rounds, "warmup": args.warmup, "optimizer": args.optimizer,
    }
    if device.type == "cuda":
        info["bandwidth"] = copy_bandwidths(device, args.copy_mib << 20)
    return info


# ------------------------------------------------------------------------------------------------------ main


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(FULL), default="llama", help="the model family (default llama)")
    for name in TINY:
        parser.add_argument(f"--{name}", type=int, help=f"default {FULL['llama'][name]} for llama, "
                            f"{FULL['gpt2'][name]} for gpt2 ({TINY[name]} with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds after 1 warm-up, 2 profile repeats, no compiled rows: minutes on one GPU")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 7; 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 2; 1 with --quick)")
    parser.add_argument("--modes", nargs="+", help="mode names or shell patterns (plain always runs); "
                        f"modes: {' '.join(EAGER_KEYS + COMPILED_KEYS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the torch.compile rows (default: on CUDA only)")
    add_optimizer_argument(parser)
    parser.add_argument("--profile-repeats", type=int, help="remat.profile's repeats (default 5; 2 with --quick)")
    parser.add_argument("--copy-mib", type=int, default=512, help="bytes per bandwidth copy, MiB")
    parser.add_argument("--json", default="gpu_results.json", help="where to write the results")
    parser.add_argument("--save-profile", help="pickle remat.profile's result here (to re-plan from it elsewhere)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda (or cuda:N) or cpu, got {args.device!r}")
    for name, value in (TINY if args.tiny else FULL[args.model]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, usual, quick in (("rounds", 7, 3), ("warmup", 2, 1), ("profile_repeats", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else usual)
    if args.quick and args.compile is None:
        args.compile = False
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

    wanted = [key for key in PLANS if {key, f"compiled-{key}"} & set(keys)]
    plans, prof = _profile_plans(work, wanted, args.profile_repeats, args.save_profile)
    work.optimizer = make_optimizer(args.optimizer, work.model.parameters())
    work.step()  # the optimizer's state exists from the first measured step on, as in a training loop
    work.optimizer.step()
    work.free()
    eager = [m for m in eager_modes(work, plans) if m.key in keys]
    rows = run_phase(work, eager, args.rounds, args.warmup, "eager")
    for key, plan in plans.items():
        row = rows.get(key)
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
        matched = compiled_modes(work, plans, _matched_plans(work, prof, modes, keys))
        modes += [build_mode() for key, build_mode in matched.items() if key.startswith("compiled-match-")]
        compiled_rows = run_phase(work, modes, args.rounds, args.warmup, "compiled")
        compiled = [e for e in summarize(compiled_rows, compiled_rows["plain"]) if e["key"] != "plain"]
        del modes, builders, compiled_rows
        work.free()
        print("\ncompiled (each row's ratio is to plain eager, run in the same rounds):")
        report(compiled, info, None)
        front = _compiled_front(compiled)
        if front:
            print(f"\ntorch.compile's budgets against remat's plans compiled at the same peak:\n{front}")
        entries += compiled
        save(entries, info, args.json)
    failed = [e["label"] for e in entries if (e["failure"] or "").startswith("failed")]
    if failed:
        print(f"\nfailed rows (tracebacks above): {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
