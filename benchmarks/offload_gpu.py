"""Offloading saved activations to host memory on a GPU: forward and backward apart, and each one's peak.

Run by hand on a machine with CUDA:

    python benchmarks/offload_gpu.py                          # the Llama of benchmarks/gpu.py, 3 rounds
    python benchmarks/offload_gpu.py --layers 4 --rounds 5    # a smaller model

The model and the step are those of ``benchmarks/gpu.py`` (``LlamaForCausalLM`` from a config, bf16, SDPA).
Modes, interleaved round by round with the order rotated, after one warm-up round:

* ``plain`` — no hooks;
* ``torch save_on_cpu`` — ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``remat save_on_cpu`` — ``remat.save_on_cpu(pin_memory=True)``;
* ``remat offload()`` — ``remat.offload()`` (its defaults: tensors of 1 MiB and more);
* ``remat offload(), no window`` — the same with the copy engine's ``in_flight_limit`` lifted, which shows
  what the window costs in time and saves in memory.

Each step is timed with CUDA events at its start, between forward and backward, and at its end (the host
waits only at the end of the step); a forward's peak and the step's peak are
``torch.cuda.max_memory_allocated`` above the step's start.  Without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

import remat
from remat.policies.hostcopy import engine_for

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpu  # noqa: E402 - the shared Llama workload


def _step(work: gpu.Workload, context: Callable[[], Any]) -> tuple[float, float, int, int]:
    """One training step: forward ms, backward ms, forward peak and step peak (bytes above its start)."""
    work.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    with context():
        loss = work.model(**work.inputs).loss
    middle.record()
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - base
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(middle), middle.elapsed_time(end), forward_peak, torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def _no_window() -> Any:
    engine = engine_for("cuda")
    limit, engine.in_flight_limit = engine.in_flight_limit, 1 << 62
    try:
        with remat.offload(device_type="cuda"):
            yield
    finally:
        engine.in_flight_limit = limit


MODES: dict[str, Callable[[], Any]] = {
    "plain": contextlib.nullcontext,
    "torch save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
    "remat save_on_cpu": lambda: remat.save_on_cpu(pin_memory=True, device_type="cuda"),
    "remat offload()": lambda: remat.offload(device_type="cuda"),
    "remat offload(), no window": _no_window,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    for name, value in gpu.FULL.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_gpu.py: no CUDA device here; nothing to measure.")
        return 0
    args.dtype = torch.bfloat16
    work = gpu.build(args, torch.device("cuda"))
    names = list(MODES)
    rows: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in names}
    for round_index in range(args.rounds + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            measured = _step(work, MODES[name])
            if round_index:
                rows[name].append(measured)
    plain_step = statistics.median(f + b for f, b, _, _ in rows["plain"])
    plain_peak = max(p for *_, p in rows["plain"])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers, hidden {args.hidden}, "
          f"batch {args.batch} x seq {args.seq}; median of {args.rounds} interleaved rounds after 1 warm-up")
    print("| mode | forward ms | backward ms | step ms | × plain | forward peak MiB | step peak MiB | × plain's peak |")
    print("|---|---|---|---|---|---|---|---|")
    for name, measured in rows.items():
        forward = statistics.median(m[0] for m in measured)
        backward = statistics.median(m[1] for m in measured)
        step = statistics.median(m[0] + m[1] for m in measured)
        forward_peak, peak = max(m[2] for m in measured), max(m[3] for m in measured)
        print(f"| {name} | {forward:.1f} | {backward:.1f} | {step:.1f} | {step / plain_step:.2f} | "
              f"{forward_peak / 2**20:.0f} | {peak / 2**20:.0f} | {peak / plain_peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
